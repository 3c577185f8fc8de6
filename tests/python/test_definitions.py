"""Definitions export and import (``/api/definitions``), RabbitMQ's way of moving a
topology from one broker to another in one call.

Runs against Spillway's all-in-one broker and, under ``with-rabbitmq.sh``, against
RabbitMQ 3.10 with its management plugin: a topology exported and imported back is the
same on both. ``data/rabbitmq-3.10-definitions.json`` is an export made by RabbitMQ
3.10.8 itself (by ``test_the_rabbitmq_export_is_rabbitmqs_own`` with
``SPILLWAY_WRITE_RABBITMQ_EXPORT=1`` under ``with-rabbitmq.sh``; the same test checks it
still matches when run there), and Spillway imports it into the same topology, its user
logging in with the password RabbitMQ hashed."""

from __future__ import annotations

import json
import os
import pathlib

import pika
import pytest

from spillway_testlib import SpillwayBroker, uniq
from test_http_api import Http, q

RABBITMQ_EXPORT = pathlib.Path(__file__).parent / "data" / "rabbitmq-3.10-definitions.json"
# The topology of the RabbitMQ export, and its user's password.
EXPORT_VHOST = "rabbit-export"
EXPORT_USER = "rabbit-export-app"
EXPORT_PASSWORD = "exported-by-rabbitmq"

# What a definitions file lists per vhost.
VHOST_KEYS = ("queues", "exchanges", "bindings", "policies", "parameters", "permissions")


@pytest.fixture
def http(broker):
    return Http(broker)


def declare_topology(http: Http, vhost: str, user: str, password: str) -> None:
    """One of each thing a definitions file holds, made over HTTP."""
    v = q(vhost)
    for path, body in [
        (f"/api/vhosts/{v}", {}),
        (f"/api/users/{q(user)}", {"password": password, "tags": "management"}),
        (f"/api/permissions/{v}/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"}),
        (f"/api/exchanges/{v}/events", {"type": "topic", "durable": True}),
        (f"/api/exchanges/{v}/audit", {"type": "fanout", "durable": True}),
        (f"/api/queues/{v}/orders", {"durable": True, "arguments": {
            "x-max-priority": 5, "x-dead-letter-exchange": "audit"}}),
        (f"/api/queues/{v}/audit-log", {"durable": True, "arguments": {}}),
        (f"/api/policies/{v}/orders-ttl", {"pattern": "^orders$", "apply-to": "queues",
                                           "definition": {"message-ttl": 60000}, "priority": 1}),
        (f"/api/operator-policies/{v}/cap", {"pattern": ".*", "apply-to": "queues",
                                             "definition": {"max-length": 100000}, "priority": 0}),
    ]:
        response = http.call("PUT", path, json=body)
        assert response.status_code in (201, 204), (path, response.status_code, response.text)
    for path, key in [
        (f"/api/bindings/{v}/e/events/q/orders", "order.*"),
        (f"/api/bindings/{v}/e/events/e/audit", "#"),
        (f"/api/bindings/{v}/e/audit/q/audit-log", ""),
    ]:
        response = http.call("POST", path, json={"routing_key": key, "arguments": {}})
        assert response.status_code == 201, (path, response.status_code, response.text)


def of_vhost(definitions: dict, vhost: str, user: str) -> dict:
    """What of ``definitions`` belongs to the vhost and the user, each list sorted, the
    user without its salted hash (the same password hashes differently each time)."""
    chosen = {key: sorted((item for item in definitions.get(key, []) if item.get("vhost") == vhost),
                          key=lambda item: json.dumps(item, sort_keys=True))
              for key in VHOST_KEYS}
    chosen["vhosts"] = [v for v in definitions.get("vhosts", []) if v["name"] == vhost]
    chosen["users"] = [{k: v for k, v in u.items() if k != "password_hash"}
                       for u in definitions.get("users", []) if u["name"] == user]
    # RabbitMQ 3.10 writes vhosts with their metadata; only the name moves.
    chosen["vhosts"] = [{"name": v["name"]} for v in chosen["vhosts"]]
    return chosen


def subset(definitions: dict, vhost: str, user: str) -> dict:
    """An importable definitions file of the vhost and the user only."""
    chosen = {key: [item for item in definitions.get(key, []) if item.get("vhost") == vhost]
              for key in VHOST_KEYS}
    chosen["vhosts"] = [v for v in definitions.get("vhosts", []) if v["name"] == vhost]
    chosen["users"] = [u for u in definitions.get("users", []) if u["name"] == user]
    return chosen


def routes_as_user(broker, vhost: str, user: str, password: str) -> None:
    """The user logs in with its password and a message takes the topology's route."""
    conn = broker.connect(credentials=pika.PlainCredentials(user, password), virtual_host=vhost)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("events", "order.created", b"order 1",
                         pika.BasicProperties(delivery_mode=2), mandatory=True)
        method, _, body = ch.basic_get("orders", auto_ack=True)
        assert method is not None and body == b"order 1"
        # events -> audit (exchange to exchange) -> audit-log
        method, _, body = ch.basic_get("audit-log", auto_ack=True)
        assert method is not None and body == b"order 1"
    finally:
        conn.close()


def delete(http: Http, vhost: str, user: str) -> None:
    for path in (f"/api/vhosts/{q(vhost)}", f"/api/users/{q(user)}"):
        http.call("DELETE", path)


