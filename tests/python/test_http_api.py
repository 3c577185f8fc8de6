"""RabbitMQ's management HTTP API, as the tools that call it use it: plain ``requests``
the way rabbitmqadmin, Flower and KEDA send them, and ``pyrabbit2``, a maintained
client library of the API.

Runs against Spillway's all-in-one broker (``management.http_listen``; the suite's
separate wiring runs no management process) and, under ``with-rabbitmq.sh``, against
RabbitMQ 3.10 with its management plugin (``SPILLWAY_TEST_HTTP_URL``): the same
assertions hold for both, which is what keeps Spillway's JSON in RabbitMQ's shapes.
RabbitMQ's figures lag (its statistics are emitted every few seconds), so figures are
waited for with a deadline."""

from __future__ import annotations

import os
import urllib.parse

import pika
import pytest
import requests

from spillway_testlib import SpillwayBroker, uniq, wait_until

# RabbitMQ's management statistics arrive up to 5 s late.
FIGURES = 30.0


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Http:
    """The HTTP API of the broker under test, as guest."""

    def __init__(self, broker):
        if isinstance(broker, SpillwayBroker):
            if broker.wiring != "all-in-one":
                pytest.skip("needs the all-in-one broker's management HTTP port")
            self.base = f"http://{broker.procs['all-in-one'].address('http')}"
        elif os.environ.get("SPILLWAY_TEST_HTTP_URL"):
            self.base = os.environ["SPILLWAY_TEST_HTTP_URL"].rstrip("/")
        else:
            pytest.skip("no management HTTP URL for this external broker")
        self.auth = ("guest", "guest")

    def call(self, method, path, auth=None, **kw):
        kw.setdefault("timeout", 30)
        return requests.request(method, self.base + path, auth=auth or self.auth, **kw)

    def get(self, path, **kw):
        response = self.call("GET", path, **kw)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()


@pytest.fixture
def http(broker):
    return Http(broker)


@pytest.fixture
def made(http):
    """Objects a test made over HTTP, deleted after it."""
    paths = []
    yield paths
    for path in reversed(paths):
        http.call("DELETE", path)


def test_whoami_overview_and_nodes_answer_in_rabbitmqs_shapes(http):
    me = http.get("/api/whoami")
    assert me["name"] == "guest"
    assert "administrator" in me["tags"]
    overview = http.get("/api/overview")
    for key in ("rabbitmq_version", "management_version", "node", "cluster_name"):
        assert isinstance(overview[key], str) and overview[key], key
    for key in ("connections", "channels", "queues", "exchanges", "consumers"):
        assert isinstance(overview["object_totals"][key], int), key
    assert any(listener["protocol"] == "amqp" for listener in overview["listeners"])
    nodes = http.get("/api/nodes")
    assert [node["name"] for node in nodes] == [overview["node"]]
    assert nodes[0]["running"] is True
    assert http.get("/api/aliveness-test/%2F") == {"status": "ok"}
    assert http.get("/api/health/checks/alarms") == {"status": "ok"}
    assert http.get("/api/health/checks/local-alarms") == {"status": "ok"}


def test_wrong_or_missing_credentials_get_401(http):
    for auth in [("guest", "wrong"), ("nobody", "guest")]:
        response = http.call("GET", "/api/overview", auth=auth)
        assert response.status_code == 401, response.text
        assert response.json()["error"] == "not_authorized"
    response = requests.get(http.base + "/api/queues", timeout=30)
    assert response.status_code == 401


@pytest.mark.spillway_only
def test_a_refused_login_carries_no_basic_challenge_for_a_browser_to_cache(http):
    # RabbitMQ 3.10 sends `WWW-Authenticate: Basic`: the browser then asks
    # with its own dialog and sends what it was given with every request
    # to the port, other sites' forms included.
    for auth in [("guest", "wrong"), None]:
        response = requests.get(http.base + "/api/overview", auth=auth, timeout=30,
                                headers={"accept": "text/html"})
        assert response.status_code == 401, response.text
        assert "basic" not in response.headers.get("www-authenticate", "").lower()


def origin_of(http) -> str:
    return http.base  # scheme://host:port, as a browser writes its Origin


