"""Features applications declare, as RabbitMQ behaves: direct reply-to (an RPC round trip
with pika), alternate exchanges (kombu declares one), consumer priorities, single active
consumer, and global prefetch shared by a channel's consumers. Every test here also
passes against RabbitMQ 3.10 (tests/python/with-rabbitmq.sh)."""

import time

import pika
import pika.exceptions as pe
import pytest
from kombu import Exchange, Producer, Queue

REPLY_TO = "amq.rabbitmq.reply-to"


def test_rpc_round_trip_over_direct_reply_to(broker, conn, ch, names):
    requests = names.queue()
    ch.queue_declare(requests)

    # The server: another connection, answering on the default exchange to
    # whatever reply_to the request carries.
    server_conn = broker.connect()
    seen_reply_to = []
    try:
        server = server_conn.channel()

        def answer(channel, method, props, body):
            seen_reply_to.append(props.reply_to)
            channel.basic_publish("", props.reply_to, b"re: " + body,
                                  pika.BasicProperties(correlation_id=props.correlation_id))
            channel.basic_ack(method.delivery_tag)

        server.basic_consume(requests, answer)

        replies = []
        ch.basic_consume(REPLY_TO, lambda c, m, p, b: replies.append((p.correlation_id, b)),
                         auto_ack=True)
        for n in range(3):
            ch.basic_publish("", requests, f"q{n}".encode(),
                             pika.BasicProperties(reply_to=REPLY_TO, correlation_id=str(n)))
        deadline = time.monotonic() + 10
        while len(replies) < 3 and time.monotonic() < deadline:
            server_conn.process_data_events(time_limit=0.05)
            conn.process_data_events(time_limit=0.05)
        assert sorted(replies) == [("0", b"re: q0"), ("1", b"re: q1"), ("2", b"re: q2")]
        # The name handed out is the pseudo-queue's plus a suffix for the channel,
        # the same for every request of that channel; no queue of that name exists.
        assert len(set(seen_reply_to)) == 1
        name = seen_reply_to[0]
        assert name.startswith(REPLY_TO + ".") and len(name) > len(REPLY_TO) + 1

        # The requesting channel closes: a reply to its name is unroutable, returned
        # when mandatory (as RabbitMQ 3.10 does), else dropped; nothing is queued.
        ch.close()
        server.confirm_delivery()
        with pytest.raises(pe.UnroutableError):
            server.basic_publish("", name, b"too late", mandatory=True)
        server.basic_publish("", name, b"too late, dropped")
    finally:
        server_conn.close()


@pytest.mark.spillway_only
def test_a_passive_declare_of_a_reply_to_name(conn):
    """A passive declare of a live reply-to name succeeds and of a gone one is 404, as
    RabbitMQ's code means it to (RabbitMQ 3.10.8 closes the connection with 541
    INTERNAL_ERROR instead: its channel crashes on it)."""
    ch = conn.channel()
    names = []
    ch.basic_consume(REPLY_TO, lambda c, m, p, b: None, auto_ack=True)
    ch.queue_declare(REPLY_TO, passive=True)
    server = conn.channel()
    # Learn the name the way a server does: from a request's reply_to.
    request_q = server.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", request_q, b"?", pika.BasicProperties(reply_to=REPLY_TO))
    deadline = time.monotonic() + 5
    while not names and time.monotonic() < deadline:
        method, props, _ = server.basic_get(request_q, auto_ack=True)
        if method is not None:
            names.append(props.reply_to)
    assert names, "the request did not arrive"
    ok = server.queue_declare(names[0], passive=True)
    assert ok.method.message_count == 0
    ch.close()
    with pytest.raises(pe.ChannelClosedByBroker) as gone:
        server.queue_declare(names[0], passive=True)
    assert gone.value.reply_code == 404


def test_direct_reply_to_needs_no_ack_and_a_consumer_first(conn, names):
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker) as refused:
        ch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=False)
    assert refused.value.reply_code == 406

    ch = conn.channel()
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    with pytest.raises(pe.ChannelClosedByBroker) as refused:
        ch.basic_publish("", q, b"who answers?", pika.BasicProperties(reply_to=REPLY_TO))
    assert refused.value.reply_code == 406
    assert "fast reply consumer does not exist" in refused.value.reply_text


