"""queue.declare variants, purge, delete, bind/unbind."""

import time

import pika
import pika.exceptions as pe
import pytest
from kombu import Consumer, Exchange, Producer, Queue

from spillway_testlib import drain, queue_exists, wait_until


def test_server_named_queue(conn, ch):
    a = ch.queue_declare("", exclusive=True).method
    b = ch.queue_declare("", exclusive=True).method
    assert a.queue and b.queue and a.queue != b.queue
    assert (a.message_count, a.consumer_count) == (0, 0)
    ch.basic_publish("", a.queue, b"to server-named")
    assert [body for _, _, body in drain(ch, a.queue, n=1)] == [b"to server-named"]


def test_declare_ok_echoes_name_and_counts(conn, ch, names):
    q = names.queue()
    ok = ch.queue_declare(q).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (q, 0, 0)
    ch.confirm_delivery()
    for _ in range(3):
        ch.basic_publish("", q, b"x")
    ok = ch.queue_declare(q).method  # non-passive redeclare also reports counts
    assert (ok.queue, ok.message_count, ok.consumer_count) == (q, 3, 0)


def test_passive_declare_reports_message_and_consumer_counts(broker, conn, ch, names):
    full, busy = names.queue(), names.queue()
    ch.queue_declare(full)
    ch.queue_declare(busy)
    ch.confirm_delivery()
    for _ in range(3):
        ch.basic_publish("", full, b"x")
    c2 = broker.connect()
    try:
        ch2 = c2.channel()
        ch2.basic_consume(busy, lambda *a: None)
        ch2.basic_consume(busy, lambda *a: None)
        ok = ch.queue_declare(full, passive=True).method
        assert (ok.message_count, ok.consumer_count) == (3, 0)
        ok = ch.queue_declare(busy, passive=True).method
        assert (ok.message_count, ok.consumer_count) == (0, 2)
    finally:
        c2.close()
    assert wait_until(lambda: ch.queue_declare(busy, passive=True).method.consumer_count == 0)


def test_exclusive_queue_deleted_when_connection_closes(broker, conn, names):
    q = names.queue()
    owner = broker.connect()
    owner.channel().queue_declare(q, exclusive=True, durable=False)
    assert queue_exists(owner, q)
    owner.close()
    assert wait_until(lambda: not queue_exists(conn, q))


def test_exclusive_queue_survives_its_channel_closing(broker, conn, names):
    q = names.queue()
    owner = broker.connect()
    try:
        och = owner.channel()
        och.queue_declare(q, exclusive=True)
        och.close()
        assert queue_exists(owner, q)
    finally:
        owner.close()


def test_auto_delete_queue_deleted_after_last_consumer_cancels(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q, auto_delete=True)
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    assert queue_exists(conn, q), "auto-delete queue must stay while a consumer is left"
    ch.basic_cancel(t2)
    assert wait_until(lambda: not queue_exists(conn, q))


def test_auto_delete_queue_without_consumers_stays(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q, auto_delete=True)
    ch.close()
    # Staying is the behaviour: give a wrong deletion time to happen (no condition to
    # wait for), then check.
    time.sleep(0.2)
    assert queue_exists(conn, q)


def test_auto_delete_queue_read_with_get_keeps_its_unacked_message(broker, conn, names):
    """Only basic.consume consumers count for auto-delete: a client that takes a message
    with basic.get and disconnects without acking finds it requeued, not deleted with the
    queue (the official Go client's integration tests do this)."""
    q = names.queue()
    owner = broker.connect()
    och = owner.channel()
    och.queue_declare(q, durable=True, auto_delete=True)
    och.confirm_delivery()
    och.basic_publish("", q, b"kept", pika.BasicProperties(delivery_mode=2))
    method, _, body = och.basic_get(q, auto_ack=False)
    assert body == b"kept"
    owner.close()

    def requeued():
        if not queue_exists(conn, q):
            return "gone"
        probe = conn.channel()
        count = probe.queue_declare(q, passive=True).method.message_count
        probe.close()
        return count == 1

    assert wait_until(requeued, conn=conn) is True
    ch = conn.channel()
    method, _, body = ch.basic_get(q, auto_ack=False)
    assert (body, method.redelivered) == (b"kept", True)
    ch.basic_ack(method.delivery_tag)
    ch.close()
    assert queue_exists(conn, q)


def test_auto_delete_queue_deleted_when_consumer_connection_closes(broker, conn, names):
    q = names.queue()
    c2 = broker.connect()
    ch2 = c2.channel()
    ch2.queue_declare(q, auto_delete=True)
    ch2.basic_consume(q, lambda *a: None)
    c2.close()
    assert wait_until(lambda: not queue_exists(conn, q))