@pytest.mark.spillway_only
def test_another_sites_form_creates_nothing(http, made):
    """A form on another site posts text/plain (no preflight) with the
    administrator's cached credentials: refused, and nothing is made."""
    queue = uniq("csrf.q")
    qpath = f"/api/queues/%2F/{q(queue)}"
    assert http.call("PUT", qpath, json={"durable": False}).status_code == 201
    made.append(qpath)
    binding = f"/api/bindings/%2F/e/amq.direct/q/{q(queue)}"
    form = '{"routing_key": "stolen", "x": "="}'
    for headers, expected in [
        ({"content-type": "text/plain"}, 415),
        ({"content-type": "application/x-www-form-urlencoded"}, 415),
        ({"content-type": "multipart/form-data; boundary=x"}, 415),
        ({"content-type": "text/plain", "origin": "http://evil.example"}, 403),
        ({"content-type": "application/json", "origin": "http://evil.example"}, 403),
        ({"content-type": "application/json", "origin": "null"}, 403),
        ({"content-type": "application/json", "sec-fetch-site": "cross-site"}, 403),
        ({"content-type": "application/json", "sec-fetch-site": "same-site"}, 403),
        # A browser's fetch can send a body without a type and without asking.
        ({"origin": origin_of(http)}, 415),
    ]:
        response = http.call("POST", binding, data=form, headers=headers)
        assert response.status_code == expected, (headers, response.text)
        assert response.json()["reason"], response.text
    assert all(b["routing_key"] != "stolen" for b in http.get(f"{qpath}/bindings"))

    # An administrator through /api/definitions, the issue's worst case.
    user = uniq("csrf.admin")
    definitions = ('{"users": [{"name": "%s", "password_hash": '
                   '"kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR", '
                   '"hashing_algorithm": "rabbit_password_hashing_sha256", '
                   '"tags": "administrator"}]}' % user)
    for headers in [{"content-type": "text/plain"},
                    {"content-type": "text/plain", "origin": "null"},
                    {"content-type": "application/json", "origin": "http://evil.example"}]:
        response = http.call("POST", "/api/definitions", data=definitions, headers=headers)
        assert response.status_code in (403, 415), (headers, response.text)
    assert http.call("GET", f"/api/users/{q(user)}").status_code == 404

    # Reading the API from another page is refused too; the console's page
    # may still be opened from a link on another site.
    response = http.call("GET", "/api/overview", headers={"origin": "http://evil.example"})
    assert response.status_code == 403
    response = http.call("GET", "/api/overview", headers={"sec-fetch-site": "cross-site"})
    assert response.status_code == 403
    response = requests.get(http.base + "/", headers={"sec-fetch-site": "cross-site"},
                            timeout=30)
    assert response.status_code == 200


@pytest.mark.spillway_only
def test_the_consoles_own_requests_and_tools_without_an_origin_still_work(http, made):
    queue = uniq("same.q")
    qpath = f"/api/queues/%2F/{q(queue)}"
    # What the console's fetch() sends: its origin, same-origin.
    response = http.call("PUT", qpath, json={"durable": False},
                         headers={"origin": origin_of(http), "sec-fetch-site": "same-origin"})
    assert response.status_code == 201, response.text
    made.append(qpath)
    response = http.call("POST", f"/api/bindings/%2F/e/amq.direct/q/{q(queue)}",
                         data='{"routing_key": "mine"}',
                         headers={"origin": origin_of(http),
                                  "content-type": "application/json; charset=utf-8"})
    assert response.status_code == 201, response.text
    assert http.get("/api/overview", headers={"sec-fetch-site": "same-origin"})["node"]
    # A tool: no origin, no body, no content type.
    assert http.call("DELETE", f"{qpath}/contents").status_code == 204


def test_unknown_objects_get_404(http):
    for path in [f"/api/queues/%2F/{uniq('gone')}", f"/api/exchanges/%2F/{uniq('gone')}",
                 "/api/vhosts/" + uniq("gone")]:
        response = http.call("GET", path)
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"] == "Object Not Found"


