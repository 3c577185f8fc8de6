"""AMQP 1.0 on the 0-9-1 port, seen by Qpid Proton (python-qpid-proton): addresses as
RabbitMQ 4 defines them, every disposition, the mapping of sections to 0-9-1 properties
checked field by field against pika in both directions, credentials, vhosts and
permissions.

Spillway only for now: RabbitMQ 3.10's amqp1_0 plugin speaks the older addresses
(/queue/Q, /exchange/X/KEY), and RabbitMQ 4 is not packaged by Debian."""

from __future__ import annotations

import collections
import time
import urllib.parse
import uuid

import pika
import pytest
from proton import ConnectionException, Delivery, Message, ProtonException, symbol
from proton.utils import BlockingConnection, LinkDetached, SendException

from spillway_testlib import SpillwayBroker, spillctl, wait_until

pytestmark = pytest.mark.spillway_only


def body_of(message) -> bytes:
    """A binary body as bytes: proton hands out a memoryview into a buffer it reuses."""
    return bytes(message.body)


def connect(broker, user="guest", password="guest", vhost="/"):
    return BlockingConnection(f"amqp://{broker.host}:{broker.port}", user=user,
                              password=password, allowed_mechs="PLAIN",
                              virtual_host=f"vhost:{vhost}", timeout=10)


@pytest.fixture
def amqp1(broker):
    c = connect(broker)
    yield c
    try:
        c.close()
    except Exception:
        pass


def test_messages_sent_to_a_queue_come_back_in_order_and_accepted(amqp1, ch, names):
    queue = names.queue()
    ch.queue_declare(queue, durable=True)
    sender = amqp1.create_sender(f"/queues/{queue}")
    for i in range(5):
        # BlockingSender.send waits for the outcome and raises unless accepted.
        sender.send(Message(body=f"m{i}".encode(), durable=True))
    receiver = amqp1.create_receiver(f"/queues/{queue}", credit=10)
    got = []
    for _ in range(5):
        got.append(body_of(receiver.receive(timeout=5)))
        receiver.accept()
    assert got == [f"m{i}".encode() for i in range(5)]
    receiver.close()
    # Accepted means acknowledged: nothing comes back when the link closes.
    assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == 0)


def test_settled_transfers_sent_just_before_the_close_are_all_kept(broker, ch, names):
    """Pre-settled transfers (at-most-once: no outcome comes back) that the client sent
    before it closed its connection are published, not dropped with its links."""
    from proton.reactor import AtMostOnce
    queue = names.queue()
    ch.queue_declare(queue)
    count = 2000
    for round_ in range(3):
        c = connect(broker)
        sender = c.create_sender(f"/queues/{queue}", options=AtMostOnce())
        for i in range(count):
            sender.send(Message(body=f"{round_}-{i}".encode()))
        # Proton holds what has no credit yet; once all is written to the socket,
        # close at once: the broker has not read most of it yet.
        c.wait(lambda: sender.link.queued == 0, timeout=30)
        c.close()
    assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count
                      == 3 * count, 10), ch.queue_declare(queue, passive=True).method.message_count


def test_amqp1_to_pika_maps_every_field(amqp1, ch, names):
    queue = names.queue()
    ch.queue_declare(queue)
    ch.queue_bind(queue, "amq.direct", routing_key="orders.eu")
    sender = amqp1.create_sender("/exchanges/amq.direct/orders.eu")
    message = Message(
        body=b'{"id": 7}', durable=True, priority=6, ttl=60.0, id="msg-1",
        correlation_id="corr-9", subject="order", reply_to="/queues/replies",
        content_type="application/json", content_encoding="utf-8", user_id=b"guest",
        creation_time=1_700_000_000.0,
        # No float: pika 1.3 decodes a header double as an integer (0.5 reads 0).
        properties={"region": "eu", "attempt": 3, "urgent": True})
    sender.send(message)
    method, props, body = None, None, None
    deadline = time.time() + 5
    while method is None and time.time() < deadline:
        method, props, body = ch.basic_get(queue, auto_ack=True)
    assert method is not None
    assert body == b'{"id": 7}'
    assert method.exchange == "amq.direct" and method.routing_key == "orders.eu"
    assert props.delivery_mode == 2
    assert props.priority == 6
    assert props.expiration == "60000"
    assert props.message_id == "msg-1"
    assert props.correlation_id == "corr-9"
    assert props.type == "order"
    assert props.reply_to == "/queues/replies"
    assert props.content_type == "application/json"
    assert props.content_encoding == "utf-8"
    assert props.user_id == "guest"
    assert props.timestamp == 1_700_000_000
    # The body was an amqp-value holding bytes (Proton's encoding of `bytes`): the
    # header that says so travels with it, so a 1.0 consumer gets the same section.
    assert props.headers == {"region": "eu", "attempt": 3, "urgent": True,
                             "x-amqp-1.0-body": "amqp-value-binary"}


