"""Routing through every exchange type, with pika and with kombu."""

import decimal

import pika
import pika.exceptions
import pytest
from kombu import Consumer, Exchange, Producer, Queue

from spillway_testlib import drain


def bodies(ch, queue):
    return [b for _, _, b in drain(ch, queue)]


def test_default_exchange_routes_by_queue_name(ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"hello")
    ch.basic_publish("", q + ".nope", b"lost")
    assert bodies(ch, q) == [b"hello"]


def test_predeclared_exchanges(conn, ch, names):
    for x in ("amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"):
        ch.exchange_declare(x, passive=True)
    q = names.queue()
    ch.queue_declare(q)
    ch.queue_bind(q, "amq.topic", f"{q}.#")
    ch.basic_publish("amq.topic", f"{q}.x", b"via amq.topic")
    assert bodies(ch, q) == [b"via amq.topic"]
    # RabbitMQ refuses any declare (even passive) of the default exchange.
    ch2 = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch2.exchange_declare("", passive=True)
    assert e.value.reply_code == 403


def test_direct_exchange(ch, names):
    x, q1, q2 = names.exchange(), names.queue(), names.queue()
    ch.exchange_declare(x, "direct")
    ch.queue_declare(q1)
    ch.queue_declare(q2)
    ch.queue_bind(q1, x, "red")
    ch.queue_bind(q2, x, "green")
    ch.queue_bind(q2, x, "red")  # one queue, two keys
    for key in ("red", "green", "blue", "Red", "red.x", ""):
        ch.basic_publish(x, key, key.encode() or b"empty")
    assert bodies(ch, q1) == [b"red"]
    assert bodies(ch, q2) == [b"red", b"green"]


def test_direct_exchange_same_queue_bound_twice_gets_one_copy(ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "direct")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "k")
    ch.queue_bind(q, x, "k")  # idempotent
    ch.basic_publish(x, "k", b"once")
    assert bodies(ch, q) == [b"once"]


def test_fanout_exchange_ignores_routing_key(ch, names):
    x = names.exchange()
    qs = [names.queue() for _ in range(3)]
    ch.exchange_declare(x, "fanout")
    for i, q in enumerate(qs):
        ch.queue_declare(q)
        ch.queue_bind(q, x, f"key-{i}")
    ch.basic_publish(x, "whatever", b"one")
    ch.basic_publish(x, "", b"two")
    for q in qs:
        assert bodies(ch, q) == [b"one", b"two"]


TOPIC_CASES = [
    # pattern, routing keys that match, routing keys that do not
    ("#", ["", "a", "a.b", "a.b.c", "..", "x.y.z.w.v"], []),
    ("*", ["a", "b"], ["a.b", "a.b.c"]),
    ("a.*", ["a.b", "a.c"], ["a", "a.b.c", "b.a", "ab"]),
    ("*.b", ["a.b", "x.b"], ["b", "a.b.c", "a.x.b"]),
    ("*.*", ["a.b"], ["a", "a.b.c"]),
    ("a.#", ["a", "a.b", "a.b.c"], ["b", "ab", "b.a"]),
    ("#.a", ["a", "x.a", "x.y.a"], ["a.x", "ba"]),
    ("a.#.b", ["a.b", "a.x.b", "a.x.y.b"], ["a", "b", "a.b.c", "x.a.b", "a.bb"]),
    ("a.*.#", ["a.b", "a.b.c", "a.b.c.d"], ["a", "b.a.c"]),
    ("#.b.#", ["b", "a.b", "b.c", "a.b.c"], ["a", "a.bc", "ab.c"]),
    ("a.*.c", ["a.b.c", "a..c"], ["a.c", "a.b.b.c"]),
    ("stock.usd.nyse", ["stock.usd.nyse"], ["stock.usd", "stock.usd.nyse.x", "stock.eur.nyse"]),
]


@pytest.mark.parametrize("pattern,match,nomatch", TOPIC_CASES,
                         ids=[c[0] for c in TOPIC_CASES])
def test_topic_patterns(ch, names, pattern, match, nomatch):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "topic")
    ch.queue_declare(q)
    ch.queue_bind(q, x, pattern)
    for key in match + nomatch:
        ch.basic_publish(x, key, key.encode())
    assert bodies(ch, q) == [k.encode() for k in match]