def test_a_queue_declared_over_http_takes_messages_shows_its_depth_and_is_purged(
        http, broker, made):
    name = uniq("http.q")
    path = f"/api/queues/%2F/{q(name)}"
    body = {"durable": True, "auto_delete": False, "arguments": {"x-max-length": 100}}
    assert http.call("PUT", path, json=body).status_code == 201
    made.append(path)
    assert http.call("PUT", path, json=body).status_code == 204
    queue = http.get(path)
    assert (queue["name"], queue["vhost"], queue["durable"]) == (name, "/", True)
    assert queue["arguments"] == {"x-max-length": 100}
    assert queue["auto_delete"] is False and queue["exclusive"] is False

    with broker.connect() as conn:
        ch = conn.channel()
        for i in range(3):
            ch.basic_publish("", name, f"m{i}".encode())
        assert wait_until(lambda: http.get(path).get("messages_ready") == 3, FIGURES), \
            http.get(path)
        queue = http.get(path)
        assert queue["messages"] == 3 and queue["messages_unacknowledged"] == 0
        assert queue["consumers"] == 0

        # A look at the head leaves the messages where they are.
        peek = http.call("POST", path + "/get", json={
            "count": 2, "ackmode": "ack_requeue_true", "encoding": "auto", "truncate": 50000})
        assert peek.status_code == 200, peek.text
        assert [m["payload"] for m in peek.json()] == ["m0", "m1"]
        assert all(m["routing_key"] == name and m["payload_encoding"] == "string"
                   for m in peek.json())
        assert ch.queue_declare(name, passive=True).method.message_count == 3

        assert http.call("DELETE", path + "/contents").status_code == 204
        assert ch.queue_declare(name, passive=True).method.message_count == 0

    assert http.call("DELETE", path).status_code == 204
    assert http.call("GET", path).status_code == 404


def test_queue_declaration_errors_are_400(http, made):
    name = uniq("http.q")
    path = f"/api/queues/%2F/{q(name)}"
    assert http.call("PUT", path, json={"durable": True}).status_code == 201
    made.append(path)
    # Inequivalent arguments, as over AMQP.
    refused = http.call("PUT", path, json={"durable": False})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == "bad_request"
    refused = http.call("PUT", path, data=b"{not json", headers={"content-type": "application/json"})
    assert refused.status_code == 400


def test_lists_page_and_filter_as_keda_and_flower_ask(http, made):
    prefix = uniq("page")
    for i in range(12):
        path = f"/api/queues/%2F/{q(f'{prefix}.{i:02}')}"
        assert http.call("PUT", path, json={"durable": False}).status_code == 201
        made.append(path)
    page = http.get("/api/queues/%2F", params={
        "page": 2, "page_size": 5, "name": prefix, "use_regex": "false"})
    assert page["filtered_count"] == 12
    assert page["page_count"] == 3 and page["page"] == 2 and page["page_size"] == 5
    assert [item["name"] for item in page["items"]] == [f"{prefix}.{i:02}" for i in range(5, 10)]
    # KEDA's regex mode.
    regex = http.get("/api/queues/%2F", params={
        "page": 1, "use_regex": "true", "pagination": "false",
        "name": "^" + prefix.replace(".", "\\.") + r"\.0[0-4]$", "page_size": 100})
    assert sorted(item["name"] for item in regex["items"]) == \
        [f"{prefix}.{i:02}" for i in range(5)]
    assert regex["page_count"] == 1
    refused = http.call("GET", "/api/queues/%2F", params={"page": 1, "page_size": 501})
    assert refused.status_code == 400
    # Sorted by a figure, descending.
    listed = http.get("/api/queues/%2F", params={"sort": "name", "sort_reverse": "true"})
    names = [item["name"] for item in listed if item["name"].startswith(prefix)]
    assert names == sorted(names, reverse=True)


