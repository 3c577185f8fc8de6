"""AMQP errors: the reply codes a RabbitMQ user would recognise, and what survives them."""

import pika
import pika.exceptions as pe
import pytest

from spillway_testlib import drain


def channel_error(conn, fn, code):
    """Run fn(new_channel); expect the broker to close that channel with `code`."""
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker) as e:
        fn(ch)
        # asynchronous methods (publish, ack) fail on the next synchronous call
        ch.queue_declare("", exclusive=True)
    assert e.value.reply_code == code, e.value
    assert ch.is_closed
    assert conn.is_open, "a channel error must not close the connection"
    # The connection is still fine: another channel works.
    ch2 = conn.channel()
    ch2.queue_declare("", exclusive=True)
    ch2.close()
    return e.value


def test_passive_declare_missing_queue_404(conn, names):
    err = channel_error(conn, lambda ch: ch.queue_declare(names.queue(), passive=True), 404)
    assert "NOT_FOUND" in err.reply_text


def test_passive_declare_missing_exchange_404(conn, names):
    channel_error(conn, lambda ch: ch.exchange_declare(names.exchange(), passive=True), 404)


def test_redeclare_queue_with_different_durable_406(conn, names):
    q = names.queue()
    conn.channel().queue_declare(q, durable=False)
    err = channel_error(conn, lambda ch: ch.queue_declare(q, durable=True), 406)
    assert "PRECONDITION_FAILED" in err.reply_text


def test_redeclare_queue_with_different_auto_delete_406(conn, names):
    q = names.queue()
    conn.channel().queue_declare(q, auto_delete=False)
    channel_error(conn, lambda ch: ch.queue_declare(q, auto_delete=True), 406)


def test_redeclare_queue_with_different_arguments_406(conn, names):
    q = names.queue()
    conn.channel().queue_declare(q, arguments={"x-max-length": 10})
    channel_error(conn, lambda ch: ch.queue_declare(q, arguments={"x-max-length": 20}), 406)
    channel_error(conn, lambda ch: ch.queue_declare(q, arguments={"x-message-ttl": 1000,
                                                                  "x-max-length": 10}), 406)
    # The same declaration again is fine, and so is a passive one.
    ch = conn.channel()
    ch.queue_declare(q, arguments={"x-max-length": 10})
    ch.queue_declare(q, passive=True)


def test_redeclare_exchange_with_different_type_406(conn, names):
    x = names.exchange()
    conn.channel().exchange_declare(x, "direct")
    err = channel_error(conn, lambda ch: ch.exchange_declare(x, "topic"), 406)
    assert "PRECONDITION_FAILED" in err.reply_text
    conn.channel().exchange_declare(x, "direct")  # same again: fine


def test_redeclare_exchange_with_different_durable_406(conn, names):
    x = names.exchange()
    conn.channel().exchange_declare(x, "fanout", durable=False)
    channel_error(conn, lambda ch: ch.exchange_declare(x, "fanout", durable=True), 406)


def test_declare_exchange_with_reserved_amq_prefix_403(conn):
    err = channel_error(conn, lambda ch: ch.exchange_declare("amq.spillway-test", "direct"), 403)
    assert "ACCESS_REFUSED" in err.reply_text


def test_declare_queue_with_reserved_amq_prefix_403(conn):
    channel_error(conn, lambda ch: ch.queue_declare("amq.spillway-test"), 403)


def test_delete_predeclared_exchange_403(conn):
    channel_error(conn, lambda ch: ch.exchange_delete("amq.direct"), 403)


def test_publish_to_missing_exchange_404(conn, names):
    def publish(ch):
        ch.basic_publish(names.exchange(), "k", b"x")
    err = channel_error(conn, publish, 404)
    assert "NOT_FOUND" in err.reply_text


def test_publish_to_missing_exchange_404_with_confirms(conn, names):
    def publish(ch):
        ch.confirm_delivery()
        ch.basic_publish(names.exchange(), "k", b"x")
    channel_error(conn, publish, 404)


def test_bind_missing_queue_or_exchange_404(conn, names):
    q, x = names.queue(), names.exchange()
    conn.channel().queue_declare(q)
    conn.channel().exchange_declare(x, "direct")
    channel_error(conn, lambda ch: ch.queue_bind(q, names.exchange(), "k"), 404)
    channel_error(conn, lambda ch: ch.queue_bind(names.queue(), x, "k"), 404)


def test_consume_missing_queue_404(conn, names):
    channel_error(conn, lambda ch: ch.basic_consume(names.queue(), lambda *a: None), 404)


