"""Delayed messages as applications written for RabbitMQ's delayed-message plugin use them
from pika: an ``x-delayed-message`` exchange with ``x-delayed-type``, the ``x-delay``
header. Each message arrives when due, not before, in due order; one without a delay
is routed at once.

Spillway only: Debian's rabbitmq-server ships without the (community) plugin."""

import time

import pika
import pytest

from spillway_testlib import collect

pytestmark = pytest.mark.spillway_only


def test_messages_arrive_when_due_in_due_order(broker, names):
    conn = broker.connect()
    try:
        ch = conn.channel()
        exchange, queue = names.exchange("delayed"), names.queue("delayed")
        ch.exchange_declare(exchange, "x-delayed-message",
                            arguments={"x-delayed-type": "direct"})
        ch.queue_declare(queue)
        ch.queue_bind(queue, exchange, "jobs")
        ch.confirm_delivery()
        start = time.monotonic()
        for body, delay in ((b"third", 900), (b"first", 300), (b"second", 600)):
            ch.basic_publish(exchange, "jobs", body, pika.BasicProperties(
                delivery_mode=2, headers={"x-delay": delay}))
        ch.basic_publish(exchange, "jobs", b"now", pika.BasicProperties(headers={"x-delay": 0}))
        got = collect(conn, ch, queue, 4, timeout=10)
        bodies = [body for _, _, body in got]
        assert bodies == [b"now", b"first", b"second", b"third"], bodies
        assert time.monotonic() - start >= 0.9, "the last one was due after 900 ms"
    finally:
        conn.close()


def test_a_delayed_exchange_needs_its_type(broker, names):
    conn = broker.connect()
    try:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
            ch.exchange_declare(names.exchange("untyped"), "x-delayed-message")
        assert closed.value.reply_code == 406
        assert "x-delayed-type" in closed.value.reply_text
    finally:
        conn.close()