def test_exchanges_and_bindings_made_over_http_route_messages(http, broker, made):
    exchange, queue = uniq("http.x"), uniq("http.q")
    xpath, qpath = f"/api/exchanges/%2F/{q(exchange)}", f"/api/queues/%2F/{q(queue)}"
    assert http.call("PUT", xpath, json={"type": "topic", "durable": True}).status_code == 201
    made.append(xpath)
    assert http.call("PUT", qpath, json={"durable": False}).status_code == 201
    made.append(qpath)
    got = http.get(xpath)
    assert (got["name"], got["type"], got["durable"], got["internal"]) == \
        (exchange, "topic", True, False)
    between = f"/api/bindings/%2F/e/{q(exchange)}/q/{q(queue)}"
    created = http.call("POST", between, json={"routing_key": "orders.*", "arguments": {}})
    assert created.status_code == 201, created.text
    [binding] = http.get(between)
    assert (binding["source"], binding["destination"], binding["destination_type"],
            binding["routing_key"]) == (exchange, queue, "queue", "orders.*")
    props = binding["properties_key"]
    assert props == "orders.%2A"
    # Where the new binding is, relative to the list: its properties key, quoted.
    assert created.headers["location"].endswith(f"{q(queue)}/{q(props)}")
    assert http.get(f"{between}/{q(props)}")["routing_key"] == "orders.*"
    assert any(b["source"] == exchange for b in http.get(f"{qpath}/bindings"))
    assert [b["destination"] for b in http.get(f"{xpath}/bindings/source")] == [queue]

    with broker.connect() as conn:
        ch = conn.channel()
        ch.basic_publish(exchange, "orders.new", b"routed")
        ch.basic_publish(exchange, "other.new", b"not routed")
        assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == 1,
                          10, conn)
        assert http.call("DELETE", f"{between}/{q(props)}").status_code == 204
        assert http.get(between) == []
        ch.basic_publish(exchange, "orders.new", b"unbound")
        assert ch.queue_declare(queue, passive=True).method.message_count == 1
    # The default exchange is amq.default in URLs.
    assert http.get("/api/exchanges/%2F/amq.default")["type"] == "direct"


def test_users_vhosts_and_permissions_decide_what_a_user_sees(http, made):
    vhost, user = uniq("http.v"), uniq("http.u")
    vpath, upath = f"/api/vhosts/{q(vhost)}", f"/api/users/{q(user)}"
    assert http.call("PUT", vpath).status_code == 201
    made.append(vpath)
    assert http.call("PUT", vpath).status_code == 204
    assert http.call("PUT", upath, json={"password": "s3cret", "tags": "management"}) \
        .status_code == 201
    made.append(upath)
    assert http.get(upath)["tags"] == ["management"]
    ppath = f"/api/permissions/{q(vhost)}/{q(user)}"
    assert http.call("PUT", ppath, json={"configure": ".*", "write": ".*", "read": ".*"}) \
        .status_code == 201
    assert http.get(ppath)["configure"] == ".*"
    assert any(p["user"] == user for p in http.get(f"{vpath}/permissions"))

    as_user = (user, "s3cret")
    me = http.call("GET", "/api/whoami", auth=as_user).json()
    assert me["name"] == user and me["tags"] == ["management"]
    seen = [v["name"] for v in http.call("GET", "/api/vhosts", auth=as_user).json()]
    assert seen == [vhost]
    qpath = f"/api/queues/{q(vhost)}/{q(uniq('mine'))}"
    assert http.call("PUT", qpath, auth=as_user, json={"durable": False}).status_code == 201
    # Nothing in the default vhost, nothing of the administrator's.
    assert http.call("GET", "/api/queues/%2F", auth=as_user).status_code == 401
    assert http.call("GET", "/api/users", auth=as_user).status_code == 401
    assert http.call("PUT", "/api/vhosts/" + q(uniq("v")), auth=as_user).status_code == 401

    assert http.call("DELETE", ppath).status_code == 204
    assert http.call("GET", ppath).status_code == 404
    assert http.call("GET", qpath, auth=as_user).status_code == 401


