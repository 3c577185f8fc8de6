"""Spillway's web console (``/`` on the management HTTP port) in a real browser: headless
Chromium driven by Selenium, against a real all-in-one broker on ephemeral ports.

An administrator logs in, declares a queue through the console's form, publishes to it,
sees its depth change, looks at a message, moves one to another queue, takes one, purges
the queue and deletes it; a pika connection is closed from the connections page; a ``monitoring`` user is
offered nothing that changes the broker; a user with no management tag is refused.
Screenshots of every page are kept in ``target/test-artefacts/console/`` (printed at the
end of the module). The console's responses carry its security headers, its scripts
raise no error and the Content-Security-Policy refuses nothing it loads.

The broker's flow-to-disk threshold is 1 MiB and a backlog of a few MiB is published
before the first page is opened, so the overview shows payloads spilled to the store.

Chromium and chromium-driver must be installed (scripts/install-deps.sh): without them
these tests fail rather than skip. Page load times with 10,000 queues are measured by
``scripts/bench-console.py`` (``make bench-console``), not asserted here."""

from __future__ import annotations

import os
import re
import urllib.parse

import pika
import pika.exceptions
import pytest
import requests

from console_browser import (accept_confirm, all_css, chromium, css, go, log_in, logged_in_as,
                             page_errors, text_of, wait_for)
from spillway_testlib import REPO_ROOT, SpillwayBroker, uniq, wait_until

# Spillway's console: not run against an external broker (SPILLWAY_TEST_AMQP_URL).
pytestmark = pytest.mark.spillway_only

ARTEFACTS = REPO_ROOT / "target" / "test-artefacts" / "console"
# A small memory budget, so that the overview shows flow to disk at work.
CONFIG = """
[engine]
flow_to_disk_threshold = "1MiB"
"""
BACKLOG_MESSAGES = 300
BACKLOG_SIZE = 10 * 1024


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Http:
    """The management HTTP API, as guest (for what the tests set up and check)."""

    def __init__(self, base: str):
        self.base = base

    def call(self, method, path, auth=("guest", "guest"), **kw):
        kw.setdefault("timeout", 30)
        return requests.request(method, self.base + path, auth=auth, **kw)

    def get(self, path, **kw):
        response = self.call("GET", path, **kw)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def ready(self, queue: str):
        return self.get(f"/api/queues/%2F/{q(queue)}")["messages_ready"]