def test_topic_multiple_bindings_deliver_once(ch, names):
    x, q1, q2 = names.exchange(), names.queue(), names.queue()
    ch.exchange_declare(x, "topic")
    ch.queue_declare(q1)
    ch.queue_declare(q2)
    for pat in ("a.*", "#", "a.b", "*.b"):
        ch.queue_bind(q1, x, pat)
    ch.queue_bind(q2, x, "*.c")
    ch.basic_publish(x, "a.b", b"ab")
    ch.basic_publish(x, "z.c", b"zc")
    assert bodies(ch, q1) == [b"ab", b"zc"]
    assert bodies(ch, q2) == [b"zc"]


# pika 1.3 cannot encode floats: they are covered with kombu below.
HEADERS_VALUES = {
    "str": "pdf",
    "int": 42,
    "neg": -7,
    "long": 2 ** 40,
    "bool": True,
    "bytes": b"\x00\x01raw",
    "dec": decimal.Decimal("3.14"),
}


def _headers_setup(ch, names, match, binding):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "headers")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "", arguments=dict(binding, **{"x-match": match}))
    return x, q


def _publish_h(ch, x, body, headers):
    ch.basic_publish(x, "ignored", body, pika.BasicProperties(headers=headers))


def test_headers_exchange_match_all(ch, names):
    x, q = _headers_setup(ch, names, "all", {"format": "pdf", "type": "report"})
    _publish_h(ch, x, b"both", {"format": "pdf", "type": "report"})
    _publish_h(ch, x, b"both+extra", {"format": "pdf", "type": "report", "other": 1})
    _publish_h(ch, x, b"one", {"format": "pdf"})
    _publish_h(ch, x, b"wrong", {"format": "pdf", "type": "log"})
    _publish_h(ch, x, b"none", None)
    assert bodies(ch, q) == [b"both", b"both+extra"]


def test_headers_exchange_match_any(ch, names):
    x, q = _headers_setup(ch, names, "any", {"format": "pdf", "type": "report"})
    _publish_h(ch, x, b"both", {"format": "pdf", "type": "report"})
    _publish_h(ch, x, b"format", {"format": "pdf"})
    _publish_h(ch, x, b"type", {"type": "report", "format": "zip"})
    _publish_h(ch, x, b"neither", {"format": "zip", "type": "log"})
    _publish_h(ch, x, b"other", {"other": "pdf"})
    _publish_h(ch, x, b"none", None)
    assert bodies(ch, q) == [b"both", b"format", b"type"]


def test_headers_exchange_default_is_all(ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "headers")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "", arguments={"a": "1", "b": "2"})
    _publish_h(ch, x, b"one", {"a": "1"})
    _publish_h(ch, x, b"both", {"a": "1", "b": "2"})
    assert bodies(ch, q) == [b"both"]


def test_headers_exchange_value_types(ch, names):
    x, q = _headers_setup(ch, names, "all", HEADERS_VALUES)
    _publish_h(ch, x, b"all-types", dict(HEADERS_VALUES))
    for key, value in HEADERS_VALUES.items():
        wrong = dict(HEADERS_VALUES)
        if isinstance(value, bool):
            wrong[key] = not value
        elif isinstance(value, bytes):
            wrong[key] = value + b"!"
        elif isinstance(value, str):
            wrong[key] = value + "!"
        else:
            wrong[key] = value + 1
        _publish_h(ch, x, f"wrong-{key}".encode(), wrong)
        missing = {k: v for k, v in HEADERS_VALUES.items() if k != key}
        _publish_h(ch, x, f"missing-{key}".encode(), missing)
    # An int header matches an int binding value of another width (I vs l).
    assert bodies(ch, q) == [b"all-types"]


def test_headers_exchange_string_vs_int_do_not_match(ch, names):
    x, q = _headers_setup(ch, names, "all", {"n": 1})
    _publish_h(ch, x, b"str", {"n": "1"})
    _publish_h(ch, x, b"int", {"n": 1})
    _publish_h(ch, x, b"long", {"n": 1})
    assert bodies(ch, q) == [b"int", b"long"]