def test_a_connection_is_listed_and_closed_over_http(http, broker):
    name = uniq("conn")
    conn = broker.connect(client_properties={"connection_name": name})
    try:
        conn.channel()

        def listed():
            return [c for c in http.get("/api/connections")
                    if c["client_properties"].get("connection_name") == name]
        found = wait_until(listed, FIGURES, conn)
        assert found, http.get("/api/connections")
        [connection] = found
        assert connection["user"] == "guest" and connection["vhost"] == "/"
        assert connection["protocol"].startswith("AMQP 0-9-1")
        assert wait_until(lambda: http.get(
            f"/api/connections/{q(connection['name'])}")["channels"] == 1, FIGURES, conn)
        channels = [c for c in http.get("/api/channels")
                    if c["connection_details"]["name"] == connection["name"]]
        assert wait_until(lambda: [c for c in http.get("/api/channels")
                                   if c["connection_details"]["name"] == connection["name"]],
                          FIGURES, conn), channels
        closed = http.call("DELETE", f"/api/connections/{q(connection['name'])}",
                           headers={"X-Reason": "closed by the test"})
        assert closed.status_code == 204
        with pytest.raises(pika.exceptions.ConnectionClosed) as info:
            wait_until(lambda: False, 10, conn)
            conn.channel()
        assert "closed by the test" in str(info.value) or info.value.reply_code == 320
    finally:
        if conn.is_open:
            conn.close()


def test_policies_set_over_http_apply_to_queues(http, broker, made):
    name = uniq("http.p")
    queue = name + ".q"
    ppath = f"/api/policies/%2F/{q(name)}"
    body = {"pattern": "^" + name.replace(".", "\\.") + r"\.", "apply-to": "queues",
            "definition": {"max-length": 2}, "priority": 5}
    assert http.call("PUT", ppath, json=body).status_code == 201
    made.append(ppath)
    policy = http.get(ppath)
    assert (policy["pattern"], policy["apply-to"], policy["definition"], policy["priority"]) == \
        (body["pattern"], "queues", {"max-length": 2}, 5)
    assert any(p["name"] == name for p in http.get("/api/policies"))
    with broker.connect() as conn:
        ch = conn.channel()
        ch.queue_declare(queue, auto_delete=True)
        for i in range(5):
            ch.basic_publish("", queue, b"x")
        assert wait_until(lambda: ch.queue_declare(queue, passive=True).method.message_count == 2,
                          10, conn)
        assert wait_until(lambda: http.get(f"/api/queues/%2F/{q(queue)}").get("policy") == name,
                          FIGURES, conn)
    refused = http.call("PUT", ppath, json={**body, "definition": {"max-priority": 3}})
    assert refused.status_code == 400


def test_pyrabbit2_drives_declare_list_get_purge_and_delete(http, broker):
    from pyrabbit2.api import Client

    client = Client(http.base.removeprefix("http://"), "guest", "guest", timeout=30)
    assert client.is_alive()
    assert client.get_whoami()["name"] == "guest"
    assert "/" in client.get_vhost_names()
    exchange, queue = uniq("pr.x"), uniq("pr.q")
    client.create_exchange("/", exchange, "direct")
    client.create_queue("/", queue, durable=False)

    def depth():
        # RabbitMQ has no figures for a queue before its first statistics.
        try:
            return client.get_queue_depth("/", queue)
        except KeyError:
            return None
    try:
        client.create_binding("/", exchange, queue, "key")
        assert [b["routing_key"] for b in client.get_queue_bindings("/", queue)
                if b["source"] == exchange] == ["key"]
        with broker.connect() as conn:
            ch = conn.channel()
            for i in range(4):
                ch.basic_publish(exchange, "key", f"p{i}".encode())
            assert wait_until(lambda: depth() == 4, FIGURES, conn)
        assert any(item["name"] == queue for item in client.get_queues("/"))
        assert [item["name"] for item in client.get_queues("/", pattern=queue)] == [queue]
        messages = client.get_messages("/", queue, count=2, requeue=True)
        assert [m["payload"] for m in messages] == ["p0", "p1"]
        client.purge_queue("/", queue)
        assert wait_until(lambda: depth() == 0, FIGURES)
        client.delete_binding("/", exchange, queue, "key")
        assert not [b for b in client.get_queue_bindings("/", queue) if b["source"] == exchange]
    finally:
        client.delete_queue("/", queue)
        client.delete_exchange("/", exchange)
    assert not any(item["name"] == queue for item in client.get_queues("/"))


