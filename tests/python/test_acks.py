"""Acknowledgements, requeueing, recover, prefetch and basic.get."""

import time

import pika
import pytest
from kombu import Consumer, Producer, Queue

from spillway_testlib import collect, drain, wait_until


def fill(ch, q, n, prefix="m"):
    ch.queue_declare(q)
    for i in range(n):
        ch.basic_publish("", q, f"{prefix}{i}".encode())


def message_count(conn, q):
    c = conn.channel()
    n = c.queue_declare(q, passive=True).method.message_count
    c.close()
    return n


def wait_count(conn, q, want, timeout=3.0):
    """The queue's message count once it is ``want``, or the last count after ``timeout``."""
    counts = []

    def reached():
        counts.append(message_count(conn, q))
        return counts[-1] == want

    wait_until(reached, timeout)
    return counts[-1]


def get(ch, q):
    """basic.get the next message of ``q``, waiting up to 2 s for one."""
    got = []

    def one():
        m, p, b = ch.basic_get(q)
        if m is not None:
            got.append((m, p, b))
        return got

    assert wait_until(one, timeout=2.0, interval=0.02), f"no message in {q}"
    return got[0]


# -- basic.get ---------------------------------------------------------------------------

def test_basic_get_empty_and_message_count(ch, names):
    q = names.queue()
    ch.queue_declare(q)
    assert ch.basic_get(q) == (None, None, None)
    ch.confirm_delivery()
    for i in range(3):
        ch.basic_publish("", q, str(i).encode())
    counts, bodies = [], []
    for _ in range(3):
        m, _, b = ch.basic_get(q, auto_ack=True)
        counts.append(m.message_count)
        bodies.append(b)
        assert m.redelivered is False
        assert m.exchange == "" and m.routing_key == q
    assert counts == [2, 1, 0]
    assert bodies == [b"0", b"1", b"2"]
    assert ch.basic_get(q) == (None, None, None)


def test_basic_get_delivery_tags_increase_per_channel(ch, names):
    q = names.queue()
    fill(ch, q, 3)
    tags = [get(ch, q)[0].delivery_tag for _ in range(3)]
    assert tags == [1, 2, 3]
    ch.basic_ack(3, multiple=True)


# -- reject / nack with requeue -----------------------------------------------------------

def test_reject_requeue_true_redelivers_in_original_order(conn, ch, names):
    q = names.queue()
    fill(ch, q, 3)
    m0, _, b0 = get(ch, q)
    m1, _, b1 = get(ch, q)
    assert (b0, b1) == (b"m0", b"m1")
    # Requeue in reverse order: the queue still hands them out in publish order.
    ch.basic_reject(m1.delivery_tag, requeue=True)
    ch.basic_reject(m0.delivery_tag, requeue=True)
    got = [get(ch, q) for _ in range(3)]
    assert [b for _, _, b in got] == [b"m0", b"m1", b"m2"]
    assert [m.redelivered for m, _, _ in got] == [True, True, False]
    ch.basic_ack(0, multiple=True)
    assert wait_count(conn, q, 0) == 0


def test_nack_requeue_true_with_consumer(conn, ch, names):
    q = names.queue()
    fill(ch, q, 3)
    seen = []

    def on_msg(chan, method, props, body):
        seen.append((body, method.redelivered))
        if body == b"m1" and not method.redelivered:
            chan.basic_nack(method.delivery_tag, requeue=True)
        else:
            chan.basic_ack(method.delivery_tag)

    ch.basic_qos(prefetch_count=1)  # so the requeued m1 comes back before m2
    ch.basic_consume(q, on_msg)
    deadline = time.monotonic() + 5
    while len(seen) < 4 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert seen == [(b"m0", False), (b"m1", False), (b"m1", True), (b"m2", False)]


def test_reject_and_nack_requeue_false_drop(conn, ch, names):
    q = names.queue()
    fill(ch, q, 3)
    m0, _, _ = get(ch, q)
    m1, _, _ = get(ch, q)
    ch.basic_reject(m0.delivery_tag, requeue=False)
    ch.basic_nack(m1.delivery_tag, requeue=False)
    m2, _, b2 = get(ch, q)
    assert b2 == b"m2" and m2.redelivered is False
    ch.basic_ack(m2.delivery_tag)
    assert ch.basic_get(q) == (None, None, None)
    # Nothing comes back when the channel closes either.
    ch.close()
    assert wait_count(conn, q, 0) == 0


