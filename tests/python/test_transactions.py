"""AMQP transactions as pika sees them: tx.commit makes publishes and acks take effect,
tx.rollback discards publishes (these pass against RabbitMQ too). Rollback returning the
acked messages to the queue (Qpid's behaviour: RabbitMQ leaves them unacked), the
transaction timeouts (506 "Idle transaction timed out" / "Open transaction timed out") and
unroutable mandatory messages closing the connection (312) are Spillway-only."""

from __future__ import annotations

import os
import time

import pika
import pika.exceptions
import pytest

from spillway_testlib import SpillwayBroker, drain, wait_until

WIRINGS = [w.strip() for w in
           os.environ.get("SPILLWAY_TEST_WIRINGS", "all-in-one,separate").split(",")
           if w.strip()]


def count(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def test_commit_makes_publishes_visible_and_rollback_discards_them(conn, ch, names):
    q = names.queue("tx")
    ch.queue_declare(q, durable=True)
    ch.tx_select()
    persistent = pika.BasicProperties(delivery_mode=2)
    for i in range(5):
        ch.basic_publish("", q, f"kept-{i}".encode(), persistent)
    # Another channel sees nothing before commit.
    other = conn.channel()
    assert count(other, q) == 0
    ch.tx_commit()
    assert wait_until(lambda: count(other, q) == 5, conn=conn)

    for i in range(3):
        ch.basic_publish("", q, f"dropped-{i}".encode(), persistent)
    ch.tx_rollback()
    bodies = [body for _, _, body in drain(other, q, n=5)]
    assert bodies == [f"kept-{i}".encode() for i in range(5)]
    assert count(other, q) == 0


def test_acks_in_a_transaction_take_effect_at_commit(broker, conn, ch, names):
    q = names.queue("txack")
    ch.queue_declare(q)
    for i in range(3):
        ch.basic_publish("", q, f"m{i}".encode())
    ch.tx_select()
    got = drain(ch, q, n=3, ack=False)
    assert len(got) == 3
    ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    ch.tx_commit()
    conn.close()
    # Nothing comes back once the connection is gone: the acks were committed.
    again = broker.connect()
    try:
        assert count(again.channel(), q) == 0
    finally:
        again.close()


@pytest.mark.spillway_only
def test_rollback_returns_acked_messages_redelivered(conn, ch, names):
    q = names.queue("txroll")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"once")
    ch.tx_select()
    [(method, _, body)] = drain(ch, q, n=1, ack=False)
    assert not method.redelivered
    ch.basic_ack(method.delivery_tag)
    ch.tx_rollback()
    # Qpid's behaviour: the ack is undone and the message goes back to its queue.
    [(method, _, body)] = drain(ch, q, n=1, ack=False)
    assert body == b"once"
    assert method.redelivered
    ch.basic_ack(method.delivery_tag)
    ch.tx_commit()
    assert count(ch, q) == 0


def test_closing_the_channel_rolls_back(conn, ch, names):
    q = names.queue("txclose")
    ch.queue_declare(q)
    ch.tx_select()
    ch.basic_publish("", q, b"never")
    ch.close()
    other = conn.channel()
    assert count(other, q) == 0


@pytest.mark.spillway_only
def test_unroutable_mandatory_in_a_transaction_closes_the_connection(conn, ch, names):
    ch.tx_select()
    ch.basic_publish("", names.queue("nowhere"), b"lost", mandatory=True)
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        ch.tx_commit()
    assert closed.value.reply_code == 312
    assert "No route" in closed.value.reply_text


@pytest.fixture(params=WIRINGS)
def timeout_broker(request, tmp_path):
    if os.environ.get("SPILLWAY_TEST_AMQP_URL"):
        pytest.skip("needs a Spillway started with transaction timeouts")
    config = """
[engine]
default_transaction_idle_warn = 200
default_transaction_idle_close = 700
"""
    b = SpillwayBroker(request.param, tmp_path / "broker", config=config)
    try:
        b.start()
        yield b
    finally:
        try:
            b.stop()
        finally:
            b.kill()


@pytest.mark.spillway_only
def test_idle_transaction_is_closed_with_506(timeout_broker):
    conn = timeout_broker.connect()
    ch = conn.channel()
    q = "tx-idle"
    ch.queue_declare(q)
    ch.tx_select()
    ch.basic_publish("", q, b"left open")
    started = time.monotonic()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        while time.monotonic() - started < 10:
            conn.process_data_events(time_limit=0.1)
    assert closed.value.reply_code == 506
    assert "Idle transaction timed out" in closed.value.reply_text
    assert wait_until(lambda: "CHN-1008 : Idle Transaction : " in timeout_broker.logs()), \
        timeout_broker.logs()
    assert "CHN-1003 : Close : Idle transaction timed out" in timeout_broker.logs()
    # Rolled back: nothing was published.
    again = timeout_broker.connect()
    try:
        assert count(again.channel(), q) == 0
    finally:
        again.close()


# -- kombu -------------------------------------------------------------------------------

def test_kombu_transaction_commit_and_rollback(kconn, names):
    """kombu's channel (py-amqp) in a transaction: a rolled-back publish never arrives, a
    committed one does (passes against RabbitMQ too)."""
    from kombu import Producer, Queue

    qname = names.queue()
    with kconn.channel() as chan:
        q = Queue(qname, routing_key=qname)
        q(chan).declare()
        chan.tx_select()
        producer = Producer(chan)
        producer.publish({"n": 1}, routing_key=qname, serializer="json")
        chan.tx_rollback()
        assert q(chan).queue_declare(passive=True)[1] == 0
        producer.publish({"n": 2}, routing_key=qname, serializer="json")
        assert q(chan).queue_declare(passive=True)[1] == 0, "visible before commit"
        chan.tx_commit()
        assert q(chan).queue_declare(passive=True)[1] == 1
        message = q(chan).get(no_ack=True, accept=["json"])
        assert message is not None and message.payload == {"n": 2}
