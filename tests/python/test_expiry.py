"""Message and queue TTL as pika sees it: the ``expiration`` property and ``x-message-ttl``
(the lower wins), expired messages dead-lettered with reason ``expired`` and RabbitMQ's
x-death (``original-expiration``, no ``expiration`` on the dead letter), TTL 0, unacked
messages that do not expire and requeued ones that do, ``x-expires``, and the refusals in
RabbitMQ's words. These pass against RabbitMQ 3.10 too (``with-rabbitmq.sh``), except the
restart case, which needs a broker of its own."""

from __future__ import annotations

import time

import pika
import pika.exceptions as pe
import pytest

from spillway_testlib import drain, uniq, wait_until


def get_one(ch, queue: str, timeout: float = 5.0):
    """basic.get the next message of ``queue`` (unacked), waiting for it to arrive."""
    got = drain(ch, queue, n=1, timeout=timeout, ack=False)
    assert got, f"nothing arrived in {queue}"
    return got[0]


def ttl_setup(ch, names, **queue_args):
    """A dead-letter queue and a work queue that dead-letters to it through the default
    exchange. Returns (dead queue, work queue)."""
    dead, work = names.queue("dead"), names.queue("work")
    ch.queue_declare(dead)
    args = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
    args.update(queue_args)
    ch.queue_declare(work, arguments=args)
    return dead, work


def assert_expired_in(props, queue: str, original_expiration: str | None):
    """The single x-death entry of a message that expired in ``queue``."""
    assert props.expiration is None  # RabbitMQ removes it from the dead letter
    headers = props.headers
    [death] = headers["x-death"]
    assert death["count"] == 1
    assert death["reason"] == "expired"
    assert death["queue"] == queue
    assert death["exchange"] == ""
    assert death["routing-keys"] == [queue]
    assert death["time"]
    if original_expiration is None:
        assert "original-expiration" not in death
    else:
        assert death["original-expiration"] == original_expiration
    assert headers["x-first-death-reason"] == "expired"
    assert headers["x-first-death-queue"] == queue
    assert headers["x-first-death-exchange"] == ""


def test_per_message_ttl_dead_letters_expired(ch, names):
    dead, work = ttl_setup(ch, names)
    props = pika.BasicProperties(expiration="100", content_type="text/plain",
                                 headers={"app": "kept"}, delivery_mode=2)
    ch.basic_publish("", work, b"short-lived", props)
    ch.basic_publish("", work, b"lasting")
    method, props, body = get_one(ch, dead)
    assert body == b"short-lived"
    assert (method.exchange, method.routing_key) == ("", dead)
    assert props.content_type == "text/plain"
    assert props.delivery_mode == 2
    assert props.headers["app"] == "kept"
    assert_expired_in(props, work, "100")
    ch.basic_ack(method.delivery_tag)
    # The one without an expiration stays.
    assert [b for _, _, b in drain(ch, work, n=1)] == [b"lasting"]


def test_queue_ttl_and_message_ttl_the_lower_wins(ch, names):
    dead, short = ttl_setup(ch, names, **{"x-message-ttl": 100})
    long = names.queue("long")
    ch.queue_declare(long, arguments={"x-dead-letter-exchange": "",
                                      "x-dead-letter-routing-key": dead,
                                      "x-message-ttl": 600000})
    ch.basic_publish("", short, b"queue-ttl", pika.BasicProperties(expiration="600000"))
    ch.basic_publish("", long, b"message-ttl", pika.BasicProperties(expiration="100"))
    ch.basic_publish("", short, b"no-expiration")
    got = drain(ch, dead, n=3, ack=False)
    by_body = {body: props for _, props, body in got}
    assert set(by_body) == {b"queue-ttl", b"message-ttl", b"no-expiration"}
    assert_expired_in(by_body[b"queue-ttl"], short, "600000")
    assert_expired_in(by_body[b"message-ttl"], long, "100")
    assert_expired_in(by_body[b"no-expiration"], short, None)
    for method, _, _ in got:
        ch.basic_ack(method.delivery_tag)
    assert ch.queue_declare(short, passive=True).method.message_count == 0


def test_ttl_zero_delivered_at_once_or_expired(conn, ch, names):
    dead, work = ttl_setup(ch, names)
    ch.basic_publish("", work, b"nobody", pika.BasicProperties(expiration="0"))
    method, _, _ = ch.basic_get(work, auto_ack=True)
    assert method is None, "an expired message was handed out"
    _, props, body = get_one(ch, dead)
    assert body == b"nobody"
    assert_expired_in(props, work, "0")

    consumer_ch = conn.channel()
    got = []
    consumer_ch.basic_consume(work, lambda c, m, p, b: got.append((p, b)), auto_ack=True)
    ch.basic_publish("", work, b"taken", pika.BasicProperties(expiration="0"))
    assert wait_until(lambda: got, timeout=5, conn=conn)
    [(props, body)] = got
    assert body == b"taken"
    assert props.expiration == "0"
    consumer_ch.close()


def test_unacked_messages_do_not_expire_requeued_ones_do(ch, names):
    dead, work = ttl_setup(ch, names, **{"x-message-ttl": 300})
    ch.basic_publish("", work, b"held")
    ch.basic_publish("", work, b"waiting")
    held, _, body = get_one(ch, work)
    assert body == b"held"
    method, props, body = get_one(ch, dead)
    assert body == b"waiting"
    ch.basic_ack(method.delivery_tag)
    # Its time has passed while it was ours; back in the queue, it expires.
    ch.basic_nack(held.delivery_tag, requeue=True)
    method, props, body = get_one(ch, dead)
    assert body == b"held"
    assert_expired_in(props, work, None)
    ch.basic_ack(method.delivery_tag)
    assert ch.queue_declare(work, passive=True).method.message_count == 0


