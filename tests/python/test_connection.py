"""Connection-level behaviour: heartbeats, channels, asynchronous pika adapters."""

import asyncio
import socket
import time

import pika
import pytest
from pika.adapters.asyncio_connection import AsyncioConnection

from raw_amqp import RawAMQP
from spillway_testlib import drain


def test_server_properties(conn):
    props = conn._impl.server_properties
    assert props.get("capabilities"), props
    assert props.get("product"), props


def test_heartbeat_keeps_idle_connection_alive(broker, names):
    c = broker.connect(heartbeat=1)
    try:
        assert c._impl.params.heartbeat == 1, "client-requested heartbeat must be accepted"
        checker = c._impl._heartbeat_checker
        assert checker is not None
        ch = c.channel()
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline:
            c.process_data_events(time_limit=0.25)
        assert c.is_open and ch.is_open
        # The broker sent heartbeats while the connection was idle.
        assert checker._heartbeat_frames_received >= 2, checker._heartbeat_frames_received
        q = names.queue()
        ch.queue_declare(q)
        ch.basic_publish("", q, b"still alive")
        assert [b for _, _, b in drain(ch, q, n=1)] == [b"still alive"]
    finally:
        if c.is_open:
            c.close()


def test_broker_closes_connection_without_client_heartbeats(broker):
    """A client that negotiated heartbeat=1 and then goes silent is dropped (RabbitMQ:
    after two missed intervals)."""
    client = RawAMQP(broker.host, broker.port, heartbeat=1)
    client.sock.settimeout(10)
    start = time.monotonic()
    closed = False
    try:
        while time.monotonic() - start < 10:
            client.read_frame()  # heartbeats are skipped; anything else is unexpected
    except (ConnectionError, OSError):  # a Connection.Close frame before it is fine too
        closed = True
    finally:
        client.sock.close()
    elapsed = time.monotonic() - start
    assert closed and elapsed < 9, f"connection still open after {elapsed:.1f}s"


def test_heartbeat_disabled_connection_stays_open(broker):
    c = broker.connect(heartbeat=0)
    try:
        assert c._impl._heartbeat_checker is None
        # Idle on purpose, longer than a heartbeat interval would be: staying open is
        # the behaviour, there is no condition to wait for.
        time.sleep(2)
        c.process_data_events(time_limit=0.1)
        c.channel().queue_declare("", exclusive=True)
    finally:
        c.close()


def test_many_channels_on_one_connection(conn, names):
    q = names.queue()
    chans = [conn.channel() for _ in range(50)]
    chans[0].queue_declare(q)
    for i, ch in enumerate(chans):
        ch.basic_publish("", q, str(i).encode())
    got = drain(chans[-1], q, n=50)
    assert sorted(int(b) for _, _, b in got) == list(range(50))
    numbers = {ch.channel_number for ch in chans}
    assert len(numbers) == 50
    for ch in chans[::2]:
        ch.close()
    assert all(ch.is_open for ch in chans[1::2])


def test_channel_close_and_reopen(conn):
    for _ in range(20):
        ch = conn.channel()
        ch.queue_declare("", exclusive=True)
        ch.close()
    assert conn.is_open


def test_client_close_is_clean(broker):
    c = broker.connect()
    c.channel()
    c.close()
    assert c.is_closed


def test_garbage_protocol_header_rejected(broker):
    """A wrong protocol header gets the broker's supported header back, then a close."""
    s = socket.create_connection((broker.host, broker.port), timeout=5)
    try:
        s.sendall(b"AMQP\x01\x01\x00\x0a")
        data = b""
        while True:
            try:
                chunk = s.recv(64)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        assert data == b"AMQP\x00\x00\x09\x01"
    finally:
        s.close()


# -- asynchronous adapters -----------------------------------------------------------------

def _async_roundtrip(adapter, params, queue, n=100):
    """Declare, publish n with confirms, wait for every ack, consume all, close."""
    st = {"acked": set(), "nacked": set(), "got": [], "error": None, "next_tag": 0}
    holder = {}

    def fail(msg):
        st["error"] = st["error"] or msg
        conn = holder["conn"]
        if conn.is_open:
            conn.close()
        else:
            conn.ioloop.stop()

    def on_open(conn):
        conn.channel(on_open_callback=on_channel)

    def on_open_error(conn, err):
        st["error"] = f"open failed: {err!r}"
        conn.ioloop.stop()

    def on_closed(conn, reason):
        conn.ioloop.stop()

    def on_channel(ch):
        holder["ch"] = ch
        ch.confirm_delivery(on_confirm, callback=lambda _: ch.queue_declare(
            queue, callback=on_declared))

    def on_declared(frame):
        ch = holder["ch"]
        for i in range(n):
            ch.basic_publish("", queue, str(i).encode(),
                             pika.BasicProperties(delivery_mode=2 if i % 2 else 1))

    def on_confirm(frame):
        m = frame.method
        tags = ({t for t in range(1, m.delivery_tag + 1)} if m.multiple else {m.delivery_tag})
        if isinstance(m, pika.spec.Basic.Nack):
            st["nacked"] |= tags
        else:
            st["acked"] |= tags
        if len(st["acked"] | st["nacked"]) == n:
            holder["ch"].basic_consume(queue, on_message)

    def on_message(ch, method, props, body):
        st["got"].append(int(body))
        ch.basic_ack(method.delivery_tag)
        if len(st["got"]) == n:
            holder["conn"].close()

    conn = adapter(params, on_open_callback=on_open, on_open_error_callback=on_open_error,
                   on_close_callback=on_closed, **({"custom_ioloop": asyncio.new_event_loop()}
                                                    if adapter is AsyncioConnection else {}))
    holder["conn"] = conn
    conn.ioloop.call_later(30, lambda: fail("timed out"))
    if adapter is AsyncioConnection:
        conn.ioloop.run_forever()
        conn.ioloop.close()
    else:
        conn.ioloop.start()
    assert st["error"] is None, st["error"]
    assert st["acked"] == set(range(1, n + 1)) and not st["nacked"]
    assert st["got"] == list(range(n))


@pytest.mark.parametrize("adapter", [pika.SelectConnection, AsyncioConnection],
                         ids=["SelectConnection", "AsyncioConnection"])
def test_async_adapter_confirms_and_consume(broker, names, adapter):
    _async_roundtrip(adapter, broker.params(), names.queue())


def test_update_secret_keeps_the_connection(broker, names):
    """RabbitMQ's connection.update-secret (a client refreshing its password or token
    without reconnecting): answered with update-secret-ok and the connection carries on.
    Users from configuration have no expiring secret, so any new secret is taken, as
    RabbitMQ's internal user database does."""
    c = broker.connect()
    try:
        c.update_secret("guest", "token refreshed")
        c.update_secret("a-rotated-token", "token refreshed again")
        ch = c.channel()
        q = names.queue()
        ch.queue_declare(q)
        ch.basic_publish("", q, b"after the update")
        assert [b for _, _, b in drain(ch, q, n=1)] == [b"after the update"]
    finally:
        if c.is_open:
            c.close()