def test_pika_to_amqp1_maps_every_field(amqp1, ch, names):
    queue = names.queue()
    ch.queue_declare(queue)
    ch.basic_publish("", queue, b"hello", pika.BasicProperties(
        delivery_mode=2, priority=3, expiration="30000", message_id="m-2",
        correlation_id="c-2", type="greeting", reply_to="answers",
        content_type="text/plain", content_encoding="identity", timestamp=1_600_000_000,
        headers={"tenant": "acme", "count": 12, "flag": False}))
    receiver = amqp1.create_receiver(f"/queues/{queue}")
    message = receiver.receive(timeout=5)
    receiver.accept()
    assert body_of(message) == b"hello"
    assert message.durable is True
    assert message.priority == 3
    assert message.ttl == 30.0
    assert message.id == "m-2"
    assert message.correlation_id == "c-2"
    assert message.subject == "greeting"
    assert message.reply_to == "answers"
    assert message.content_type == symbol("text/plain")
    assert message.content_encoding == symbol("identity")
    assert message.creation_time == 1_600_000_000.0
    assert message.properties == {"tenant": "acme", "count": 12, "flag": False}
    assert message.first_acquirer is True


def test_an_amqp_value_body_comes_back_as_sent_over_amqp1(amqp1, ch, names):
    queue = names.queue()
    ch.queue_declare(queue)
    sender = amqp1.create_sender(f"/queues/{queue}")
    sent = [{"nested": [1, 2, 3], "text": "é"}, "just a string", 12345]
    for body in sent:
        sender.send(Message(body=body))
    receiver = amqp1.create_receiver(f"/queues/{queue}", credit=10)
    got = []
    for _ in sent:
        got.append(receiver.receive(timeout=5).body)
        receiver.accept()
    assert got == sent


def settle_modified(receiver, undeliverable: bool) -> None:
    """Settles the oldest unsettled delivery as `modified` with delivery-failed, and
    undeliverable-here as asked (BlockingReceiver has no helper for the latter)."""
    delivery = receiver.fetcher.unsettled.popleft()
    delivery.local.failed = True
    delivery.local.undeliverable = undeliverable
    delivery.update(Delivery.MODIFIED)
    delivery.settle()


def test_dispositions_map_to_ack_requeue_and_dead_letter(amqp1, ch, names):
    queue, dead = names.queue(), names.queue("dead")
    ch.queue_declare(dead)
    ch.queue_declare(queue, arguments={"x-dead-letter-exchange": "",
                                       "x-dead-letter-routing-key": dead})
    sender = amqp1.create_sender(f"/queues/{queue}")
    for body in (b"release-me", b"modify-me", b"reject-me", b"undeliverable", b"accept-me"):
        sender.send(Message(body=body))
    receiver = amqp1.create_receiver(f"/queues/{queue}", credit=1)

    # What each outcome does, whatever the order: proton tops its credit up
    # as each message arrives, so the broker may hand over the next message
    # while the client still holds one, and a message sent back to the
    # queue's head comes after that one (as on RabbitMQ).
    copies = collections.Counter()
    while sum(copies.values()) < 7:
        message = receiver.receive(timeout=5)
        body = body_of(message)
        copies[body] += 1
        again = copies[body] > 1
        assert message.first_acquirer is not again, (body, copies)
        if body == b"release-me" and not again:
            receiver.release(delivered=False)  # released: back to the queue
        elif body == b"modify-me" and not again:
            settle_modified(receiver, undeliverable=False)  # a failed attempt: requeued
        elif body == b"reject-me":
            receiver.reject()  # dead-lettered
        elif body == b"undeliverable":
            settle_modified(receiver, undeliverable=True)  # not here: dead-lettered
        else:
            receiver.accept()
    assert copies == {b"release-me": 2, b"modify-me": 2, b"reject-me": 1,
                      b"undeliverable": 1, b"accept-me": 1}

    dead_letters = []
    deadline = time.time() + 5
    while len(dead_letters) < 2 and time.time() < deadline:
        method, props, body = ch.basic_get(dead, auto_ack=True)
        if method is not None:
            dead_letters.append(body)
            assert props.headers["x-death"][0]["reason"] == "rejected", props.headers
    assert sorted(dead_letters) == [b"reject-me", b"undeliverable"]
    assert ch.queue_declare(queue, passive=True).method.message_count == 0