def test_purge_returns_count(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(4):
        ch.basic_publish("", q, str(i).encode())
    assert ch.queue_purge(q).method.message_count == 4
    assert ch.queue_declare(q, passive=True).method.message_count == 0
    assert ch.queue_purge(q).method.message_count == 0


def test_purge_does_not_touch_unacked(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(3):
        ch.basic_publish("", q, str(i).encode())
    [(m, _, _)] = drain(ch, q, n=1, ack=False)
    assert ch.queue_purge(q).method.message_count == 2
    ch.basic_reject(m.delivery_tag, requeue=True)
    assert [b for _, _, b in drain(ch, q, n=1)] == [b"0"]


def test_delete_returns_count(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", q, str(i).encode())
    assert ch.queue_delete(q).method.message_count == 5
    assert not queue_exists(conn, q)


def test_delete_if_empty_fails_406_when_not_empty(conn, ch, names):
    q = names.queue()
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish("", q, b"x")
    with pytest.raises(pe.ChannelClosedByBroker) as e:
        ch.queue_delete(q, if_empty=True)
    assert e.value.reply_code == 406
    assert queue_exists(conn, q)
    ch2 = conn.channel()
    ch2.queue_purge(q)
    ch2.queue_delete(q, if_empty=True)
    assert not queue_exists(conn, q)


def test_delete_if_unused_fails_406_with_consumer(broker, conn, names):
    q = names.queue()
    c2 = broker.connect()
    try:
        ch2 = c2.channel()
        ch2.queue_declare(q)
        tag = ch2.basic_consume(q, lambda *a: None)
        ch = conn.channel()
        with pytest.raises(pe.ChannelClosedByBroker) as e:
            ch.queue_delete(q, if_unused=True)
        assert e.value.reply_code == 406
        assert queue_exists(conn, q)
        ch2.basic_cancel(tag)
        conn.channel().queue_delete(q, if_unused=True)
        assert not queue_exists(conn, q)
    finally:
        c2.close()


def test_delete_missing_queue_is_ok(conn, ch, names):
    # RabbitMQ answers delete-ok for a queue that does not exist.
    assert ch.queue_delete(names.queue()).method.message_count == 0


def test_queue_delete_cancels_consumers(broker, conn, names):
    """The broker tells consumers (consumer_cancel_notify) when their queue goes away."""
    q = names.queue()
    c2 = broker.connect()
    try:
        ch2 = c2.channel()
        ch2.queue_declare(q)
        cancelled = []
        ch2.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
        tag = ch2.basic_consume(q, lambda *a: None)
        assert tag in ch2.consumer_tags
        conn.channel().queue_delete(q)
        assert wait_until(lambda: cancelled, conn=c2), "no basic.cancel from the broker"
        assert cancelled == [tag]
        assert tag not in ch2.consumer_tags
        assert ch2.is_open
    finally:
        c2.close()


def test_server_capabilities(conn):
    # pika advertises consumer_cancel_notify (needed for the test above) and relies on the
    # server's own capabilities table for confirms, nacks and connection.blocked.
    assert conn._impl._client_properties["capabilities"]["consumer_cancel_notify"] is True
    caps = conn._impl.server_capabilities
    for cap in ("consumer_cancel_notify", "publisher_confirms", "basic.nack",
                "exchange_exchange_bindings", "authentication_failure_close",
                "connection.blocked"):
        assert caps.get(cap) is True, cap


def test_bind_unbind_changes_routing(conn, ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "direct")
    ch.queue_declare(q)
    ch.confirm_delivery()
    ch.basic_publish(x, "k", b"before-bind")
    ch.queue_bind(q, x, "k")
    ch.basic_publish(x, "k", b"bound")
    ch.basic_publish(x, "other", b"other-key")
    ch.queue_unbind(q, x, "k")
    ch.basic_publish(x, "k", b"after-unbind")
    assert [b for _, _, b in drain(ch, q)] == [b"bound"]


def test_unbind_one_of_two_bindings(conn, ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "topic")
    ch.queue_declare(q)
    ch.queue_bind(q, x, "a.*")
    ch.queue_bind(q, x, "*.b")
    ch.queue_unbind(q, x, "a.*")
    ch.confirm_delivery()
    for key in ("a.x", "x.b", "a.b"):
        ch.basic_publish(x, key, key.encode())
    assert [b for _, _, b in drain(ch, q)] == [b"x.b", b"a.b"]


def test_headers_unbind_with_arguments(conn, ch, names):
    x, q = names.exchange(), names.queue()
    ch.exchange_declare(x, "headers")
    ch.queue_declare(q)
    args = {"x-match": "any", "k": "v"}
    ch.queue_bind(q, x, "", arguments=args)
    ch.basic_publish(x, "", b"1", pika.BasicProperties(headers={"k": "v"}))
    ch.queue_unbind(q, x, "", arguments=args)
    ch.basic_publish(x, "", b"2", pika.BasicProperties(headers={"k": "v"}))
    assert [b for _, _, b in drain(ch, q)] == [b"1"]


def test_exchange_to_exchange_binding(conn, ch, names):
    src, dst, q = names.exchange(), names.exchange(), names.queue()
    ch.exchange_declare(src, "topic")
    ch.exchange_declare(dst, "fanout")
    ch.queue_declare(q)
    ch.queue_bind(q, dst)
    ch.exchange_bind(dst, src, "a.#")
    ch.confirm_delivery()
    ch.basic_publish(src, "a.b", b"routed")
    ch.basic_publish(src, "b.a", b"dropped")
    ch.exchange_unbind(dst, src, "a.#")
    ch.basic_publish(src, "a.c", b"after unbind")
    assert [b for _, _, b in drain(ch, q)] == [b"routed"]


def test_kombu_queue_declare_bind_unbind(kconn, names):
    x = Exchange(names.exchange(), type="direct")
    qname = names.queue()
    with kconn.channel() as chan:
        q = Queue(qname, x, routing_key="k1")(chan)
        q.declare()  # declares exchange, queue and binding
        q.bind_to(x, routing_key="k2")
        prod = Producer(chan, exchange=x)
        prod.publish("one", routing_key="k1", serializer="json")
        prod.publish("two", routing_key="k2", serializer="json")
        q.unbind_from(x, routing_key="k1")
        prod.publish("three", routing_key="k1", serializer="json")
        prod.publish("four", routing_key="k2", serializer="json")
        got = []
        with Consumer(chan, [q], callbacks=[lambda b, m: (got.append(b), m.ack())]):
            deadline = time.monotonic() + 3
            while len(got) < 3 and time.monotonic() < deadline:
                try:
                    kconn.drain_events(timeout=0.3)
                except TimeoutError:
                    pass
        assert got == ["one", "two", "four"]
        assert q.purge() == 0
        q.delete()
        x(chan).delete()
