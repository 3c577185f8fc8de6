"""Publisher confirms and mandatory returns (pika and kombu)."""

import time

import amqp.exceptions
import kombu
import pika
import pika.exceptions
import pytest
from kombu import Exchange, Producer, Queue

from spillway_testlib import drain


@pytest.mark.parametrize("durable,delivery_mode", [(False, 1), (True, 1), (True, 2)],
                         ids=["transient", "durable-queue-transient-msg", "persistent"])
def test_pika_confirms(conn, names, durable, delivery_mode):
    ch = conn.channel()
    q = names.queue()
    ch.queue_declare(q, durable=durable)
    ch.confirm_delivery()
    for i in range(200):
        # BlockingChannel.basic_publish waits for basic.ack in confirm mode (raises on nack).
        ch.basic_publish("", q, str(i).encode(),
                         pika.BasicProperties(delivery_mode=delivery_mode))
    assert ch.queue_declare(q, passive=True).method.message_count == 200
    got = drain(ch, q)
    assert [b for _, _, b in got] == [str(i).encode() for i in range(200)]
    assert all(p.delivery_mode == delivery_mode for _, p, _ in got)


def test_pika_confirm_for_unroutable_non_mandatory(conn, names):
    ch = conn.channel()
    x = names.exchange()
    ch.exchange_declare(x, "direct")
    ch.confirm_delivery()
    ch.basic_publish(x, "nobody-listens", b"dropped")  # acked, silently dropped
    ch.basic_publish(x, "nobody-listens", b"dropped", mandatory=False)


def test_pika_mandatory_unroutable_with_confirms(conn, names):
    ch = conn.channel()
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "routed")
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError) as e:
        ch.basic_publish(x, "unrouted", b"come back",
                         pika.BasicProperties(message_id="ret-1", headers={"h": 1}),
                         mandatory=True)
    [ret] = e.value.messages
    assert ret.method.reply_code == 312
    assert ret.method.reply_text == "NO_ROUTE"
    assert ret.method.exchange == x and ret.method.routing_key == "unrouted"
    assert ret.properties.message_id == "ret-1" and ret.properties.headers == {"h": 1}
    assert ret.body == b"come back"
    # The channel is still usable, and a routable mandatory publish is just confirmed.
    ch.basic_publish(x, "routed", b"ok", mandatory=True)
    assert [b for _, _, b in drain(ch, q)] == [b"ok"]


def test_pika_mandatory_unroutable_default_exchange(conn, names):
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("", names.queue(), b"no such queue", mandatory=True)


def test_pika_mandatory_return_without_confirms(conn, names):
    ch = conn.channel()
    x = names.exchange()
    ch.exchange_declare(x, "topic")
    returned = []
    ch.add_on_return_callback(lambda c, m, p, b: returned.append((m, p, b)))
    ch.basic_publish(x, "a.b", b"r1", pika.BasicProperties(correlation_id="c1"), mandatory=True)
    ch.basic_publish(x, "a.c", b"r2", mandatory=True)
    ch.basic_publish(x, "a.d", b"not returned", mandatory=False)
    deadline = time.monotonic() + 3
    while len(returned) < 2 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    conn.process_data_events(time_limit=0.2)
    assert [(m.reply_code, m.routing_key, b) for m, _, b in returned] == \
        [(312, "a.b", b"r1"), (312, "a.c", b"r2")]
    assert returned[0][1].correlation_id == "c1"


# -- kombu -------------------------------------------------------------------------------

def _confirming(broker):
    return broker.kombu(transport_options={"confirm_publish": True})


@pytest.mark.parametrize("delivery_mode", [1, 2], ids=["transient", "persistent"])
def test_kombu_confirm_publish(broker, names, delivery_mode):
    qname = names.queue()
    with _confirming(broker) as conn:
        q = Queue(qname, routing_key=qname, durable=True)
        chan = conn.default_channel
        q(chan).declare()
        prod = Producer(chan)
        for i in range(50):
            prod.publish({"i": i}, routing_key=qname, serializer="json",
                         delivery_mode=delivery_mode)
        assert chan._confirm_selected  # the channel really is in confirm mode (py-amqp)
        _, count, _ = q(chan).queue_declare(passive=True)
        assert count == 50
        with conn.SimpleQueue(q) as sq:
            got = [sq.get(timeout=5) for _ in range(50)]
            for m in got:
                m.ack()
        assert [m.payload["i"] for m in got] == list(range(50))
        assert {m.properties["delivery_mode"] for m in got} == {delivery_mode}


def test_kombu_confirm_publish_reports_missing_exchange_synchronously(broker, names):
    # In confirm mode publish waits for the broker, so the 404 channel close surfaces
    # from publish() itself.
    with _confirming(broker) as conn:
        prod = Producer(conn.default_channel)
        with pytest.raises(amqp.exceptions.NotFound) as e:
            prod.publish("x", exchange=names.exchange(), routing_key="k", serializer="json",
                         declare=[])
        assert e.value.reply_code == 404


def test_kombu_on_return(kconn, names):
    x = Exchange(names.exchange(), type="direct", durable=False)
    returned = []

    def on_return(exc, exchange, routing_key, message):
        returned.append((exc.reply_code, exchange, routing_key, message.body))

    with kconn.channel() as chan:
        x(chan).declare()
        try:
            prod = Producer(chan, exchange=x, on_return=on_return)
            prod.publish(b"back", routing_key="nowhere", mandatory=True, serializer=None,
                         content_type="application/data", content_encoding="binary")
            deadline = time.monotonic() + 3
            while not returned and time.monotonic() < deadline:
                try:
                    kconn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
        finally:
            x(chan).delete()
    assert returned == [(312, x.name, "nowhere", b"back")]


def test_kombu_on_return_with_confirms(broker, names):
    x = Exchange(names.exchange(), type="fanout", durable=False)
    returned = []
    with _confirming(broker) as conn:
        chan = conn.default_channel
        x(chan).declare()
        try:
            prod = Producer(chan, exchange=x,
                            on_return=lambda exc, ex, rk, m: returned.append((exc.reply_code, rk)))
            prod.publish({"a": 1}, routing_key="rk", mandatory=True, serializer="json")
            deadline = time.monotonic() + 3
            while not returned and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
        finally:
            x(chan).delete()
    assert returned == [(312, "rk")]


def test_kombu_connection_url(broker, names):
    """kombu's URL form works too (vhost '/' spelled '//')."""
    qname = names.queue()
    with kombu.Connection(broker.kombu_url, connect_timeout=10) as conn:
        with conn.SimpleQueue(qname) as sq:
            sq.put("via-url")
            m = sq.get(timeout=5)
            m.ack()
            assert m.payload == "via-url"