def test_flower_broker_view_shows_the_queues_and_their_lengths(http, broker, made):
    """Celery Flower's broker page: its RabbitMQ broker client reads the queues of the
    broker URL's vhost from the HTTP API. (Flower asks for the default vhost as
    ``/api/queues//``, which RabbitMQ answers 404 too, so the test uses a vhost of its
    own, as a Celery deployment with Flower does.)"""
    import asyncio

    from flower.utils.broker import Broker

    vhost, queue = uniq("flower.v"), uniq("flower.q")
    assert http.call("PUT", f"/api/vhosts/{q(vhost)}").status_code == 201
    made.append(f"/api/vhosts/{q(vhost)}")
    # Its creator has every permission there already (RabbitMQ's rule too).
    assert http.get(f"/api/permissions/{q(vhost)}/guest")["configure"] == ".*"
    with broker.connect(virtual_host=vhost) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for i in range(3):
            ch.basic_publish("", queue, f"task-{i}".encode())
        api = http.base.replace("http://", "http://guest:guest@") + "/api/"
        flower = Broker(f"amqp://guest:guest@{broker.host}:{broker.port}/{vhost}", http_api=api)

        def seen():
            found = asyncio.run(flower.queues([queue]))
            return found if found and found[0].get("messages") == 3 else None
        found = wait_until(seen, FIGURES, conn)
        assert found, asyncio.run(flower.queues([queue]))
        [row] = found
        assert (row["name"], row["messages_ready"], row["messages_unacknowledged"],
                row["consumers"]) == (queue, 3, 0, 0)


def test_message_rates_show_publishing_and_delivering_as_keda_reads_them(http, broker, made):
    """KEDA's message-rate mode reads ``message_stats.publish_details.rate`` of one queue;
    Flower shows ``idle_since``."""
    import time

    name = uniq("rates.q")
    path = f"/api/queues/%2F/{q(name)}"
    assert http.call("PUT", path, json={"durable": False}).status_code == 201
    made.append(path)
    with broker.connect() as conn:
        ch = conn.channel()
        published = 0

        def publishing_rate():
            nonlocal published
            for _ in range(20):
                ch.basic_publish("", name, b"x")
                published += 1
            time.sleep(0.05)
            stats = http.get(path, params={"msg_rates_age": 60, "msg_rates_incr": 5}) \
                .get("message_stats") or {}
            return stats.get("publish_details", {}).get("rate", 0) > 0 and stats
        stats = wait_until(publishing_rate, FIGURES, conn)
        assert stats, http.get(path)
        assert 0 < stats["publish"] <= published

        def delivering_rate():
            got = ch.basic_get(name, auto_ack=True)
            assert got[0] is not None
            stats = http.get(path).get("message_stats") or {}
            return stats.get("deliver_get_details", {}).get("rate", 0) > 0 and stats
        assert wait_until(delivering_rate, FIGURES, conn), http.get(path)
    # The vhost and the overview sum them up.
    overview = http.get("/api/overview")
    assert overview["message_stats"]["publish"] >= stats["publish"]
    assert http.get("/api/vhosts/%2F")["message_stats"]["publish"] >= stats["publish"]