def test_a_receiver_is_handed_its_credit_without_settling(amqp1, ch, names):
    """Deliveries follow the client's credit, not what it has settled: a receiver
    that keeps a window of 10 topped up (proton's prefetch) gets a whole backlog in
    order without settling any, and what it never settled goes back to the queue
    when it detaches."""
    queue = names.queue()
    ch.queue_declare(queue)
    for n in range(30):
        ch.basic_publish("", queue, b"%d" % n)
    assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == 30)
    receiver = amqp1.create_receiver(f"/queues/{queue}", credit=10)
    amqp1.wait(lambda: receiver.fetcher.has_message >= 30, timeout=10,
               msg="the backlog handed over unsettled")
    bodies = [body_of(receiver.receive(timeout=5)) for _ in range(30)]
    assert bodies == [b"%d" % n for n in range(30)]
    receiver.close()
    assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == 30)


def test_unroutable_messages_are_released(amqp1):
    sender = amqp1.create_sender("/exchanges/amq.direct/nobody-listens-here")
    with pytest.raises(SendException) as refused:
        sender.send(Message(body=b"lost?"))
    assert refused.value.state == Delivery.RELEASED


def test_the_null_target_routes_by_each_messages_to(amqp1, ch, names):
    first, second = names.queue(), names.queue()
    ch.queue_declare(first)
    ch.queue_declare(second)
    sender = amqp1.create_sender(None)
    sender.send(Message(body=b"one", address=f"/queues/{first}"))
    sender.send(Message(body=b"two", address=f"/queues/{second}"))
    assert ch.basic_get(first, auto_ack=True)[2] == b"one"
    assert ch.basic_get(second, auto_ack=True)[2] == b"two"


def test_a_missing_queue_refuses_the_link_with_not_found(amqp1):
    with pytest.raises(LinkDetached) as refused:
        receiver = amqp1.create_receiver(f"/queues/missing-{uuid.uuid4().hex}")
        receiver.receive(timeout=5)
    assert "amqp:not-found" in str(refused.value)


def test_a_bad_address_is_refused_naming_the_forms(amqp1):
    with pytest.raises((LinkDetached, SendException)) as refused:
        sender = amqp1.create_sender("/nowhere/at/all/x")
        sender.send(Message(body=b"x"))
    assert "/queues/Q" in str(refused.value)


def test_wrong_credentials_are_refused(broker):
    with pytest.raises(ConnectionException):
        connect(broker, password="wrong")


def test_an_unknown_vhost_is_refused(broker):
    with pytest.raises(ConnectionException):
        c = connect(broker, vhost=f"nowhere-{uuid.uuid4().hex[:6]}")
        c.create_sender("/queues/x")


def test_a_client_that_never_answers_the_close_is_cut_off(broker):
    """The broker refuses an unknown vhost with a `close` and waits a bounded time
    (3 s) for the client's: one that never answers is cut off, not held (and
    counted as connected) for as long as it keeps the socket open."""
    import socket
    from proton import Connection, Endpoint, Transport
    connection = Connection()
    connection.hostname = f"vhost:nowhere-{uuid.uuid4().hex[:6]}"
    connection.user, connection.password = "guest", "guest"
    transport = Transport()
    sasl = transport.sasl()
    sasl.allowed_mechs("PLAIN")
    sasl.allow_insecure_mechs = True  # as BlockingConnection allows it on a plain socket
    transport.bind(connection)
    connection.open()
    with socket.create_connection((broker.host, broker.port), timeout=10) as sock:
        # Proton's engine, pumped by hand: it answers nothing unless told to.
        while not connection.state & Endpoint.REMOTE_CLOSED:
            pending = transport.pending()
            if pending > 0:
                sock.sendall(transport.peek(pending))
                transport.pop(pending)
            received = sock.recv(65536)
            assert received, "the socket ended before the broker's close"
            transport.push(received)
        assert "not found" in str(connection.remote_condition), connection.remote_condition
        closed_at = time.monotonic()
        # The client never sends its `close`: the broker hangs up.
        while sock.recv(65536):
            pass
        assert time.monotonic() - closed_at < 8