def show(config, line: str) -> None:
    """Prints past pytest's output capture (as ``capsys.disabled()`` does)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(line)


@pytest.fixture(scope="module")
def console(request, tmp_path_factory):
    """An all-in-one broker of its own (1 MiB flow-to-disk threshold) with a spilled
    backlog; yields (broker, Http)."""
    broker = SpillwayBroker("all-in-one", tmp_path_factory.mktemp("console"), config=CONFIG)
    try:
        broker.start()
        http = Http(f"http://{broker.procs['all-in-one'].address('http')}")
        with broker.connect() as conn:
            ch = conn.channel()
            backlog = uniq("console.backlog")
            ch.queue_declare(backlog)
            for _ in range(BACKLOG_MESSAGES):
                ch.basic_publish("", backlog, os.urandom(BACKLOG_SIZE))
        assert wait_until(lambda: http.ready(backlog) == BACKLOG_MESSAGES, 30)
        yield broker, http
    finally:
        try:
            broker.stop()
        finally:
            broker.kill()
            if ARTEFACTS.exists():
                show(request.config, f"console screenshots: {ARTEFACTS}")


@pytest.fixture
def browser(console):
    broker, _http = console
    driver, profile = chromium()
    try:
        yield driver
        errors = page_errors(driver)
        assert not errors, f"the browser logged errors: {errors}"
    finally:
        try:
            driver.quit()
        finally:
            profile.cleanup()


def screenshot(driver, name: str) -> None:
    """Keeps a screenshot of the whole page (replaced atomically: parallel runs write whole
    files)."""
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    partial = ARTEFACTS / f".{name}.{os.getpid()}.png"
    size = driver.get_window_size()
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(size["width"], max(size["height"], min(height + 100, 4000)))
    try:
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(partial))
    finally:
        driver.set_window_size(size["width"], size["height"])
    os.replace(partial, ARTEFACTS / f"{name}.png")


def user(http, tags: str) -> tuple[str, str]:
    name, password = uniq("console.u"), "s3cret-" + uniq("p")
    response = http.call("PUT", f"/api/users/{q(name)}", json={"password": password, "tags": tags})
    assert response.status_code == 201, response.text
    return name, password


def spilled_shown(text: str) -> int:
    """The spilled messages the overview shows ("N messages (X MiB) spilled to the store")."""
    found = re.search(r"([\d,]+) messages \([^)]*\) spilled to the store", text)
    return int(found.group(1).replace(",", "")) if found else 0


def flash(driver) -> str:
    return text_of(driver, "#flash") if css(driver, "#flash").is_displayed() else ""


def test_the_console_is_served_with_its_security_headers(console):
    _broker, http = console
    # No credentials for the files: they hold no data.
    for path, kind in [("/", "text/html"), ("/console/app.js", "text/javascript"),
                       ("/console/style.css", "text/css")]:
        response = requests.get(http.base + path, timeout=30)
        assert response.status_code == 200, (path, response.status_code)
        assert response.headers["content-type"].startswith(kind), response.headers
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
        assert "unsafe-inline" not in csp
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
    assert requests.get(http.base + "/console/missing.js", timeout=30).status_code == 404
    # The data stays behind the login.
    assert requests.get(http.base + "/api/overview", timeout=30).status_code == 401


def test_an_administrator_declares_fills_inspects_moves_purges_and_deletes_a_queue(
        console, browser):
    broker, http = console
    driver = browser
    log_in(driver, http.base, "guest", "guest")
    wait_for(driver, lambda d: logged_in_as(d, "guest"), what="the login")
    # Figures every 2 s rather than 5: the charts fill sooner.
    css(driver, "#refresh option[value='2']").click()
    wait_for(driver, lambda d: text_of(d, "#overview-totals"), what="the overview's figures")
    # The backlog past the 1 MiB budget: spilled, and shown so.
    wait_for(driver, lambda d: spilled_shown(text_of(d, "#flow-to-disk")) > 0,
             what="the messages spilled to the store")
    assert {a.text for a in all_css(driver, "#nav a")} == {
        "Overview", "Queues", "Exchanges", "Connections", "Users", "Policies"}

    # Declared through the console's form.
    name, other = uniq("console.q"), uniq("console.dest")
    go(driver, "#/queues")
    wait_for(driver, lambda d: d.find_elements("css selector", "#queues-table tbody tr"),
             what="the queue list")
    css(driver, "#add-queue > summary").click()
    css(driver, "#add-queue-name").send_keys(name)
    css(driver, "#add-queue-arguments").send_keys('{"x-max-length": 1000}')
    css(driver, "#add-queue-submit").click()
    wait_for(driver, lambda d: f"Queue '{name}' declared" in flash(d), what="the declaration")
    declared = http.get(f"/api/queues/%2F/{q(name)}")
    assert declared["durable"] is True and declared["arguments"] == {"x-max-length": 1000}

    # Found with the list's filter (the server filters), then opened.
    css(driver, "#queues-filter").send_keys(name)
    row = f"#queues-table tr[data-key='//{name}']"  # vhost / name
    wait_for(driver, lambda d: len(all_css(d, "#queues-table tbody tr")) == 1 and all_css(d, row),
             what="the filtered list")
    screenshot(driver, "queues")
    css(driver, f"{row} a.name").click()
    wait_for(driver, lambda d: text_of(d, "#queue-ready") == "0", what="the queue's page")

    # Published through the console: the depth follows.
    css(driver, "#publish > summary").click()
    for payload, depth in [("hello from the console", "1"), ("the second", "2"), ("the third", "3")]:
        field = css(driver, "#publish-payload")
        field.clear()
        field.send_keys(payload)
        css(driver, "#publish-submit").click()
        wait_for(driver, lambda d: text_of(d, "#queue-ready") == depth, what=f"a depth of {depth}")
    assert http.ready(name) == 3

    # A look at the head leaves the messages where they are.
    css(driver, "#get-messages > summary").click()
    css(driver, "#get-submit").click()
    wait_for(driver, lambda d: text_of(d, "#queue-messages pre.payload") == "hello from the console",
             what="the message got")
    assert http.ready(name) == 3

    # Moved to another queue (the console's move endpoint, the gRPC MoveMessages).
    assert http.call("PUT", f"/api/queues/%2F/{q(other)}", json={"durable": False}).status_code == 201
    css(driver, "#move-messages > summary").click()
    css(driver, "#move-destination").send_keys(other)
    css(driver, "#move-count").send_keys("1")
    css(driver, "#move-submit").click()
    wait_for(driver, lambda d: "Moved 1 message to" in flash(d), what="the move")
    wait_for(driver, lambda d: text_of(d, "#queue-ready") == "2", what="a depth of 2 after the move")
    assert http.ready(other) == 1

    # A get that takes the message (acknowledged: gone from the queue).
    css(driver, "#get-messages option[value='ack_requeue_false']").click()
    css(driver, "#get-submit").click()
    wait_for(driver, lambda d: text_of(d, "#queue-messages pre.payload") == "the second",
             what="the message taken")
    wait_for(driver, lambda d: text_of(d, "#queue-ready") == "1", what="a depth of 1 after the take")
    # Several samples in the depth chart before its picture.
    wait_for(driver, lambda d: "collecting" not in text_of(d, "#queue-chart"), what="the depth chart")
    screenshot(driver, "queue")

    css(driver, "#purge").click()
    assert "Purge" in accept_confirm(driver)
    wait_for(driver, lambda d: text_of(d, "#queue-ready") == "0", what="a depth of 0 after the purge")
    assert http.ready(name) == 0

    css(driver, "#delete-queue").click()
    accept_confirm(driver)
    wait_for(driver, lambda d: d.execute_script("return location.hash") == "#/queues",
             what="the queue list after the delete")
    assert http.call("GET", f"/api/queues/%2F/{q(name)}").status_code == 404
    assert http.call("DELETE", f"/api/queues/%2F/{q(other)}").status_code == 204

    for route, ready, shot in [("#/exchanges", "#exchanges-table tbody tr", "exchanges"),
                               ("#/users", "#users tbody tr", "users"),
                               ("#/policies", "#policies tbody tr", "policies")]:
        go(driver, route)
        wait_for(driver, lambda d: all_css(d, ready), what=f"the {shot} page")
        screenshot(driver, shot)

    # Back on the overview, its charts hold the samples taken since the login.
    go(driver, "#/overview")
    wait_for(driver, lambda d: "collecting" not in text_of(d, "#overview-charts"),
             what="the overview's charts")
    wait_for(driver, lambda d: len(all_css(d, "#overview-charts polyline")) >= 5,
             what="every line of the overview's charts")
    screenshot(driver, "overview")


def test_a_connection_is_closed_from_the_connections_page(console, browser):
    broker, http = console
    driver = browser
    name = uniq("console.conn")
    conn = broker.connect(client_properties={"connection_name": name})
    try:
        conn.channel()
        log_in(driver, http.base, "guest", "guest")
        wait_for(driver, lambda d: logged_in_as(d, "guest"), what="the login")
        go(driver, "#/connections")
        button = f"#connections-table tr[data-key='{name}'] button.close-connection"
        wait_for(driver, lambda d: all_css(d, button), what="the pika connection in the list")
        screenshot(driver, "connections")
        css(driver, button).click()
        accept_confirm(driver)

        def closed():
            try:
                conn.process_data_events(time_limit=0.05)
            except pika.exceptions.ConnectionClosed as closing:
                return closing
            return None
        closing = wait_until(closed, 20)
        assert closing, "the connection was not closed"
        assert closing.reply_code == 320 and "web console" in closing.reply_text, closing
        wait_for(driver, lambda d: not all_css(d, button), what="the connection gone from the list")
    finally:
        if conn.is_open:
            conn.close()


def test_a_monitoring_user_is_offered_nothing_that_changes_the_broker(console, browser):
    broker, http = console
    driver = browser
    queue = uniq("console.watched")
    assert http.call("PUT", f"/api/queues/%2F/{q(queue)}", json={"durable": False}).status_code == 201
    conn = broker.connect()  # a connection to list
    try:
        name, password = user(http, "monitoring")
        log_in(driver, http.base, name, password)
        wait_for(driver, lambda d: logged_in_as(d, name), what="the monitoring user's login")
        # Policies are the policymaker's to read, as in RabbitMQ.
        assert {a.text for a in all_css(driver, "#nav a")} == {
            "Overview", "Queues", "Exchanges", "Connections"}

        go(driver, "#/queues")
        wait_for(driver, lambda d: all_css(d, "#queues-table tbody tr a.name"), what="the queue list")
        assert not all_css(driver, "#add-queue")
        go(driver, f"#/queues/%2F/{q(queue)}")
        wait_for(driver, lambda d: text_of(d, "#queue-ready") == "0", what="the queue's page")
        for action in ["#publish", "#get-messages", "#move-messages", "#purge", "#delete-queue"]:
            assert not all_css(driver, action), action
        go(driver, "#/exchanges")
        wait_for(driver, lambda d: all_css(d, "#exchanges-table tbody tr a.name"), what="the exchanges")
        assert not all_css(driver, "#add-exchange") and not all_css(driver, "button.danger")
        go(driver, "#/connections")
        wait_for(driver, lambda d: all_css(d, "#connections-table tbody tr .name"), what="the connections")
        assert not all_css(driver, "button.close-connection")
        # The users and policies pages are not the monitoring user's: their
        # addresses lead to the overview.
        for page in ["#/policies", "#/users"]:
            go(driver, page)
            wait_for(driver, lambda d: d.execute_script("return location.hash") == "#/overview",
                     what=f"the way back to the overview from {page}")
        assert not all_css(driver, "#add-user")
        wait_for(driver, lambda d: text_of(d, "#overview-totals"), what="the overview")
        screenshot(driver, "monitoring")
    finally:
        conn.close()
        http.call("DELETE", f"/api/queues/%2F/{q(queue)}")


def test_a_user_without_a_management_tag_and_a_wrong_password_are_refused(console, browser):
    _broker, http = console
    driver = browser
    name, password = user(http, "")
    log_in(driver, http.base, name, password)
    wait_for(driver, lambda d: css(d, "#login-error").is_displayed(), what="the refusal")
    assert "Not authorised" in text_of(driver, "#login-error")
    assert "no management tag" in text_of(driver, "#login-error")
    assert not all_css(driver, "#nav a") and not all_css(driver, ".who-name")
    screenshot(driver, "refused")
    # Nothing kept: a reload asks again.
    driver.refresh()
    wait_for(driver, lambda d: css(d, "#login-user").is_displayed(), what="the login form again")

    css(driver, "#login-user").send_keys("guest")
    css(driver, "#login-password").send_keys("not the password")
    css(driver, "#login-submit").click()
    wait_for(driver, lambda d: css(d, "#login-error").is_displayed()
             and "Not authorised" in text_of(d, "#login-error"), what="the wrong password's refusal")
    assert not all_css(driver, "#nav a")


def test_the_move_endpoint_checks_permissions_as_the_grpc_method_does(console):
    broker, http = console
    vhost = uniq("console.v")
    source, destination = "app.source", "other.destination"
    assert http.call("PUT", f"/api/vhosts/{q(vhost)}").status_code == 201
    try:
        name, password = user(http, "management")
        # read on app.*, write on app.* only: moving out to other.* is refused.
        assert http.call("PUT", f"/api/permissions/{q(vhost)}/{q(name)}", json={
            "configure": "^(app|other)\\.", "write": "^app\\.", "read": "^app\\."}).status_code == 201
        for queue in (source, destination):
            assert http.call("PUT", f"/api/queues/{q(vhost)}/{q(queue)}",
                             json={"durable": False}).status_code == 201
        for i in range(3):
            answer = http.call("POST", f"/api/exchanges/{q(vhost)}/amq.default/publish", json={
                "routing_key": source, "payload": f"m{i}", "payload_encoding": "string",
                "properties": {}})
            assert answer.status_code == 200 and answer.json()["routed"], answer.text
        move = f"/api/queues/{q(vhost)}/{q(source)}/move"
        refused = http.call("POST", move, auth=(name, password), json={"destination": destination})
        assert refused.status_code == 401, refused.text
        assert "write access to queue 'other.destination'" in refused.json()["reason"]
        bad = http.call("POST", move, json={"destination": ""})
        assert bad.status_code == 400 and bad.json()["error"] == "bad_request", bad.text
        same = http.call("POST", move, json={"destination": source})
        assert same.status_code == 400, same.text
        missing = http.call("POST", f"/api/queues/{q(vhost)}/gone/move", json={"destination": source})
        assert missing.status_code == 404, missing.text

        moved = http.call("POST", move, json={"destination": destination, "count": 2})
        assert moved.status_code == 200, moved.text
        assert moved.json() == {"moved": 2, "remaining": 1, "stopped_reason": ""}
        moved = http.call("POST", move, json={"destination": destination})
        assert moved.json()["moved"] == 1 and moved.json()["remaining"] == 0
        assert http.get(f"/api/queues/{q(vhost)}/{q(destination)}")["messages_ready"] == 3
    finally:
        http.call("DELETE", f"/api/vhosts/{q(vhost)}")