def test_a_message_published_over_http_reaches_a_pika_consumer_with_its_properties(
        http, broker, made):
    import base64

    from pyrabbit2.api import Client

    name = uniq("http.pub")
    path = f"/api/queues/%2F/{q(name)}"
    assert http.call("PUT", path, json={"durable": True}).status_code == 201
    made.append(path)
    publish = "/api/exchanges/%2F/amq.default/publish"
    answer = http.call("POST", publish, json={
        "routing_key": name, "payload": "hello", "payload_encoding": "string",
        "properties": {"content_type": "text/plain", "delivery_mode": 2, "priority": 3,
                       "message_id": "m-1", "correlation_id": "c-1", "reply_to": "back",
                       "type": "greeting", "app_id": "http", "timestamp": 1700000000,
                       "headers": {"tenant": "acme", "attempt": 2}}})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"routed": True}
    raw = base64.b64encode(bytes(range(256))).decode()
    answer = http.call("POST", publish, json={
        "routing_key": name, "payload": raw, "payload_encoding": "base64", "properties": {}})
    assert answer.json() == {"routed": True}
    nowhere = http.call("POST", publish, json={
        "routing_key": uniq("nowhere"), "payload": "x", "payload_encoding": "string",
        "properties": {}})
    assert nowhere.json() == {"routed": False}
    # A message may only claim its publisher's name, as over AMQP.
    refused = http.call("POST", publish, json={
        "routing_key": name, "payload": "x", "payload_encoding": "string",
        "properties": {"user_id": "someone-else"}})
    assert refused.status_code == 400, refused.text
    # pyrabbit2's publish.
    client = Client(http.base.removeprefix("http://"), "guest", "guest", timeout=30)
    assert client.publish("/", "amq.default", name, "from pyrabbit2") is True

    with broker.connect() as conn:
        ch = conn.channel()
        method, props, body = ch.basic_get(name, auto_ack=True)
        assert body == b"hello"
        assert (props.content_type, props.delivery_mode, props.priority, props.message_id,
                props.correlation_id, props.reply_to, props.type, props.app_id,
                props.timestamp) == ("text/plain", 2, 3, "m-1", "c-1", "back", "greeting",
                                     "http", 1700000000)
        assert props.headers == {"tenant": "acme", "attempt": 2}
        assert (method.exchange, method.routing_key) == ("", name)
        assert ch.basic_get(name, auto_ack=True)[2] == bytes(range(256))
        assert ch.basic_get(name, auto_ack=True)[2] == b"from pyrabbit2"
        assert ch.basic_get(name, auto_ack=True)[0] is None


def test_operator_policies_over_http(http, made):
    name = uniq("http.op")
    path = f"/api/operator-policies/%2F/{q(name)}"
    body = {"pattern": "^" + name.replace(".", "\\.") + r"\.", "apply-to": "queues",
            "definition": {"max-length": 3}, "priority": 1}
    assert http.call("PUT", path, json=body).status_code == 201
    made.append(path)
    assert http.call("PUT", path, json=body).status_code == 204
    assert http.get(path)["definition"] == {"max-length": 3}
    assert any(p["name"] == name for p in http.get("/api/operator-policies/%2F"))
    assert http.call("DELETE", path).status_code == 204
    assert http.call("GET", path).status_code == 404


def test_gets_that_take_messages_acknowledge_or_dead_letter_them(http, broker, made):
    """``ack_requeue_false`` takes messages away; ``reject_requeue_false`` takes them and
    rejects them, so they are dead-lettered as the queue says."""
    name, dead = uniq("http.take"), uniq("http.dead")
    for queue, arguments in ((dead, {}), (name, {"x-dead-letter-exchange": "",
                                                 "x-dead-letter-routing-key": dead})):
        path = f"/api/queues/%2F/{q(queue)}"
        body = {"durable": True, "arguments": arguments}
        assert http.call("PUT", path, json=body).status_code == 201
        made.append(path)
    with broker.connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(4):
            ch.basic_publish("", name, f"m{i}".encode(),
                             pika.BasicProperties(content_type="text/plain", delivery_mode=2))
        path = f"/api/queues/%2F/{q(name)}"
        taken = http.call("POST", path + "/get", json={
            "count": 2, "ackmode": "ack_requeue_false", "encoding": "auto"})
        assert taken.status_code == 200, taken.text
        assert [m["payload"] for m in taken.json()] == ["m0", "m1"]
        assert taken.json()[0]["properties"]["content_type"] == "text/plain"
        rejected = http.call("POST", path + "/get", json={
            "count": 1, "ackmode": "reject_requeue_false", "encoding": "auto"})
        assert rejected.status_code == 200, rejected.text
        assert [m["payload"] for m in rejected.json()] == ["m2"]
        # What is left is in the queue; the rejected one went to the dead-letter queue.
        assert ch.queue_declare(name, passive=True).method.message_count == 1
        assert wait_until(lambda: ch.queue_declare(dead, passive=True).method.message_count == 1,
                          FIGURES)
        method, _, body = ch.basic_get(dead, auto_ack=True)
        assert body == b"m2"
        method, _, body = ch.basic_get(name, auto_ack=True)
        assert body == b"m3"
        # An empty queue answers an empty list.
        empty = http.call("POST", path + "/get", json={"count": 5, "ackmode": "ack_requeue_false",
                                                       "encoding": "auto"})
        assert empty.status_code == 200 and empty.json() == []


