"""Fixtures for the Python interop suite: a Spillway broker (or an external one) to talk to.

* ``broker``        session-scoped, one per wiring ("all-in-one", "separate"); shared by the
                    tests that do not restart it, so every test uses unique names (``names``).
* ``fresh_broker``  function-scoped, its own data dir; for tests that restart/kill it.
                    Skipped when SPILLWAY_TEST_AMQP_URL points at a broker run by someone else.
* ``conn``/``ch``   a pika BlockingConnection to ``broker`` and a channel on it.
* ``kconn``         a kombu Connection to ``broker``.
* ``names``         unique queue/exchange names, deleted again at teardown.

Environment: SPILLWAY_BIN, SPILLWAY_TEST_AMQP_URL, SPILLWAY_TEST_WIRINGS (comma list,
default "all-in-one,separate"); other SPILLWAY_* variables reach the broker processes.
"""

from __future__ import annotations

import os

import pika
import pika.exceptions
import pytest

from spillway_testlib import ExternalBroker, SpillwayBroker, uniq

EXTERNAL_URL = os.environ.get("SPILLWAY_TEST_AMQP_URL")
if EXTERNAL_URL:
    WIRINGS = ["external"]
else:
    WIRINGS = [w.strip() for w in
               os.environ.get("SPILLWAY_TEST_WIRINGS", "all-in-one,separate").split(",")
               if w.strip()]


def pytest_configure(config):
    config.addinivalue_line("markers", "restart: restarts or kills the broker (own broker; "
                                       "skipped with SPILLWAY_TEST_AMQP_URL)")
    config.addinivalue_line("markers", "separate_only: needs the separate wiring")
    config.addinivalue_line("markers", "spillway_only: Spillway behaviour RabbitMQ 3.10 does not "
                                       "have (skipped with SPILLWAY_TEST_AMQP_URL)")


def pytest_collection_modifyitems(config, items):
    # Skip before any broker is started for it.
    for item in items:
        if EXTERNAL_URL and item.get_closest_marker("spillway_only") is not None:
            item.add_marker(pytest.mark.skip(
                reason="Spillway-only (e.g. delivery limits on classic queues): not run "
                       "against an external broker"))
            continue
        if item.get_closest_marker("separate_only") is None:
            continue
        callspec = getattr(item, "callspec", None)
        wiring = callspec.params.get("fresh_broker") if callspec else None
        if wiring != "separate":
            item.add_marker(pytest.mark.skip(
                reason=f"needs the separate wiring (storage in its own process), not {wiring}"))


def _make_broker(request, tmp_path_factory, wiring):
    if wiring == "external":
        return ExternalBroker(EXTERNAL_URL), None
    b = SpillwayBroker(wiring, tmp_path_factory.mktemp(f"spillway-{wiring}"))
    return b, b


@pytest.fixture(scope="session", params=WIRINGS)
def broker(request, tmp_path_factory):
    b, own = _make_broker(request, tmp_path_factory, request.param)
    if own is None:
        yield b
        return
    try:
        own.start()
        yield own
    finally:
        try:
            own.stop()
        finally:
            own.kill()


@pytest.fixture(params=WIRINGS)
def fresh_broker(request, tmp_path_factory):
    if request.param == "external":
        pytest.skip("restarts/kills the broker: needs a broker started by the suite "
                    "(unset SPILLWAY_TEST_AMQP_URL)")
    b, own = _make_broker(request, tmp_path_factory, request.param)
    try:
        own.start()
        yield own
    finally:
        try:
            own.stop()
        finally:
            own.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        funcargs = getattr(item, "funcargs", {}) or {}
        for name, value in funcargs.items():
            if isinstance(value, SpillwayBroker):
                crashed = value.crashed()
                if crashed:
                    rep.sections.append((f"spillway ({name}) processes not running",
                                         ", ".join(crashed)))
                rep.sections.append((f"spillway ({name}, {value.wiring}) stderr", value.logs()))


def _close(c):
    try:
        if c.is_open:
            c.close()
    except Exception:
        pass


@pytest.fixture
def conn(broker):
    c = broker.connect()
    yield c
    _close(c)


@pytest.fixture
def ch(conn):
    return conn.channel()


@pytest.fixture
def kconn(broker):
    c = broker.kombu()
    yield c
    try:
        c.release()
    except Exception:
        pass


class Names:
    """Unique names; what was handed out is deleted at teardown (best effort)."""

    def __init__(self):
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def queue(self, prefix="q"):
        n = uniq(prefix)
        self.queues.append(n)
        return n

    def exchange(self, prefix="x"):
        n = uniq(prefix)
        self.exchanges.append(n)
        return n

    def cleanup(self, broker):
        if not (self.queues or self.exchanges) or not broker.port:
            return
        try:
            c = broker.connect(socket_timeout=5)
        except Exception:
            return
        try:
            chan = None
            for kind, name in [("q", q) for q in self.queues] + [("x", x) for x in self.exchanges]:
                try:
                    if chan is None or not chan.is_open:
                        chan = c.channel()
                    if kind == "q":
                        chan.queue_delete(name)
                    else:
                        chan.exchange_delete(name)
                except (pika.exceptions.ChannelClosed, pika.exceptions.ChannelWrongStateError):
                    chan = None
        except Exception:
            pass
        finally:
            _close(c)


@pytest.fixture
def names(request):
    n = Names()
    yield n
    b = request.getfixturevalue("broker") if "broker" in request.fixturenames else None
    if b is None and "fresh_broker" in request.fixturenames:
        return  # its own broker goes away anyway
    if b is not None:
        n.cleanup(b)