def test_exclusive_queue_of_other_connection_405(broker, conn, names):
    q = names.queue()
    owner = broker.connect()
    try:
        owner.channel().queue_declare(q, exclusive=True)
        err = channel_error(conn, lambda ch: ch.basic_consume(q, lambda *a: None), 405)
        assert "RESOURCE_LOCKED" in err.reply_text
        channel_error(conn, lambda ch: ch.queue_declare(q, passive=True), 405)
        channel_error(conn, lambda ch: ch.queue_declare(q, exclusive=True), 405)
        channel_error(conn, lambda ch: ch.queue_delete(q), 405)
        # The owner can still use it.
        och = owner.channel()
        och.basic_publish("", q, b"mine")
        assert [b for _, _, b in drain(och, q, n=1)] == [b"mine"]
    finally:
        owner.close()


def test_ack_unknown_delivery_tag_406(conn, names):
    err = channel_error(conn, lambda ch: ch.basic_ack(99), 406)
    assert "PRECONDITION_FAILED" in err.reply_text
    assert "unknown delivery tag" in err.reply_text


def test_double_ack_406(conn, names):
    q = names.queue()
    ch0 = conn.channel()
    ch0.queue_declare(q)
    ch0.basic_publish("", q, b"x")

    def twice(ch):
        [(m, _, _)] = drain(ch, q, n=1, ack=False)
        ch.basic_ack(m.delivery_tag)
        ch.basic_ack(m.delivery_tag)
    channel_error(conn, twice, 406)


def test_reject_unknown_delivery_tag_406(conn):
    channel_error(conn, lambda ch: ch.basic_reject(7, requeue=True), 406)


def test_delete_exchange_if_unused_406(conn, names):
    x, q = names.exchange(), names.queue()
    ch = conn.channel()
    ch.exchange_declare(x, "fanout")
    ch.queue_declare(q)
    ch.queue_bind(q, x)
    channel_error(conn, lambda c: c.exchange_delete(x, if_unused=True), 406)
    ch.queue_unbind(q, x)
    ch.exchange_delete(x, if_unused=True)


def test_invalid_exchange_type_503_closes_connection(broker):
    c = broker.connect()
    ch = c.channel()
    with pytest.raises(pe.ConnectionClosedByBroker) as e:
        ch.exchange_declare("pytest.badtype", "no-such-type")
    assert e.value.reply_code == 503
    assert "COMMAND_INVALID" in e.value.reply_text
    assert c.is_closed


def test_reused_consumer_tag_530_closes_connection(broker):
    # pika refuses a duplicate tag itself, so speak raw AMQP.
    from pika import spec
    from raw_amqp import BrokerClosed, RawAMQP
    client = RawAMQP(broker.host, broker.port)
    try:
        q = client.declare_queue("", exclusive=True).queue
        client.send_method(1, spec.Basic.Consume(queue=q, consumer_tag="dup"))
        client.expect(1, spec.Basic.ConsumeOk)
        client.send_method(1, spec.Basic.Consume(queue=q, consumer_tag="dup"))
        with pytest.raises(BrokerClosed) as e:
            client.expect(1, spec.Basic.ConsumeOk)
        assert isinstance(e.value.method, spec.Connection.Close)
        assert e.value.reply_code == 530
    finally:
        client.sock.close()


def test_unknown_vhost_530(broker):
    with pytest.raises(pe.AMQPConnectionError) as e:
        broker.connect(virtual_host="pytest-no-such-vhost")
    assert isinstance(e.value, (pe.ProbableAccessDeniedError, pe.ConnectionClosedByBroker)), \
        repr(e.value)
    assert "530" in repr(e.value) and "NOT_ALLOWED" in repr(e.value)


def test_wrong_password_403(broker):
    with pytest.raises(pe.AMQPConnectionError) as e:
        broker.connect(credentials=pika.PlainCredentials("guest", "wrong-password"))
    assert isinstance(e.value, (pe.ProbableAuthenticationError, pe.AuthenticationError)), \
        repr(e.value)
    assert "403" in repr(e.value) and "ACCESS_REFUSED" in repr(e.value)
    # RabbitMQ's words: the reason is in the broker's log, not told to the client.
    assert "Login was refused using authentication mechanism PLAIN" in repr(e.value)


def test_unknown_user_403(broker):
    with pytest.raises((pe.ProbableAuthenticationError, pe.AuthenticationError)) as e:
        broker.connect(credentials=pika.PlainCredentials("nobody-here", "guest"))
    assert "403" in repr(e.value)
    # The same words as a wrong password: no way to tell which names exist.
    assert "Login was refused using authentication mechanism PLAIN" in repr(e.value)


def test_use_after_channel_error_is_refused_client_side(conn, names):
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker):
        ch.queue_declare(names.queue(), passive=True)
    with pytest.raises(pe.ChannelWrongStateError):
        ch.basic_publish("", "x", b"y")