def queue_gone(conn, queue: str) -> bool:
    """Whether ``queue`` no longer exists (a passive declare on a channel of its own,
    which counts as a use for x-expires: probe less often than it)."""
    probe = conn.channel()
    try:
        probe.queue_declare(queue, passive=True)
    except pe.ChannelClosedByBroker as e:
        assert e.reply_code == 404
        return True
    probe.close()
    return False


def test_x_expires_deletes_an_unused_queue(conn, ch, names):
    unused, kept = names.queue("unused"), names.queue("kept")
    ch.queue_declare(unused, arguments={"x-expires": 200})
    ch.queue_declare(kept, arguments={"x-expires": 200})
    ch.basic_publish("", unused, b"goes with it")
    consumer_ch = conn.channel()
    tag = consumer_ch.basic_consume(kept, lambda *a: None)
    assert wait_until(lambda: queue_gone(conn, unused), timeout=5, conn=conn, interval=0.5)
    # A consumer keeps it; once it leaves the queue goes too.
    assert not queue_gone(conn, kept)
    consumer_ch.basic_cancel(tag)
    assert wait_until(lambda: queue_gone(conn, kept), timeout=5, conn=conn, interval=0.5)
    consumer_ch.close()


def channel_error(conn, fn):
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker) as e:
        fn(ch)
        # asynchronous methods (publish) fail on the next synchronous call
        ch.queue_declare("", exclusive=True)
    assert conn.is_open, "a channel error must not close the connection"
    return e.value


@pytest.mark.parametrize("key,value,why", [
    ("x-message-ttl", -1, "{value_negative,-1}"),
    ("x-message-ttl", "1000", '"expected integer, got longstr"'),
    ("x-expires", 0, "{value_zero,0}"),
    ("x-expires", -5, "{value_negative,-5}"),
])
def test_bad_ttl_arguments_406(conn, key, value, why):
    q = uniq("bad")
    err = channel_error(conn, lambda ch: ch.queue_declare(q, arguments={key: value}))
    assert err.reply_code == 406
    assert err.reply_text == (
        f"PRECONDITION_FAILED - invalid arg '{key}' for queue '{q}' in vhost '/': {why}")


@pytest.mark.parametrize("expiration,why", [
    ("soon", "no_integer"),
    ("-1", "{value_negative,-1}"),
    ("10s", '{leftover_string,"s"}'),
])
def test_bad_expiration_406(conn, names, expiration, why):
    q = names.queue()
    setup = conn.channel()
    setup.queue_declare(q)
    setup.close()
    err = channel_error(conn, lambda ch: ch.basic_publish(
        "", q, b"x", pika.BasicProperties(expiration=expiration)))
    assert err.reply_code == 406
    assert err.reply_text == (
        f"PRECONDITION_FAILED - invalid expiration '{expiration}': {why}")
    check = conn.channel()
    assert check.queue_declare(q, passive=True).method.message_count == 0
    check.close()


@pytest.mark.restart
@pytest.mark.timeout(120)
def test_persistent_expiry_survives_a_restart(fresh_broker):
    b = fresh_broker
    dead, work = uniq("dead"), uniq("work")
    c = b.connect()
    ch = c.channel()
    ch.confirm_delivery()
    ch.queue_declare(dead, durable=True)
    ch.queue_declare(work, durable=True, arguments={"x-dead-letter-exchange": "",
                                                    "x-dead-letter-routing-key": dead})
    ch.basic_publish("", work, b"mortal",
                     pika.BasicProperties(delivery_mode=2, expiration="1500"))
    ch.basic_publish("", work, b"lasting", pika.BasicProperties(delivery_mode=2))
    c.close()
    b.restart()
    c = b.connect()
    ch = c.channel()
    method, props, body = get_one(ch, dead, timeout=10)
    assert body == b"mortal"
    assert props.delivery_mode == 2
    assert_expired_in(props, work, "1500")
    ch.basic_ack(method.delivery_tag)
    assert [body for _, _, body in drain(ch, work, n=1)] == [b"lasting"]
    c.close()


def test_kombu_message_ttl_dead_letters(kconn, names):
    """kombu's Queue(message_ttl=...) is x-message-ttl: an unconsumed message expires into
    the dead-letter queue with reason expired (passes against RabbitMQ too)."""
    from kombu import Exchange, Producer, Queue

    dlx, dead, work = names.exchange("dlx"), names.queue("dead"), names.queue("work")
    with kconn.channel() as chan:
        Exchange(dlx, "fanout")(chan).declare()
        Queue(dead, Exchange(dlx, "fanout"))(chan).declare()
        Queue(work, routing_key=work, message_ttl=0.05,
              queue_arguments={"x-dead-letter-exchange": dlx})(chan).declare()
        Producer(chan).publish({"n": 1}, routing_key=work, serializer="json")
        deadline = time.monotonic() + 5
        message = None
        while message is None and time.monotonic() < deadline:
            message = Queue(dead)(chan).get(no_ack=True, accept=["json"])
            if message is None:
                time.sleep(0.05)
        assert message is not None, "the message did not expire into the dead-letter queue"
        assert message.payload == {"n": 1}
        death = message.headers["x-death"][0]
        assert death["reason"] == "expired" and death["queue"] == work