def test_headers_exchange_void_binding_value_means_presence(ch, names):
    x, q = _headers_setup(ch, names, "all", {"flag": None})
    _publish_h(ch, x, b"str", {"flag": "x"})
    _publish_h(ch, x, b"int", {"flag": 0})
    _publish_h(ch, x, b"absent", {"other": 1})
    assert bodies(ch, q) == [b"str", b"int"]


def test_exchange_delete_stops_routing(conn, ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "fanout")
    ch.queue_declare(q)
    ch.queue_bind(q, x)
    ch.basic_publish(x, "", b"before")
    ch.exchange_delete(x)
    assert bodies(ch, q) == [b"before"]
    # The queue's binding went with the exchange: a new exchange of that name routes nowhere.
    ch.exchange_declare(x, "fanout")
    ch.basic_publish(x, "", b"after")
    assert bodies(ch, q) == []


# -- kombu ------------------------------------------------------------------------------

def _kombu_roundtrip(kconn, exchange, bind_key, pub_key, headers=None, binding_args=None,
                     expect=True):
    queue = Queue(exchange.name + ".q", exchange, routing_key=bind_key,
                  binding_arguments=binding_args, auto_delete=False)
    got = []
    with kconn.channel() as chan:
        queue(chan).declare()
        try:
            prod = Producer(chan)
            prod.publish({"k": pub_key, "n": 1}, exchange=exchange, routing_key=pub_key,
                         headers=headers or {}, serializer="json", declare=[exchange])
            with Consumer(chan, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())],
                          accept=["json"]):
                try:
                    kconn.drain_events(timeout=1 if expect else 0.5)
                except TimeoutError:
                    pass
        finally:
            queue(chan).delete()
            exchange(chan).delete()
    return got


def test_kombu_direct(kconn, names):
    x = Exchange(names.exchange(), type="direct")
    assert _kombu_roundtrip(kconn, x, "k1", "k1") == [{"k": "k1", "n": 1}]
    x2 = Exchange(names.exchange(), type="direct")
    assert _kombu_roundtrip(kconn, x2, "k1", "k2", expect=False) == []


def test_kombu_fanout(kconn, names):
    x = Exchange(names.exchange(), type="fanout")
    assert _kombu_roundtrip(kconn, x, "", "anything") == [{"k": "anything", "n": 1}]


def test_kombu_topic(kconn, names):
    x = Exchange(names.exchange(), type="topic")
    assert _kombu_roundtrip(kconn, x, "log.#", "log.error.db") == [{"k": "log.error.db", "n": 1}]
    x2 = Exchange(names.exchange(), type="topic")
    assert _kombu_roundtrip(kconn, x2, "log.*", "log.error.db", expect=False) == []


def test_kombu_headers(kconn, names):
    x = Exchange(names.exchange(), type="headers")
    args = {"x-match": "any", "a": 1, "b": "two"}
    assert _kombu_roundtrip(kconn, x, "", "", headers={"b": "two"}, binding_args=args) == \
        [{"k": "", "n": 1}]
    x2 = Exchange(names.exchange(), type="headers")
    assert _kombu_roundtrip(kconn, x2, "", "", headers={"b": "three"}, binding_args=args,
                            expect=False) == []


def test_kombu_headers_float_and_long(kconn, names):
    # py-amqp encodes floats as 'd' and big ints as 'L'.
    args = {"x-match": "all", "f": 2.25, "big": 2 ** 40}
    x = Exchange(names.exchange(), type="headers")
    assert _kombu_roundtrip(kconn, x, "", "", headers={"f": 2.25, "big": 2 ** 40},
                            binding_args=args) == [{"k": "", "n": 1}]
    x2 = Exchange(names.exchange(), type="headers")
    assert _kombu_roundtrip(kconn, x2, "", "", headers={"f": 2.5, "big": 2 ** 40},
                            binding_args=args, expect=False) == []


def test_kombu_default_exchange(kconn, names):
    qname = names.queue()
    with kconn.channel() as chan:
        q = Queue(qname, Exchange(""), routing_key=qname)
        q(chan).declare()
        Producer(chan).publish("plain", exchange="", routing_key=qname, serializer="json")
        got = []
        with Consumer(chan, [q], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            kconn.drain_events(timeout=2)
        assert got == ["plain"]
