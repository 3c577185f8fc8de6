"""Producer flow control as pika sees it: connection.blocked/unblocked on a queue with
x-qpid-capacity, pika's blocked_connection_timeout, and a producer that ignores the block
being held by TCP back-pressure with the broker's memory bounded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pika
import pika.exceptions
import pytest

CAPACITY = 64 * 1024
RESUME = 32 * 1024


def capped(names, ch, capacity=CAPACITY, resume=RESUME) -> str:
    q = names.queue()
    ch.queue_declare(q, arguments={"x-qpid-capacity": capacity,
                                   "x-qpid-flow-resume-capacity": resume})
    return q


def rss_bytes(broker) -> int:
    """Resident memory of every broker process (0 for a broker run by someone else)."""
    total = 0
    for proc in getattr(broker, "procs", {}).values():
        if proc.popen is None:
            continue
        try:
            status = Path(f"/proc/{proc.popen.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.spillway_only  # Qpid's queue capacities: RabbitMQ ignores them
def test_blocked_then_unblocked_once_a_consumer_drains(broker, names, ch):
    q = capped(names, ch)
    producer = broker.connect()
    events: list[str] = []
    producer.add_on_connection_blocked_callback(
        lambda _conn, frame: events.append(f"blocked:{frame.method.reason}"))
    producer.add_on_connection_unblocked_callback(lambda _conn, _frame: events.append("unblocked"))
    pch = producer.channel()
    pch.confirm_delivery()
    body = b"x" * 1024
    total = 300
    sent = 0
    while sent < total and not events:
        pch.basic_publish("", q, body, pika.BasicProperties(message_id=str(sent)))
        sent += 1
        # BlockingConnection runs callbacks only when it processes events.
        producer.process_data_events(time_limit=0)
    assert events and events[0].startswith("blocked:"), events
    assert q in events[0], events
    assert sent < total, "never blocked"

    # A consumer on another connection drains below the resume capacity.
    consumer = broker.connect()
    cch = consumer.channel()
    seen: list[int] = []

    def drain():
        while True:
            method, _props, got = cch.basic_get(q, auto_ack=True)
            if method is None:
                return
            seen.append(int(_props.message_id))

    drain()
    deadline = time.monotonic() + 10
    while "unblocked" not in events and time.monotonic() < deadline:
        producer.process_data_events(time_limit=0.1)
    assert "unblocked" in events, events

    # The producer finishes (draining as it goes, so it may be blocked again).
    while sent < total:
        if len(events) % 2 == 1:  # blocked: let the consumer catch up
            drain()
            producer.process_data_events(time_limit=0.05)
            continue
        pch.basic_publish("", q, body, pika.BasicProperties(message_id=str(sent)))
        sent += 1
        producer.process_data_events(time_limit=0)
    deadline = time.monotonic() + 10
    while len(seen) < total and time.monotonic() < deadline:
        drain()
        producer.process_data_events(time_limit=0.05)
    assert seen == list(range(total))
    producer.close()
    consumer.close()


@pytest.mark.spillway_only  # Qpid's queue capacities: RabbitMQ ignores them
def test_blocked_connection_timeout_closes_the_connection(broker, names, ch):
    """pika's blocked_connection_timeout: blocked for longer than it, pika closes the
    connection itself and raises ConnectionBlockedTimeout."""
    q = capped(names, ch)
    producer = broker.connect(blocked_connection_timeout=1)
    blocked: list[str] = []
    producer.add_on_connection_blocked_callback(lambda _c, f: blocked.append(f.method.reason))
    pch = producer.channel()
    with pytest.raises(pika.exceptions.ConnectionBlockedTimeout):
        for _ in range(200):
            pch.basic_publish("", q, b"y" * 1024)
            producer.process_data_events(time_limit=0)
            if blocked:
                break
        assert blocked, "never blocked"
        # Stopped publishing; still blocked a second later.
        producer.process_data_events(time_limit=5)
    ch.queue_purge(q)


@pytest.mark.spillway_only  # Qpid's queue capacities: RabbitMQ ignores them
def test_a_producer_that_ignores_the_block_is_held_with_memory_bounded(broker, names, ch):
    """pika keeps writing while blocked; the gateway lets it spend its overdraft, then stops
    reading its socket. Aiming for 1 GiB into a 1 MiB queue, it gets nowhere near, and the
    broker's memory does not grow with what it tries to send."""
    q = capped(names, ch, capacity=1 << 20, resume=512 * 1024)
    body = b"z" * (64 * 1024)
    target = 1 << 30
    published = [0]
    stop = threading.Event()
    errors: list[BaseException] = []
    producer = broker.connect(blocked_connection_timeout=None)

    def publish():
        try:
            pch = producer.channel()
            while published[0] < target and not stop.is_set():
                pch.basic_publish("", q, body)
                published[0] += len(body)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    before = rss_bytes(broker)
    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    highest = before
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        highest = max(highest, rss_bytes(broker))
        time.sleep(0.1)
    held_at = published[0]
    assert not errors, errors
    assert held_at < 64 << 20, f"published {held_at} bytes into a 1 MiB queue"
    if before:
        assert highest - before < 128 << 20, f"broker RSS grew by {highest - before} bytes"
    # Let it go: purge until the thread notices the stop flag.
    stop.set()
    deadline = time.monotonic() + 20
    while thread.is_alive() and time.monotonic() < deadline:
        ch.queue_purge(q)
        thread.join(timeout=0.2)
    assert not thread.is_alive(), "the producer stayed held after the queue emptied"
    # Empty again first, once what it sent last has landed: a paused
    # connection's close would not be read.
    for _ in range(3):
        ch.queue_purge(q)
        time.sleep(0.3)
    producer.close()
    print(f"held at {held_at} bytes; broker RSS {before} -> peak {highest}")
