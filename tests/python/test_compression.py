"""Message compression seen from pika (docs/compression.md): with
``gateway.message_compression_enabled`` on, random and compressible bodies below and above the
threshold come back byte-identical through consume and basic.get, and persistent ones across
a restart. Starts its own broker per wiring (skipped against an external broker).
"""

from __future__ import annotations

import os

import pika
import pytest

from spillway_testlib import SpillwayBroker, uniq

if os.environ.get("SPILLWAY_TEST_AMQP_URL"):
    pytest.skip("starts its own broker with compression on", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

WIRINGS = [w.strip() for w in
           os.environ.get("SPILLWAY_TEST_WIRINGS", "all-in-one,separate").split(",")
           if w.strip()]

# Written with Qpid's names on purpose (`broker.*`, `connection.*`): they
# stay accepted as other names of `gateway.message_compression_*`.
CONFIG = """
[broker]
message_compression_enabled = true

[connection]
message_compression_threshold_size = "16KiB"
"""


def compressible(size: int, seed: int) -> bytes:
    line = 0
    out = bytearray()
    while len(out) < size:
        out += f'{{"seed": {seed}, "line": {line}, "status": "ok"}}\n'.encode()
        line += 1
    return bytes(out[:size])


BODIES = [
    b"",
    os.urandom(1000),
    compressible(1000, 1),
    compressible(16 * 1024, 2),
    compressible(16 * 1024 + 1, 3),
    os.urandom(70_000),
    compressible(250_000, 4),
]


@pytest.fixture(params=WIRINGS)
def compressing_broker(request, tmp_path_factory):
    broker = SpillwayBroker(request.param,
                            tmp_path_factory.mktemp(f"compression-{request.param}"),
                            config=CONFIG)
    try:
        broker.start()
        yield broker
    finally:
        try:
            broker.stop()
        finally:
            broker.kill()


def test_bodies_round_trip_through_consume_get_and_a_restart(compressing_broker):
    broker = compressing_broker
    queue = uniq("compressed")
    conn = broker.connect()
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for body in BODIES:
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    # basic.get: the first one, acked.
    method, _, got = ch.basic_get(queue, auto_ack=True)
    assert method is not None and got == BODIES[0]
    conn.close()

    broker.restart()
    conn = broker.connect()
    ch = conn.channel()
    received = []
    for method, _, body in ch.consume(queue, inactivity_timeout=10):
        assert method is not None, f"only {len(received)} of {len(BODIES) - 1} came back"
        received.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(received) == len(BODIES) - 1:
            break
    ch.cancel()
    assert [len(b) for b in received] == [len(b) for b in BODIES[1:]]
    assert received == BODIES[1:]
    conn.close()


def test_kombu_bodies_round_trip(compressing_broker):
    """The same through kombu: compressible and random bodies above the threshold come back
    byte-identical through a kombu consumer."""
    from kombu import Consumer, Producer, Queue

    qname = uniq("kombu-compression")
    bodies = [compressible(100_000, 7), os.urandom(40_000), b"small"]
    with compressing_broker.kombu() as kconn, kconn.channel() as chan:
        q = Queue(qname, routing_key=qname, auto_delete=True)
        q(chan).declare()
        producer = Producer(chan)
        for body in bodies:
            producer.publish(body, routing_key=qname, serializer=None,
                             content_type="application/octet-stream")
        received = []
        with Consumer(chan, [q], callbacks=[lambda _b, m: (received.append(m.body), m.ack())],
                      accept=["application/octet-stream"]):
            for _ in range(50):
                if len(received) == len(bodies):
                    break
                try:
                    kconn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
        assert received == bodies