def test_consumers_are_listed_with_their_queue_channel_and_settings(http, broker, made):
    name = uniq("http.consumed")
    path = f"/api/queues/%2F/{q(name)}"
    assert http.call("PUT", path, json={"durable": False}).status_code == 201
    made.append(path)
    with broker.connect() as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=7)
        tag = ch.basic_consume(name, lambda *args: None, arguments={"x-priority": 5})

        def listed():
            return [c for c in http.get("/api/consumers/%2F") if c["consumer_tag"] == tag]

        assert wait_until(lambda: len(listed()) == 1, FIGURES), http.get("/api/consumers")
        consumer = listed()[0]
        assert consumer["queue"] == {"name": name, "vhost": "/"}
        assert consumer["ack_required"] is True and consumer["exclusive"] is False
        assert consumer["prefetch_count"] == 7
        assert consumer["arguments"] == {"x-priority": 5}
        assert consumer["active"] is True
        details = consumer["channel_details"]
        assert details["user"] == "guest" and details["number"] == 1
        assert details["connection_name"] in [c["name"] for c in http.get("/api/connections")]
        assert any(c["consumer_tag"] == tag for c in http.get("/api/consumers"))
        ch.basic_cancel(tag)
        assert wait_until(lambda: not listed(), FIGURES)


def test_a_management_user_sees_the_totals_of_its_vhosts_only(http, broker, made):
    """Five queues and four messages in the user's vhost, more of both in
    the default one: the overview counts the five and the four, as
    RabbitMQ's does for a user without monitoring."""
    vhost, user = uniq("tenant.v"), uniq("tenant.u")
    vpath, upath = f"/api/vhosts/{q(vhost)}", f"/api/users/{q(user)}"
    assert http.call("PUT", vpath).status_code == 201
    made.append(vpath)
    assert http.call("PUT", upath, json={"password": "pw", "tags": "management"}) \
        .status_code == 201
    made.append(upath)
    assert http.call("PUT", f"/api/permissions/{q(vhost)}/{q(user)}",
                     json={"configure": ".*", "write": ".*", "read": ".*"}).status_code == 201
    prefix = uniq("totals")
    for v, queues, messages in [(vhost, 5, 4), ("/", 8, 7)]:
        for i in range(queues):
            path = f"/api/queues/{q(v)}/{q(f'{prefix}.{i}')}"
            assert http.call("PUT", path, json={"durable": False}).status_code == 201
            made.append(path)
        for _ in range(messages):
            response = http.call("POST", f"/api/exchanges/{q(v)}/amq.default/publish", json={
                "routing_key": f"{prefix}.0", "payload": "x", "payload_encoding": "string",
                "properties": {}})
            assert response.json() == {"routed": True}, response.text
    as_user = (user, "pw")

    def totals():
        overview = http.get("/api/overview", auth=as_user)
        return (overview["object_totals"]["queues"],
                overview["queue_totals"].get("messages"),
                overview["queue_totals"].get("messages_ready"))
    assert wait_until(lambda: totals() == (5, 4, 4), FIGURES), totals()
    if isinstance(broker, SpillwayBroker):
        exchanges = http.get("/api/exchanges", auth=as_user)
        assert http.get("/api/overview", auth=as_user)["object_totals"]["exchanges"] == \
            len(exchanges)
    assert wait_until(lambda: http.get("/api/overview")["object_totals"]["queues"] >= 13,
                      FIGURES)

    # Nodes are the monitoring user's, policies the policymaker's,
    # operator policies the administrator's.
    for path in ["/api/nodes", "/api/policies", f"/api/policies/{q(vhost)}",
                 "/api/operator-policies"]:
        assert http.call("GET", path, auth=as_user).status_code == 401, path
    assert http.call("PUT", upath, json={"password": "pw", "tags": "policymaker"}) \
        .status_code == 204
    assert http.get("/api/policies", auth=as_user) == []
    assert http.call("GET", "/api/nodes", auth=as_user).status_code == 401