def test_nack_multiple_requeue(conn, ch, names):
    q = names.queue()
    fill(ch, q, 5)
    tags = [get(ch, q)[0].delivery_tag for _ in range(4)]
    ch.basic_ack(tags[0])
    ch.basic_nack(tags[2], multiple=True, requeue=True)  # m1 and m2 back
    # m3 is still unacked; m4 ready.
    got = [get(ch, q) for _ in range(3)]
    assert [b for _, _, b in got] == [b"m1", b"m2", b"m4"]
    assert [m.redelivered for m, _, _ in got] == [True, True, False]
    ch.basic_nack(0, multiple=True, requeue=False)  # everything outstanding, dropped
    ch.close()
    assert wait_count(conn, q, 0) == 0


def test_ack_multiple(conn, ch, names):
    q = names.queue()
    fill(ch, q, 5)
    tags = [get(ch, q)[0].delivery_tag for _ in range(5)]
    ch.basic_ack(tags[2], multiple=True)  # m0..m2
    ch.close()  # m3, m4 requeued
    ch2 = conn.channel()
    assert wait_count(conn, q, 2) == 2
    got = drain(ch2, q)
    assert [b for _, _, b in got] == [b"m3", b"m4"]
    assert all(m.redelivered for m, _, _ in got)


def test_unacked_messages_requeued_when_connection_closes(broker, conn, names):
    q = names.queue()
    c2 = broker.connect()
    ch2 = c2.channel()
    fill(ch2, q, 3)
    get(ch2, q)
    get(ch2, q)
    c2.close()
    ch = conn.channel()
    assert wait_count(conn, q, 3) == 3
    got = drain(ch, q)
    assert [b for _, _, b in got] == [b"m0", b"m1", b"m2"]
    assert [m.redelivered for m, _, _ in got] == [True, True, False]


def test_basic_recover_requeue(conn, ch, names):
    q = names.queue()
    fill(ch, q, 3)
    first = []
    tag = ch.basic_consume(q, lambda c, m, p, b: first.append((b, m.redelivered)))
    deadline = time.monotonic() + 5
    while len(first) < 3 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert first == [(b"m0", False), (b"m1", False), (b"m2", False)]
    ch.basic_cancel(tag)
    ch.basic_recover(requeue=True)
    got = drain(ch, q, n=3)
    assert [(b, m.redelivered) for m, _, b in got] == [(b"m0", True), (b"m1", True), (b"m2", True)]


def test_auto_ack_messages_are_not_requeued(broker, conn, names):
    q = names.queue()
    c2 = broker.connect()
    ch2 = c2.channel()
    fill(ch2, q, 2)
    got = collect(c2, ch2, q, 2, auto_ack=True)
    assert len(got) == 2
    c2.close()
    assert wait_count(conn, q, 0) == 0


# -- prefetch ------------------------------------------------------------------------------

def test_prefetch_count_limits_unacked(conn, ch, names):
    q = names.queue()
    fill(ch, q, 5)
    ch.basic_qos(prefetch_count=2)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(m))
    conn.process_data_events(time_limit=0.5)
    assert len(got) == 2
    ch.basic_ack(got[0].delivery_tag)
    conn.process_data_events(time_limit=0.5)
    assert len(got) == 3
    ch.basic_ack(got[2].delivery_tag, multiple=True)
    conn.process_data_events(time_limit=0.5)
    assert len(got) == 5
    assert message_count(conn, q) == 0