def test_kombu_alternate_exchange_takes_the_unroutable(kconn, names):
    ae = Exchange(names.exchange(), "fanout")
    unrouted_q = Queue(names.queue(), exchange=ae)
    orders = Exchange(names.exchange(), "direct", arguments={"alternate-exchange": ae.name})
    orders_q = Queue(names.queue(), exchange=orders, routing_key="order")
    got = {}
    with kconn.channel() as channel:
        for q in (unrouted_q, orders_q):
            q(channel).declare()
        producer = Producer(channel, exchange=orders)
        producer.publish(b"routed", routing_key="order")
        producer.publish(b"unrouted", routing_key="refund", mandatory=True)
        for q in (unrouted_q, orders_q):
            deadline = time.monotonic() + 5
            while q.name not in got and time.monotonic() < deadline:
                message = q(channel).get(no_ack=True)
                if message is not None:
                    got[q.name] = message.body
    assert got == {orders_q.name: b"routed", unrouted_q.name: b"unrouted"}


def test_consumer_priority_takes_first(conn, names):
    q = names.queue()
    setup = conn.channel()
    setup.queue_declare(q)
    low, high = conn.channel(), conn.channel()
    low.basic_qos(prefetch_count=100)
    high.basic_qos(prefetch_count=2)
    got = {"low": [], "high": []}
    low.basic_consume(q, lambda c, m, p, b: got["low"].append(b))
    high.basic_consume(q, lambda c, m, p, b: got["high"].append(b), arguments={"x-priority": 5})
    setup.confirm_delivery()
    for n in range(6):
        setup.basic_publish("", q, str(n).encode())
    deadline = time.monotonic() + 5
    while len(got["low"]) + len(got["high"]) < 6 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert got == {"high": [b"0", b"1"], "low": [b"2", b"3", b"4", b"5"]}


def test_single_active_consumer_and_its_successor(broker, conn, names):
    q = names.queue()
    setup = conn.channel()
    setup.queue_declare(q, arguments={"x-single-active-consumer": True})
    first_conn, second_conn = broker.connect(), broker.connect()
    got = {"first": [], "second": []}
    try:
        first = first_conn.channel()
        first.basic_consume(q, lambda c, m, p, b: got["first"].append(b), auto_ack=True)
        second = second_conn.channel()
        second.basic_consume(q, lambda c, m, p, b: got["second"].append(b), auto_ack=True)
        setup.confirm_delivery()
        for n in range(4):
            setup.basic_publish("", q, str(n).encode())
        deadline = time.monotonic() + 5
        while len(got["first"]) < 4 and time.monotonic() < deadline:
            first_conn.process_data_events(time_limit=0.05)
        second_conn.process_data_events(time_limit=0.2)
        assert got == {"first": [b"0", b"1", b"2", b"3"], "second": []}
        # The active consumer's connection goes: the second takes over.
        first_conn.close()
        setup.basic_publish("", q, b"4")
        deadline = time.monotonic() + 5
        while not got["second"] and time.monotonic() < deadline:
            second_conn.process_data_events(time_limit=0.05)
        assert got["second"] == [b"4"]
    finally:
        for c in (first_conn, second_conn):
            if c.is_open:
                c.close()


def _two_queues_of_ten(conn, names):
    q1, q2 = names.queue(), names.queue()
    setup = conn.channel()
    for q in (q1, q2):
        setup.queue_declare(q)
    setup.confirm_delivery()
    for q in (q1, q2):
        for n in range(10):
            setup.basic_publish("", q, str(n).encode())
    return q1, q2


def _consume_both(conn, qos, q1, q2):
    ch = conn.channel()
    for count, global_qos in qos:
        ch.basic_qos(prefetch_count=count, global_qos=global_qos)
    held = []
    for q in (q1, q2):
        ch.basic_consume(q, lambda c, m, p, b, q=q: held.append((q, m.delivery_tag)))
    return ch, held


