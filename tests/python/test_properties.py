"""Message properties, headers and bodies arrive exactly as published."""

import datetime
import decimal
import hashlib
import os
import time

import pika
import pika.exceptions
import pytest
from kombu import Consumer, Producer, Queue

from raw_amqp import RawAMQP, all_field_types_table, raw_basic_properties
from spillway_testlib import assert_same, collect, drain, wait_until

HEADERS = {
    "str": "hello",
    "unicode": "h\u00e9llo \u4e16\u754c \U0001f600",
    "empty": "",
    "int": 7,
    "zero": 0,
    "negative": -2147483648,
    "long": 2 ** 40,
    "neglong": -(2 ** 62),
    "true": True,
    "false": False,
    "bytes": b"\x00\xff\x10binary",
    "decimal": decimal.Decimal("123.45"),
    "timestamp": datetime.datetime(2024, 2, 29, 12, 34, 56),
    "void": None,
    "array": [1, "two", True, b"four", [5, [6]], {"seven": 7}, None],
    "empty_array": [],
    "table": {"nested": {"deeper": {"deepest": "yes", "n": -1}}, "list": ["a", "b"]},
    "empty_table": {},
    "x-custom": "dash-key",
}

PROPS = dict(
    content_type="application/x-spillway-test",
    content_encoding="gzip",
    delivery_mode=2,
    priority=5,
    correlation_id="corr-\u00e9-123",
    reply_to="amq.gen-reply-queue",
    expiration="60000",
    message_id="msg-0001",
    timestamp=1700000000,
    type="order.created",
    user_id="guest",
    app_id="spillway-pytest",
)


def _check_props(props):
    for name, value in PROPS.items():
        assert_same(getattr(props, name), value, name)
    assert_same(props.headers, HEADERS, "headers")


def test_pika_properties_roundtrip_basic_get(ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"body", pika.BasicProperties(headers=HEADERS, **PROPS))
    [(method, props, body)] = drain(ch, q, n=1)
    assert body == b"body"
    _check_props(props)


def test_pika_properties_roundtrip_consumer_via_topic(conn, ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "topic")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "props.#")
    ch.basic_publish(x, "props.a.b", b"body", pika.BasicProperties(headers=HEADERS, **PROPS))
    [(method, props, body)] = collect(conn, ch, q, 1)
    assert method.exchange == x and method.routing_key == "props.a.b"
    assert method.redelivered is False
    _check_props(props)


def test_absent_properties_stay_absent(ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"bare")
    [(_, props, body)] = drain(ch, q, n=1)
    assert body == b"bare"
    for name in ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                 "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                 "type", "user_id", "app_id", "cluster_id"):
        assert getattr(props, name) is None, name


def test_user_id_must_match_authenticated_user(conn, names):
    ch = conn.channel()
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.basic_publish("", q, b"x", pika.BasicProperties(user_id="mallory"))
    assert e.value.reply_code == 406


@pytest.mark.parametrize("route", ["default", "headers", "persistent"])
def test_raw_properties_byte_for_byte(broker, conn, names, route):
    """The content header a consumer gets is byte-for-byte the one the publisher sent,
    including field-table types pika cannot produce (b, B, s, u, i, f, d, x, ...)."""
    q = names.queue()
    ch = conn.channel()
    ch.queue_declare(q, durable=(route == "persistent"))
    headers = all_field_types_table()
    exchange, key = "", q
    if route == "headers":
        exchange = names.exchange()
        ch.exchange_declare(exchange, "headers")
        # Matching forces the broker to parse the table; b/s/I are all ints to RabbitMQ.
        ch.queue_bind(q, exchange, "", arguments={"x-match": "all", "I": -123456,
                                                   "S": "unicode \u00e9\u4e2d"})
        key = "ignored"
    raw = raw_basic_properties(
        headers=headers, content_type="application/octet-stream", content_encoding="identity",
        delivery_mode=2 if route == "persistent" else 1, priority=9,
        correlation_id="c" * 255, reply_to="r", expiration="120000", message_id="",
        timestamp=2 ** 40, type="t", user_id="guest", app_id="raw", cluster_id="cl")
    client = RawAMQP(broker.host, broker.port)
    try:
        client.publish(exchange, key, raw, b"payload")
        got = None
        deadline = time.monotonic() + 5
        while got is None and time.monotonic() < deadline:
            got = client.get(q)
        assert got is not None, "message not delivered"
        method, raw_back, body, frames = got
        assert body == b"payload" and frames == 1
        assert method.routing_key == key and method.exchange == exchange
        assert raw_back == raw
    finally:
        client.close()


def test_raw_minimal_properties_byte_for_byte(broker, conn, names):
    q = names.queue()
    conn.channel().queue_declare(q)
    client = RawAMQP(broker.host, broker.port)
    try:
        for raw in (raw_basic_properties(), raw_basic_properties(headers=b"\x00\x00\x00\x00"),
                    raw_basic_properties(content_type="")):
            client.publish("", q, raw, b"x")
            got = client.get(q)
            assert got is not None
            assert got[1] == raw
    finally:
        client.close()


# -- bodies ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 131072 - 8, 131072 - 7, 1 << 20, 5 << 20],
                         ids=["empty", "1B", "frame_max-8", "frame_max-7", "1MiB", "5MiB"])
