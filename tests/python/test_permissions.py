"""Users and permissions seen by pika: a user made with spillctl and limited to ``^app\\.``
gets RabbitMQ's 403 for what lies outside its patterns, and 530 for a vhost it has no
permission in.

Spillway only: RabbitMQ's users are made with rabbitmqctl, not spillctl. The all-in-one
broker only: the suite's separate wiring runs no management process."""

import uuid

import pika
import pika.exceptions as pe
import pytest

from spillway_testlib import SpillwayBroker, spillctl

pytestmark = pytest.mark.spillway_only


@pytest.fixture
def limited_user(broker):
    if not isinstance(broker, SpillwayBroker) or broker.wiring != "all-in-one":
        pytest.skip("needs the all-in-one broker's management port")
    name = f"app-{uuid.uuid4().hex[:8]}"
    spillctl(broker, "user", "add", name, "app-secret")
    spillctl(broker, "permissions", "set", name,
             "--configure", r"^app\.", "--write", r"^app\.", "--read", r"^app\.")
    yield name
    spillctl(broker, "user", "delete", name)


def connect_as(broker, user, password, vhost="/"):
    return broker.connect(credentials=pika.PlainCredentials(user, password), virtual_host=vhost)


def test_a_limited_user_gets_403_outside_its_patterns(broker, limited_user):
    conn = connect_as(broker, limited_user, "app-secret")
    try:
        ch = conn.channel()
        own = f"app.{uuid.uuid4().hex[:8]}"
        ch.queue_declare(own, auto_delete=True)
        ch.basic_publish("amq.topic", own, b"x")  # refused: amq.topic is not ^app\.
        with pytest.raises(pe.ChannelClosedByBroker) as e:
            ch.queue_declare("", exclusive=True)
        assert e.value.reply_code == 403, e.value
        assert e.value.reply_text == (
            f"ACCESS_REFUSED - access to exchange 'amq.topic' in vhost '/' "
            f"refused for user '{limited_user}'")

        ch = conn.channel()
        with pytest.raises(pe.ChannelClosedByBroker) as e:
            ch.queue_declare(f"other.{uuid.uuid4().hex[:8]}")
        assert e.value.reply_code == 403
        assert "access to queue 'other." in e.value.reply_text

        ch = conn.channel()
        with pytest.raises(pe.ChannelClosedByBroker) as e:
            ch.basic_consume("pytest-not-app", lambda *a: None)
        assert e.value.reply_code == 403
    finally:
        if conn.is_open:
            conn.close()


def test_a_vhost_without_permissions_is_refused_with_530(broker, limited_user):
    vhost = f"pytest-{uuid.uuid4().hex[:8]}"
    spillctl(broker, "vhost", "create", vhost)
    try:
        with pytest.raises(pe.AMQPConnectionError) as e:
            connect_as(broker, limited_user, "app-secret", vhost)
        # pika's name for it, as with RabbitMQ: a probable denial of access.
        assert isinstance(e.value, pe.ProbableAccessDeniedError), repr(e.value)
        text = repr(e.value)
        assert "530" in text and "NOT_ALLOWED - access to vhost" in text, text
        assert vhost in text and "refused for user" in text and limited_user in text, text
    finally:
        spillctl(broker, "vhost", "delete", vhost)