def test_global_prefetch_is_shared_by_the_channels_consumers(conn, names):
    """basic.qos global=true limits the channel's unacked deliveries across all its
    consumers; global=false limits each consumer started afterwards. Set in this order
    (RabbitMQ's documented example), both hold at once."""
    q1, q2 = _two_queues_of_ten(conn, names)
    ch, held = _consume_both(conn, [(2, False), (3, True)], q1, q2)
    settle(conn, lambda: len(held) >= 3)
    # Three in all (the channel's limit), at most two from either queue.
    assert len(held) == 3
    assert max(sum(1 for q, _ in held if q == name) for name in (q1, q2)) == 2
    # One ack frees one place on the channel.
    ch.basic_ack(held[0][1])
    settle(conn, lambda: len(held) >= 4)
    assert len(held) == 4


def test_a_later_per_consumer_qos_lifts_the_global_one(conn, names):
    """RabbitMQ's reading, kept: basic.qos global=false after global=true turns the
    channel-wide limit off (rabbit_channel's unlimit_prefetch), leaving each consumer's."""
    q1, q2 = _two_queues_of_ten(conn, names)
    _, held = _consume_both(conn, [(3, True), (2, False)], q1, q2)
    settle(conn, lambda: len(held) >= 4)
    assert len(held) == 4
    assert [sum(1 for q, _ in held if q == name) for name in (q1, q2)] == [2, 2]


def settle(conn, reached, timeout=5.0, quiet=0.3):
    """Serves conn's events until `reached()` (failing after `timeout`), then for `quiet`
    seconds more, so that a delivery beyond the limit would show."""
    deadline = time.monotonic() + timeout
    while not reached():
        assert time.monotonic() < deadline, "the deliveries did not come"
        conn.process_data_events(time_limit=0.05)
    conn.process_data_events(time_limit=quiet)


def test_channel_flow_off_is_refused_as_rabbitmq_refuses_it(broker):
    """A client's channel.flow(active=false) closes the connection with 540, as in
    RabbitMQ; active=true is answered (a channel is already active)."""
    conn = broker.connect()
    try:
        ch = conn.channel()
        assert ch.flow(True) is True
        with pytest.raises((pe.ConnectionClosedByBroker, pe.ChannelClosedByBroker)) as refused:
            ch.flow(False)
        assert refused.value.reply_code == 540
        assert "active=false" in refused.value.reply_text
    finally:
        if conn.is_open:
            conn.close()


@pytest.mark.parametrize("method, text", [
    (lambda ch: ch.basic_recover(requeue=False), "requeue=false"),
    (lambda ch: ch.basic_qos(prefetch_size=10), "prefetch_size!=0 (10)"),
])
def test_what_rabbitmq_does_not_implement_is_refused_alike(broker, method, text):
    """basic.recover(requeue=false) and a byte prefetch close the connection with 540 and
    RabbitMQ's text, rather than being accepted and not done."""
    conn = broker.connect()
    try:
        with pytest.raises(pe.ConnectionClosedByBroker) as refused:
            method(conn.channel())
        assert refused.value.reply_code == 540
        assert refused.value.reply_text == f"NOT_IMPLEMENTED - {text}"
    finally:
        if conn.is_open:
            conn.close()


def test_aio_pika_rpc_pattern_and_its_teardown(broker):
    """aio-pika's RPC pattern end to end: a call and its answer, then closing it, which
    cancels the reply consumer (deleting its auto-delete queue) and then unbinds that queue;
    RabbitMQ answers the unbind of what is gone with ok, and so must Spillway (it used to
    close the channel with 404, failing about 40 of aio-pika's own tests)."""
    import asyncio

    import aio_pika
    from aio_pika.patterns import RPC

    async def multiply(*, x, y):
        return x * y

    async def scenario():
        connection = await aio_pika.connect(broker.url, timeout=10)
        async with connection:
            channel = await connection.channel()
            rpc = await RPC.create(channel)
            await rpc.register("spillway.multiply", multiply, auto_delete=True)
            results = [await rpc.proxy.spillway.multiply(x=n, y=7) for n in range(3)]
            await rpc.close()
            # The channel survived the teardown: it still answers.
            queue = await channel.declare_queue(exclusive=True)
            return results, queue.name, channel.is_closed

    results, name, closed = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert results == [0, 7, 14]
    assert name and not closed