def test_body_sizes_pika(conn, ch, names, size):
    q = names.queue()
    ch.queue_declare(q)
    body = os.urandom(size)
    ch.confirm_delivery()
    ch.basic_publish("", q, body, pika.BasicProperties(message_id="get"))
    ch.basic_publish("", q, body, pika.BasicProperties(message_id="consume"))
    [(m, props, got)] = drain(ch, q, n=1)
    assert props.message_id == "get"
    assert len(got) == size and hashlib.sha256(got).digest() == hashlib.sha256(body).digest()
    [(m, props, got)] = collect(conn, ch, q, 1, timeout=20)
    assert props.message_id == "consume"
    assert len(got) == size and got == body


def test_body_split_into_small_frames_raw(broker, conn, names):
    """A publisher may split a body into frames smaller than frame_max; deliveries are
    re-framed by the broker within its frame_max."""
    q = names.queue()
    conn.channel().queue_declare(q)
    body = os.urandom(300_001)
    client = RawAMQP(broker.host, broker.port)
    try:
        client.publish("", q, raw_basic_properties(), body, body_frame_size=997)
        got = client.get(q)
        assert got is not None
        _, _, back, frames = got
        assert back == body
        assert frames >= -(-len(body) // (client.frame_max - 8))
    finally:
        client.close()


def test_many_mixed_sizes_keep_order(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    sizes = [0, 10, 200_000, 3, 1 << 20, 0, 131_064, 131_065, 7]
    sent = [os.urandom(s) for s in sizes]
    for i, b in enumerate(sent):
        ch.basic_publish("", q, b, pika.BasicProperties(message_id=str(i)))
    got = collect(conn, ch, q, len(sent), timeout=20)
    assert [p.message_id for _, p, _ in got] == [str(i) for i in range(len(sent))]
    assert [b for _, _, b in got] == sent


def test_kombu_large_and_empty(kconn, names):
    qname = names.queue()
    big = os.urandom(5 << 20)
    with kconn.channel() as chan:
        q = Queue(qname, routing_key=qname)
        q(chan).declare()
        prod = Producer(chan)
        prod.publish(big, routing_key=qname, serializer=None, content_type="application/data",
                     content_encoding="binary")
        prod.publish(b"", routing_key=qname, serializer=None, content_type="application/data",
                     content_encoding="binary")
        got = []
        with Consumer(chan, [q], callbacks=[lambda b, m: (got.append(m.body), m.ack())],
                      accept=["application/data"]):
            deadline = time.monotonic() + 20
            while len(got) < 2 and time.monotonic() < deadline:
                kconn.drain_events(timeout=5)
    assert len(got) == 2
    assert got[0] == big
    assert got[1] in (b"", "")  # py-amqp hands an empty body over as ''


def test_kombu_properties_roundtrip(kconn, names):
    qname = names.queue()
    headers = {"float": 3.5, "neg_float": -0.125, "int": 12, "big": 2 ** 40, "bool": False,
               "nested": {"list": [1, 2.5, "x", {"k": "v"}]}, "text": "\u00e9t\u00e9"}
    with kconn.channel() as chan:
        q = Queue(qname, routing_key=qname)
        q(chan).declare()
        Producer(chan).publish(
            {"payload": [1, 2, 3]}, routing_key=qname, serializer="json", headers=headers,
            correlation_id="kombu-corr", reply_to="kombu-reply", priority=3, expiration=30,
            delivery_mode=2, message_id="kombu-1", type="kombu.type", app_id="kombu-app",
            user_id="guest", timestamp=1700000001)
        msgs = []
        with Consumer(chan, [q], callbacks=[lambda b, m: (msgs.append((b, m)), m.ack())],
                      accept=["json"]):
            kconn.drain_events(timeout=2)
    [(body, m)] = msgs
    assert body == {"payload": [1, 2, 3]}
    assert m.headers == headers
    assert type(m.headers["float"]) is float and type(m.headers["big"]) is int
    assert m.content_type == "application/json"
    p = m.properties
    assert p["correlation_id"] == "kombu-corr"
    assert p["reply_to"] == "kombu-reply"
    assert p["priority"] == 3
    assert p["expiration"] == "30000"
    assert p["delivery_mode"] == 2
    assert p["message_id"] == "kombu-1"
    assert p["type"] == "kombu.type"
    assert p["app_id"] == "kombu-app"
    assert p["user_id"] == "guest"
    ts = p["timestamp"]
    if isinstance(ts, datetime.datetime):
        ts = int(ts.replace(tzinfo=datetime.timezone.utc).timestamp())
    assert ts == 1700000001


def test_kombu_simple_queue(kconn, names):
    qname = names.queue()
    with kconn.SimpleQueue(qname, serializer="json") as sq:
        sq.put({"a": 1})
        sq.put(["b", 2.5], headers={"h": "v"})
        # put() and qsize() may use different channels
        wait_until(lambda: sq.qsize() >= 2, timeout=5)
        assert sq.qsize() == 2
        m1 = sq.get(block=True, timeout=5)
        assert m1.payload == {"a": 1}
        m1.ack()
        m2 = sq.get(block=True, timeout=5)
        assert m2.payload == ["b", 2.5]
        assert m2.headers == {"h": "v"}
        m2.ack()
        with pytest.raises(sq.Empty):
            sq.get(block=True, timeout=0.3)