def test_a_0_9_1_client_on_the_same_port_still_works(amqp1, ch, names):
    # Both protocols on one listener, at once.
    queue = names.queue()
    ch.queue_declare(queue)
    amqp1.create_sender(f"/queues/{queue}").send(Message(body=b"from 1.0"))
    assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == 1)
    assert ch.basic_get(queue, auto_ack=True)[2] == b"from 1.0"


def test_management_lists_an_amqp1_connection_and_closes_it(broker, amqp1, ch, names):
    import requests
    if not isinstance(broker, SpillwayBroker) or broker.wiring != "all-in-one":
        pytest.skip("needs the all-in-one broker's management HTTP port")
    base = f"http://{broker.procs['all-in-one'].address('http')}"
    queue = names.queue()
    ch.queue_declare(queue)
    # Several links of both kinds: the broker's `close` must reach the
    # client before any of them is detached, or the client hears a bare
    # detach instead of the reason.
    # (Named: Proton names a link after its address, and link names must differ.)
    senders = [amqp1.create_sender(f"/queues/{queue}", name=f"sender-{i}") for i in range(16)]
    _receivers = [amqp1.create_receiver(f"/queues/{queue}", credit=10, name=f"receiver-{i}")
                  for i in range(4)]
    sender = senders[0]
    for each in senders:
        each.send(Message(body=b"listed"))

    def amqp1_connections():
        listed = requests.get(f"{base}/api/connections", auth=("guest", "guest"), timeout=30)
        assert listed.status_code == 200, listed.text
        return [c for c in listed.json() if c["protocol"] == "AMQP 1.0" and c["channels"] >= 1]
    found = wait_until(amqp1_connections, 10)
    assert found, "no AMQP 1.0 connection listed"
    [connection] = found
    assert connection["user"] == "guest" and connection["vhost"] == "/"
    closed = requests.delete(
        f"{base}/api/connections/{urllib.parse.quote(connection['name'], safe='')}",
        auth=("guest", "guest"), headers={"X-Reason": "closed by the test"}, timeout=30)
    assert closed.status_code == 204
    # The broker closes it with connection-forced and the reason.
    with pytest.raises(ProtonException) as refused:
        deadline = time.time() + 10
        while time.time() < deadline:
            sender.send(Message(body=b"after the close"), timeout=2)
            time.sleep(0.1)
    assert not isinstance(refused.value, LinkDetached), str(refused.value)
    assert "closed by the test" in str(refused.value) and "forced" in str(refused.value)


def all_in_one(broker):
    """The all-in-one broker's process (its management and metrics ports), or a skip."""
    if not isinstance(broker, SpillwayBroker) or broker.wiring != "all-in-one":
        pytest.skip("needs the all-in-one broker's management ports")
    return broker.procs["all-in-one"]