def test_a_topology_exported_and_imported_back_is_the_same(http, broker):
    vhost, user = uniq("defs"), uniq("defs-user")
    try:
        declare_topology(http, vhost, user, "pw-1")
        exported = http.get("/api/definitions")
        before = of_vhost(exported, vhost, user)
        assert before["users"] and before["users"][0]["tags"] == ["management"], before
        assert len(before["queues"]) == 2 and len(before["bindings"]) == 3, before
        delete(http, vhost, user)
        response = http.call("POST", "/api/definitions", json=subset(exported, vhost, user))
        assert response.status_code in (201, 204), (response.status_code, response.text)
        assert of_vhost(http.get("/api/definitions"), vhost, user) == before
        # The password hash moved with the user.
        routes_as_user(broker, vhost, user, "pw-1")
    finally:
        delete(http, vhost, user)


def test_one_vhosts_definitions_go_into_another_vhost(http):
    source, target, user = uniq("defs-from"), uniq("defs-to"), uniq("defs-user")
    try:
        declare_topology(http, source, user, "pw-2")
        one = http.get(f"/api/definitions/{q(source)}")
        assert "users" not in one and "vhost" not in one["queues"][0], one
        assert http.call("PUT", f"/api/vhosts/{q(target)}", json={}).status_code == 201
        response = http.call("POST", f"/api/definitions/{q(target)}", json=one)
        assert response.status_code in (201, 204), (response.status_code, response.text)
        queue = http.get(f"/api/queues/{q(target)}/orders")
        assert queue["arguments"] == {"x-max-priority": 5, "x-dead-letter-exchange": "audit"}
        moved = http.get(f"/api/definitions/{q(target)}")
        assert [p["name"] for p in moved["policies"]] == ["orders-ttl"], moved
        assert len(moved["bindings"]) == 3, moved
    finally:
        delete(http, source, user)
        delete(http, target, user)


@pytest.mark.spillway_only
def test_an_import_with_one_refused_item_changes_nothing(http):
    """RabbitMQ applies an import item by item and stops at the first refusal, leaving
    what came before; Spillway applies all of it or nothing."""
    vhost, user = uniq("defs"), uniq("defs-user")
    try:
        declare_topology(http, vhost, user, "pw-3")
        new_vhost = uniq("defs-new")
        body = {
            "vhosts": [{"name": new_vhost}],
            "users": [{"name": uniq("defs-new-user"), "password_hash": "", "tags": []}],
            "queues": [{"name": "fresh", "vhost": new_vhost, "durable": True, "arguments": {}},
                       {"name": "orders", "vhost": vhost, "durable": True,
                        "arguments": {"x-max-priority": 9, "x-dead-letter-exchange": "audit"}}],
        }
        response = http.call("POST", "/api/definitions", json=body)
        assert response.status_code == 400, response.text
        assert "inequivalent arg 'x-max-priority'" in response.json()["reason"]
        assert http.call("GET", f"/api/vhosts/{q(new_vhost)}").status_code == 404
        assert http.call("GET", f"/api/users/{q(body['users'][0]['name'])}").status_code == 404
    finally:
        delete(http, vhost, user)


def test_the_rabbitmq_export_is_rabbitmqs_own(http, broker):
    """Run under with-rabbitmq.sh: the committed export is what RabbitMQ 3.10 exports for
    the topology (remade with SPILLWAY_WRITE_RABBITMQ_EXPORT=1)."""
    if isinstance(broker, SpillwayBroker):
        pytest.skip("checks the committed export against a real RabbitMQ")
    delete(http, EXPORT_VHOST, EXPORT_USER)
    try:
        declare_topology(http, EXPORT_VHOST, EXPORT_USER, EXPORT_PASSWORD)
        exported = http.get("/api/definitions")
        made = subset(exported, EXPORT_VHOST, EXPORT_USER)
        made["rabbit_version"] = exported["rabbit_version"]
        if os.environ.get("SPILLWAY_WRITE_RABBITMQ_EXPORT"):
            RABBITMQ_EXPORT.parent.mkdir(exist_ok=True)
            RABBITMQ_EXPORT.write_text(json.dumps(made, indent=2, sort_keys=True) + "\n")
        committed = json.loads(RABBITMQ_EXPORT.read_text())
        assert committed["rabbit_version"].startswith("3.10")
        assert of_vhost(made, EXPORT_VHOST, EXPORT_USER) == \
            of_vhost(committed, EXPORT_VHOST, EXPORT_USER)
    finally:
        delete(http, EXPORT_VHOST, EXPORT_USER)


def test_a_rabbitmq_export_imports_into_the_same_topology(http, broker):
    if not isinstance(broker, SpillwayBroker):
        pytest.skip("imports RabbitMQ's export into Spillway")
    committed = json.loads(RABBITMQ_EXPORT.read_text())
    delete(http, EXPORT_VHOST, EXPORT_USER)
    try:
        response = http.call("POST", "/api/definitions", json=committed)
        assert response.status_code in (201, 204), (response.status_code, response.text)
        ours = of_vhost(http.get("/api/definitions"), EXPORT_VHOST, EXPORT_USER)
        theirs = of_vhost(committed, EXPORT_VHOST, EXPORT_USER)
        for key in ("vhosts", "queues", "exchanges", "bindings", "policies", "parameters",
                    "permissions"):
            assert ours[key] == theirs[key], key
        assert ours["users"][0]["tags"] == theirs["users"][0]["tags"]
        # RabbitMQ's salted SHA-256 hash of the password is Spillway's.
        routes_as_user(broker, EXPORT_VHOST, EXPORT_USER, EXPORT_PASSWORD)
    finally:
        delete(http, EXPORT_VHOST, EXPORT_USER)
