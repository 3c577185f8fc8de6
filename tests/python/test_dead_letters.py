"""Dead-lettering as pika and kombu see it: RabbitMQ's x-dead-letter-exchange with the
x-death / x-first-death-* headers for rejected messages and length limits (these pass
against RabbitMQ 3.10 too), and delivery limits (RabbitMQ's x-delivery-limit, Qpid's
x-qpid-maximum-delivery-count with x-qpid-dlq-enabled), which RabbitMQ's classic queues
do not have: those are Spillway-only."""

from __future__ import annotations

import time

import pika
import pytest
from kombu import Consumer, Exchange, Producer, Queue

from spillway_testlib import drain


def get_one(ch, queue: str, timeout: float = 5.0):
    """basic.get the next message of ``queue`` (unacked), waiting for it to arrive."""
    got = drain(ch, queue, n=1, timeout=timeout, ack=False)
    assert got, f"nothing arrived in {queue}"
    return got[0]


def dead_letter_setup(ch, names, kind="direct", key="dead", **queue_args):
    """A dead-letter exchange, a queue bound to it with ``key``, and a work queue
    dead-lettering to it. Returns (exchange, dead queue, work queue)."""
    dlx, dead, work = names.exchange("dlx"), names.queue("dead"), names.queue("work")
    ch.exchange_declare(dlx, kind)
    ch.queue_declare(dead)
    ch.queue_bind(dead, dlx, routing_key=key)
    args = {"x-dead-letter-exchange": dlx}
    args.update(queue_args)
    ch.queue_declare(work, arguments=args)
    return dlx, dead, work


def test_rejected_message_carries_x_death(broker, ch, names):
    dlx, dead, work = dead_letter_setup(ch, names, key="parked",
                                        **{"x-dead-letter-routing-key": "parked"})
    props = pika.BasicProperties(content_type="text/plain", expiration="60000",
                                 headers={"app": "kept"}, delivery_mode=2)
    ch.basic_publish("", work, b"job", props)
    method, _, _ = get_one(ch, work)
    ch.basic_reject(method.delivery_tag, requeue=False)

    method, props, body = get_one(ch, dead)
    assert body == b"job"
    assert (method.exchange, method.routing_key) == (dlx, "parked")
    assert props.content_type == "text/plain"
    assert props.delivery_mode == 2
    assert props.expiration is None  # moved into x-death
    headers = props.headers
    assert headers["app"] == "kept"
    [death] = headers["x-death"]
    assert death["count"] == 1
    assert death["reason"] == "rejected"
    assert death["queue"] == work
    assert death["exchange"] == ""
    assert death["routing-keys"] == [work]
    assert death["original-expiration"] == "60000"
    assert death["time"]
    assert headers["x-first-death-reason"] == "rejected"
    assert headers["x-first-death-queue"] == work
    assert headers["x-first-death-exchange"] == ""
    if broker.wiring != "external":
        # RabbitMQ 3.13 writes these too; 3.10 does not.
        assert headers["x-last-death-reason"] == "rejected"
        assert headers["x-last-death-queue"] == work
        assert headers["x-last-death-exchange"] == ""
    ch.basic_ack(method.delivery_tag)


def test_rejected_again_after_a_retry_counts_two(ch, names):
    _, dead, work = dead_letter_setup(ch, names, kind="fanout")
    ch.basic_publish("", work, b"retry")
    method, _, _ = get_one(ch, work)
    ch.basic_nack(method.delivery_tag, requeue=False)
    method, props, body = get_one(ch, dead)
    ch.basic_ack(method.delivery_tag)
    # The client sends it back for another try, headers and all.
    ch.basic_publish("", work, body, pika.BasicProperties(headers=props.headers))
    method, _, _ = get_one(ch, work)
    ch.basic_reject(method.delivery_tag, requeue=False)
    method, props, _ = get_one(ch, dead)
    [death] = props.headers["x-death"]
    assert (death["queue"], death["reason"], death["count"]) == (work, "rejected", 2)
    assert props.headers["x-first-death-queue"] == work
    ch.basic_ack(method.delivery_tag)