def test_prefetch_round_robin_two_consumers(broker, conn, names):
    q = names.queue()
    ch = conn.channel()
    fill(ch, q, 4)
    c2 = broker.connect()
    a, b = conn.channel(), c2.channel()
    a.basic_qos(prefetch_count=1)
    b.basic_qos(prefetch_count=1)
    got_a, got_b = [], []
    a.basic_consume(q, lambda c, m, p, body: got_a.append((m.delivery_tag, body)))
    conn.process_data_events(time_limit=0.3)
    b.basic_consume(q, lambda c, m, p, body: got_b.append((m.delivery_tag, body)))
    for _ in range(3):
        conn.process_data_events(time_limit=0.1)
        c2.process_data_events(time_limit=0.1)
    assert [x for _, x in got_a] == [b"m0"]
    assert [x for _, x in got_b] == [b"m1"]
    a.basic_ack(got_a[0][0])
    for _ in range(3):
        conn.process_data_events(time_limit=0.1)
        c2.process_data_events(time_limit=0.1)
    assert [x for _, x in got_a] == [b"m0", b"m2"]
    assert [x for _, x in got_b] == [b"m1"]
    b.basic_ack(got_b[0][0])
    for _ in range(3):
        conn.process_data_events(time_limit=0.1)
        c2.process_data_events(time_limit=0.1)
    assert [x for _, x in got_b] == [b"m1", b"m3"]
    c2.close()


def test_round_robin_between_consumers(broker, conn, names):
    q = names.queue()
    ch = conn.channel()
    ch.queue_declare(q)
    got_a, got_b = [], []
    ch.basic_consume(q, lambda c, m, p, b: got_a.append(b), auto_ack=True)
    ch.basic_consume(q, lambda c, m, p, b: got_b.append(b), auto_ack=True)
    pub = broker.connect()
    pch = pub.channel()
    pch.confirm_delivery()
    for i in range(10):
        pch.basic_publish("", q, f"m{i}".encode())
    pub.close()
    deadline = time.monotonic() + 5
    while len(got_a) + len(got_b) < 10 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got_a) == 5 and len(got_b) == 5
    assert sorted(got_a + got_b) == sorted(f"m{i}".encode() for i in range(10))


def test_qos_prefetch_zero_means_unlimited(conn, ch, names):
    q = names.queue()
    fill(ch, q, 50)
    ch.basic_qos(prefetch_count=0)
    got = []
    ch.basic_consume(q, lambda c, m, p, b: got.append(m))
    deadline = time.monotonic() + 5
    while len(got) < 50 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert len(got) == 50
    ch.basic_ack(0, multiple=True)


# -- kombu -------------------------------------------------------------------------------

def test_kombu_reject_requeue_and_ack(kconn, names):
    qname = names.queue()
    with kconn.channel() as chan:
        q = Queue(qname, routing_key=qname)
        q(chan).declare()
        prod = Producer(chan)
        for i in range(3):
            prod.publish({"i": i}, routing_key=qname, serializer="json")
        seen = []

        def on_message(body, message):
            seen.append((body["i"], message.delivery_info["redelivered"]))
            if body["i"] == 0 and not message.delivery_info["redelivered"]:
                message.requeue()
            elif body["i"] == 2:
                message.reject()  # requeue=False: dropped
            else:
                message.ack()

        with Consumer(chan, [q], callbacks=[on_message], accept=["json"], prefetch_count=1):
            deadline = time.monotonic() + 5
            while len(seen) < 4 and time.monotonic() < deadline:
                try:
                    kconn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
        assert seen == [(0, False), (0, True), (1, False), (2, False)]
        _, count, consumers = q(chan).queue_declare(passive=True)
        assert (count, consumers) == (0, 0)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_kombu_prefetch(kconn, names, prefetch):
    qname = names.queue()
    with kconn.channel() as chan:
        q = Queue(qname, routing_key=qname)
        q(chan).declare()
        prod = Producer(chan)
        for i in range(6):
            prod.publish(i, routing_key=qname, serializer="json")
        held = []
        with Consumer(chan, [q], callbacks=[lambda b, m: held.append(m)], accept=["json"],
                      prefetch_count=prefetch):
            for _ in range(5):
                try:
                    kconn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
            assert [m.payload for m in held] == list(range(prefetch))
            for m in held:
                m.ack()
            while len(held) < 6:
                kconn.drain_events(timeout=2)
                for m in held:
                    if not m.acknowledged:
                        m.ack()
        assert [m.payload for m in held] == list(range(6))