def metric(proc, name: str) -> float:
    """One unlabelled sample of the all-in-one broker's /metrics."""
    import requests
    text = requests.get(f"http://{proc.address('metrics')}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_management_lists_sessions_and_links_and_metrics_count_them(broker, amqp1, ch, names):
    import requests
    proc = all_in_one(broker)
    base = f"http://{proc.address('http')}"
    queue = names.queue()
    ch.queue_declare(queue)
    received_before = metric(proc, "rabbitmq_global_messages_received_total")
    sender = amqp1.create_sender(f"/queues/{queue}", name="orders-out")
    receiver = amqp1.create_receiver(f"/queues/{queue}", name="orders-in", credit=5)
    sender.send(Message(body=b"counted"))
    assert body_of(receiver.receive(timeout=10)) == b"counted"
    receiver.accept()

    def our_connection():
        listed = requests.get(f"{base}/api/connections", auth=("guest", "guest"), timeout=30)
        assert listed.status_code == 200, listed.text
        return [c for c in listed.json() if c["protocol"] == "AMQP 1.0" and c["channels"] == 2]
    [connection] = wait_until(our_connection, 10)
    name = urllib.parse.quote(connection["name"], safe="")
    sessions = requests.get(f"{base}/api/connections/{name}/sessions",
                            auth=("guest", "guest"), timeout=30)
    assert sessions.status_code == 200, sessions.text
    incoming = [link for s in sessions.json() for link in s["incoming_links"]]
    outgoing = [link for s in sessions.json() for link in s["outgoing_links"]]
    assert [(link["link_name"], link["target_address"]) for link in incoming] == \
        [("orders-out", f"/queues/{queue}")]
    assert [(link["link_name"], link["source_address"], link["queue_name"])
            for link in outgoing] == [("orders-in", f"/queues/{queue}", queue)]
    channels = requests.get(f"{base}/api/connections/{name}/channels",
                            auth=("guest", "guest"), timeout=30).json()
    assert sorted((c["amqp1_link"]["direction"], c["amqp1_link"]["link_name"])
                  for c in channels) == [("incoming", "orders-out"), ("outgoing", "orders-in")]
    # A 0-9-1 connection has no sessions to list: 400, as RabbitMQ 4 answers.
    zero_nine_one = wait_until(lambda: [c for c in requests.get(
        f"{base}/api/connections", auth=("guest", "guest"), timeout=30).json()
        if c["protocol"] == "AMQP 0-9-1"], 10)
    refused = requests.get(
        f"{base}/api/connections/{urllib.parse.quote(zero_nine_one[0]['name'], safe='')}/sessions",
        auth=("guest", "guest"), timeout=30)
    assert refused.status_code == 400, refused.text

    # /metrics: the connection, its session(s) and the two links; the message counted
    # with 0-9-1's. A connection an earlier test closed counts until its socket is
    # gone (at most the broker's 3 s wait for its `close`).
    assert wait_until(lambda: metric(proc, "spillway_amqp1_connections") == 1, 10)
    assert metric(proc, "spillway_amqp1_sessions") >= 1
    assert metric(proc, "spillway_amqp1_links") == 2
    assert metric(proc, "rabbitmq_global_messages_received_total") >= received_before + 1
    receiver.close()
    assert wait_until(lambda: metric(proc, "spillway_amqp1_links") == 1, 10)
    amqp1.close()
    assert wait_until(lambda: metric(proc, "spillway_amqp1_connections") == 0
                      and metric(proc, "spillway_amqp1_sessions") == 0
                      and metric(proc, "spillway_amqp1_links") == 0, 10)


@pytest.fixture
def limited_user(broker):
    all_in_one(broker)
    name = f"app-{uuid.uuid4().hex[:8]}"
    spillctl(broker, "user", "add", name, "app-secret")
    spillctl(broker, "permissions", "set", name,
             "--configure", r"^app\.", "--write", r"^app\.", "--read", r"^app\.")
    yield name
    spillctl(broker, "user", "delete", name)


def test_a_forbidden_queue_is_refused_with_unauthorized_access(broker, limited_user, ch, names):
    """A user whose permissions cover only ^app\\. may use its own queue over 1.0, and
    is refused another's, as a 0-9-1 client gets 403."""
    own = f"app.{uuid.uuid4().hex[:8]}"
    other = names.queue()
    ch.queue_declare(own)
    ch.queue_declare(other)
    conn = connect(broker, user=limited_user, password="app-secret")
    try:
        # The attach is answered before the consume is refused: the detach
        # follows it.
        with pytest.raises(LinkDetached) as refused:
            conn.create_receiver(f"/queues/{other}").receive(timeout=10)
        assert "unauthorized-access" in str(refused.value), refused.value
        # Publishing goes through an exchange its write pattern does not cover.
        with pytest.raises((LinkDetached, SendException)):
            conn.create_sender(f"/exchanges/amq.direct/{other}").send(
                Message(body=b"not allowed"), timeout=10)
        assert ch.queue_declare(other, passive=True).method.message_count == 0
        # Its own queue is open to it.
        ch.basic_publish("", own, b"mine")
        mine = conn.create_receiver(f"/queues/{own}")
        assert body_of(mine.receive(timeout=10)) == b"mine"
        mine.accept()
    finally:
        try:
            conn.close()
        except Exception:
            pass
    ch.queue_delete(own)