def test_length_limits_dead_letter_maxlen(ch, names):
    dlx, dead, head = dead_letter_setup(ch, names, kind="fanout", **{"x-max-length": 1})
    refusing = names.queue("refusing")
    ch.queue_declare(refusing, arguments={"x-max-length": 1,
                                          "x-overflow": "reject-publish-dlx",
                                          "x-dead-letter-exchange": dlx})
    ch.confirm_delivery()
    ch.basic_publish("", head, b"h1")
    ch.basic_publish("", head, b"h2")
    ch.basic_publish("", refusing, b"r1")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", refusing, b"r2")
    got = drain(ch, dead, n=2)
    assert [body for _, _, body in got] == [b"h1", b"r2"]
    deaths = [props.headers["x-death"][0] for _, props, _ in got]
    assert [(d["queue"], d["reason"]) for d in deaths] == [(head, "maxlen"), (refusing, "maxlen")]


def test_kombu_reject_reaches_the_dead_letter_queue(kconn, names):
    dlx_name, dead_name, work_name = names.exchange("dlx"), names.queue("dead"), names.queue()
    with kconn.channel() as chan:
        dlx = Exchange(dlx_name, type="fanout")
        Queue(dead_name, exchange=dlx, routing_key="")(chan).declare()
        work = Queue(work_name, routing_key=work_name,
                     queue_arguments={"x-dead-letter-exchange": dlx_name})
        work(chan).declare()
        Producer(chan).publish({"n": 1}, routing_key=work_name, serializer="json")
        seen = []

        def reject(body, message):
            seen.append(body)
            message.reject()

        with Consumer(chan, [work], callbacks=[reject], accept=["json"]):
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                try:
                    kconn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
        assert seen == [{"n": 1}]
        dead = Queue(dead_name)(chan)
        message = None
        deadline = time.monotonic() + 5
        while message is None and time.monotonic() < deadline:
            message = dead.get(no_ack=True, accept=["json"])
        assert message is not None
        assert message.payload == {"n": 1}
        [death] = message.headers["x-death"]
        assert (death["queue"], death["reason"]) == (work_name, "rejected")


@pytest.mark.spillway_only
def test_delivery_limit_dead_letters_with_x_death(ch, names):
    # RabbitMQ's quorum-queue argument: one redelivery allowed.
    _, dead, work = dead_letter_setup(ch, names, kind="fanout", **{"x-delivery-limit": 1})
    ch.basic_publish("", work, b"poison")
    counts = []
    for _ in range(2):
        method, props, _ = get_one(ch, work)
        counts.append((props.headers or {}).get("x-delivery-count"))
        ch.basic_reject(method.delivery_tag, requeue=True)
    assert counts == [None, 1]
    method, props, body = get_one(ch, dead)
    assert body == b"poison"
    [death] = props.headers["x-death"]
    assert (death["queue"], death["reason"], death["count"]) == (work, "delivery_limit", 1)
    assert props.headers["x-first-death-reason"] == "delivery_limit"
    assert props.headers["x-last-death-reason"] == "delivery_limit"
    ok = ch.queue_declare(work, passive=True).method
    assert ok.message_count == 0


@pytest.mark.spillway_only
def test_qpid_dlq_receives_the_message_after_max_deliveries(ch, names):
    q = names.queue("qpid")
    names.queues.append(f"{q}_DLQ")
    names.exchanges.append(f"{q}_DLE")
    ch.queue_declare(q, durable=True, arguments={"x-qpid-dlq-enabled": True,
                                                 "x-qpid-maximum-delivery-count": 2})
    ch.basic_publish("", q, b"poison", pika.BasicProperties(delivery_mode=2))
    for _ in range(2):
        method, _, _ = get_one(ch, q)
        ch.basic_nack(method.delivery_tag, requeue=True)
    method, props, body = get_one(ch, f"{q}_DLQ")
    assert (method.exchange, body) == (f"{q}_DLE", b"poison")
    assert props.delivery_mode == 2
    assert props.headers["x-death"][0]["reason"] == "delivery_limit"
