#!/usr/bin/env python3
"""How long the web console takes to show its pages with many queues (`make bench-console`,
run by `make bench` too).

An all-in-one broker (target/release/spillway, or SPILLWAY_BIN) on ephemeral loopback
ports in a temp dir, BENCH_CONSOLE_QUEUES (10,000) queues declared with pika (queue i
holding i % 7 messages), and headless Chromium (tests/python/console_browser.py). Each
figure is the wall time from asking for a page (or clicking) to its figures on screen,
BENCH_CONSOLE_ROUNDS (5) times, as median and worst:

  overview, page load     a full load of the page (login from sessionStorage, first poll)
  queues, page load       a full load of #/queues, sorted by name, 50 a page
  queues, next page       the "Next" button
  queues, sort            a click on the "Ready" header (the server sorts 10,000 queues)
  queues, regex filter    a regular expression typed in (the console waits 250 ms after the
                          last key press before it asks: included)
  API ...                 the same requests without the browser (python requests)

The queues page asks the server for one page (page, page_size, name, use_regex, sort):
it never fetches every queue. Nothing is asserted: this prints figures (speed promises
live in benchmarks, docs/performance.md). The broker samples message rates every 5 s
(its default), not every 200 ms as the test suite's brokers do.

Needs the test venv (scripts/python-venv.sh) and Debian's chromium and chromium-driver
(scripts/install-deps.sh)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import requests  # noqa: E402

import spillway_testlib  # noqa: E402
from console_browser import all_css, chromium, css, log_in, logged_in_as, text_of, wait_for  # noqa: E402

QUEUES = int(os.environ.get("BENCH_CONSOLE_QUEUES", "10000"))
ROUNDS = int(os.environ.get("BENCH_CONSOLE_ROUNDS", "5"))
TIMEOUT = 120.0


def log(text: str) -> None:
    print(f"bench-console: {text}", file=sys.stderr, flush=True)


def timed(action, condition, driver, what: str) -> float:
    started = time.perf_counter()
    action()
    wait_for(driver, condition, TIMEOUT, what)
    return time.perf_counter() - started


def fill_broker(broker) -> None:
    started = time.perf_counter()
    with broker.connect() as conn:
        ch = conn.channel()
        for i in range(QUEUES):
            name = f"bench.q.{i:05d}"
            ch.queue_declare(name)
            for m in range(i % 7):
                ch.basic_publish("", name, b"x" * 100)
    log(f"{QUEUES} queues declared and filled in {time.perf_counter() - started:.1f} s")


def measure(driver, base: str) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {}
    total = f"{QUEUES:,}"

    def add(name: str, seconds: float) -> None:
        figures.setdefault(name, []).append(seconds)

    for _ in range(ROUNDS):
        driver.get("about:blank")
        add("overview, page load", timed(
            lambda: driver.get(base + "/#/overview"),
            lambda d: total in text_of(d, "#overview-totals"), driver, "the overview"))

        # A full load: the list as a first visit shows it (by name, first page, no filter).
        driver.get("about:blank")
        add("queues, page load", timed(
            lambda: driver.get(base + "/#/queues"),
            lambda d: css(d, "#queues-table").get_attribute("data-total") == str(QUEUES)
            and len(all_css(d, "#queues-table tbody tr")) == 50, driver, "the queues page"))

        add("queues, next page", timed(
            lambda: css(driver, "#queues-next").click(),
            lambda d: "page 2 of" in text_of(d, "#queues-status")
            and "bench.q.00050" in text_of(d, "#queues-table tbody tr:first-child"),
            driver, "the second page"))

        add("queues, sort", timed(
            lambda: css(driver, "#queues-table button[data-sort='messages_ready']").click(),
            lambda d: all_css(d, "#queues-table th[aria-sort] button[data-sort='messages_ready']")
            and "page 1 of" in text_of(d, "#queues-status"), driver, "the sorted list"))

        css(driver, "#queues-regex").click()
        add("queues, regex filter", timed(
            lambda: css(driver, "#queues-filter").send_keys(r"^bench\.q\.0012"),
            lambda d: text_of(d, "#queues-status").startswith(f"10 of {total}"),
            driver, "the filtered list"))

    session = requests.Session()
    session.auth = ("guest", "guest")
    for name, path in [("API /api/overview", "/api/overview"),
                       ("API /api/queues page 1 of 50", "/api/queues?page=1&page_size=50&sort=name"),
                       ("API /api/queues sorted by ready", "/api/queues?page=1&page_size=50&sort=messages_ready&sort_reverse=true"),
                       ("API /api/queues regex", "/api/queues?page=1&page_size=50&name=%5Ebench%5C.q%5C.0012&use_regex=true")]:
        for _ in range(ROUNDS):
            started = time.perf_counter()
            response = session.get(base + path, timeout=TIMEOUT)
            response.raise_for_status()
            add(name, time.perf_counter() - started)
    return figures


def main() -> int:
    # The broker's own default, not the test suite's 200 ms.
    spillway_testlib._EPHEMERAL["SPILLWAY_MANAGEMENT__HTTP_SAMPLE_INTERVAL"] = "5s"
    with tempfile.TemporaryDirectory(prefix="spillway-bench-console-") as tmp:
        broker = spillway_testlib.SpillwayBroker("all-in-one", Path(tmp))
        driver = profile = None
        try:
            broker.start()
            base = f"http://{broker.procs['all-in-one'].address('http')}"
            fill_broker(broker)
            driver, profile = chromium()
            log_in(driver, base, "guest", "guest")
            wait_for(driver, lambda d: logged_in_as(d, "guest"), TIMEOUT, "the login")
            figures = measure(driver, base)
        finally:
            if driver is not None:
                driver.quit()
            if profile is not None:
                profile.cleanup()
            try:
                broker.stop()
            finally:
                broker.kill()
    print(f"\nweb console with {QUEUES:,} queues ({ROUNDS} rounds; median / worst):")
    for name, seconds in figures.items():
        print(f"  {name:<36} {statistics.median(seconds) * 1000:8.0f} ms / {max(seconds) * 1000:6.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
