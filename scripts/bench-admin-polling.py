#!/usr/bin/env python3
"""What management users polling one queue cost everybody else (`make bench-admin-polling`).

An all-in-one broker (target/release/spillway, or SPILLWAY_BIN) on ephemeral loopback ports
in a temp dir, BENCH_ADMIN_QUEUES (100,000) queues declared in the default vhost, then two
phases of BENCH_ADMIN_SECONDS (20) each:

  quiet     a bystander (pika, publisher confirms, one 100-byte message at a time to a queue
            of its own) publishing alone;
  polling   the same bystander while BENCH_ADMIN_POLLERS (8) clients poll
            GET /api/queues/%2F/<one queue> in a loop (one keep-alive connection each,
            `monitoring` user, as a dashboard does).

Printed per phase: the bystander's confirmed publishes (msg/s, p50/p99/max of publish to
confirm), the pollers' requests/s and their p50/p99, and the broker's peak RSS sampled every
100 ms during the phase (and VmHWM, the process's peak over its whole life). Each client is a
process of its own, so that the GIL does not put one client's waits into another's figures.
Nothing is asserted: figures only (docs/performance.md). The broker samples message rates
every 5 s (its default), so a sample of every queue falls in each phase."""

from __future__ import annotations

import base64
import http.client
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import pika  # noqa: E402
import requests  # noqa: E402

import spillway_testlib  # noqa: E402

QUEUES = int(os.environ.get("BENCH_ADMIN_QUEUES", "100000"))
SECONDS = float(os.environ.get("BENCH_ADMIN_SECONDS", "20"))
POLLERS = int(os.environ.get("BENCH_ADMIN_POLLERS", "8"))
DECLARERS = 4
POLLED = "bench.q.00042"
USER, PASSWORD = "bench-monitor", "bench-monitor"


def log(text: str) -> None:
    print(f"bench-admin-polling: {text}", file=sys.stderr, flush=True)


def declare(host: str, port: int, start: int, stop: int) -> None:
    params = pika.ConnectionParameters(host=host, port=port,
                                       credentials=pika.PlainCredentials("guest", "guest"))
    with pika.BlockingConnection(params) as conn:
        ch = conn.channel()
        for i in range(start, stop):
            ch.queue_declare(f"bench.q.{i:05d}")


def bystander(host: str, port: int, seconds: float, out, ready, go) -> None:
    # Connected before the pollers start: a stalled broker may not finish a handshake
    # in pika's default time.
    params = pika.ConnectionParameters(host=host, port=port,
                                       credentials=pika.PlainCredentials("guest", "guest"),
                                       socket_timeout=120, stack_timeout=120,
                                       blocked_connection_timeout=300)
    with pika.BlockingConnection(params) as conn:
        ch = conn.channel()
        ch.queue_declare("bench.bystander")
        ch.confirm_delivery()
        body = b"x" * 100
        latencies = []
        ready.set()
        go.wait()
        started = time.perf_counter()
        deadline = started + seconds
        while True:
            sent = time.perf_counter()
            if sent >= deadline:
                break
            ch.basic_publish("", "bench.bystander", body)
            latencies.append(time.perf_counter() - sent)
        elapsed = time.perf_counter() - started
        ch.queue_purge("bench.bystander")
    out.put(("bystander", latencies, elapsed))


def poller(address: str, seconds: float, out, go) -> None:
    go.wait()
    host, _, port = address.rpartition(":")
    auth = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    path = f"/api/queues/%2F/{POLLED}"
    latencies = []
    failures = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        sent = time.perf_counter()
        try:
            conn.request("GET", path, headers={"authorization": auth})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                failures += 1
        except (OSError, http.client.HTTPException):
            failures += 1
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            continue
        latencies.append(time.perf_counter() - sent)
    out.put(("poller", latencies, time.perf_counter() - started, failures))


def rss_kib(pid: int, key: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def phase(name: str, broker, http_address: str, pid: int, pollers: int) -> dict:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    ready, go = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=bystander,
                         args=(broker.host, broker.port, SECONDS, out, ready, go))]
    procs += [ctx.Process(target=poller, args=(http_address, SECONDS, out, go))
              for _ in range(pollers)]
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for proc in procs:
        proc.start()
    if not ready.wait(120):
        raise RuntimeError("the bystander did not connect")
    go.set()
    results = [out.get(timeout=SECONDS + 300) for _ in procs]
    for proc in procs:
        proc.join()
    stop.set()
    sampler.join()
    publishes = next(r for r in results if r[0] == "bystander")
    polls = [r for r in results if r[0] == "poller"]
    poll_latencies = [latency for r in polls for latency in r[1]]
    figures = {
        "phase": name,
        "published": len(publishes[1]) / publishes[2],
        "publish_p50_ms": percentile(publishes[1], 0.50) * 1000,
        "publish_p99_ms": percentile(publishes[1], 0.99) * 1000,
        "publish_max_ms": max(publishes[1], default=float("nan")) * 1000,
        "polls": sum(len(r[1]) for r in polls) / SECONDS if polls else 0.0,
        "poll_p50_ms": percentile(poll_latencies, 0.50) * 1000,
        "poll_p99_ms": percentile(poll_latencies, 0.99) * 1000,
        "poll_failures": sum(r[3] for r in polls),
        "rss_peak_mib": peak[0] / 1024,
        "hwm_mib": rss_kib(pid, "VmHWM") / 1024,
    }
    log(f"{name}: {figures}")
    return figures


def main() -> int:
    # The broker's own default, not the test suite's 200 ms.
    spillway_testlib._EPHEMERAL["SPILLWAY_MANAGEMENT__HTTP_SAMPLE_INTERVAL"] = "5s"
    with tempfile.TemporaryDirectory(prefix="spillway-bench-admin-") as tmp:
        broker = spillway_testlib.SpillwayBroker("all-in-one", Path(tmp))
        try:
            broker.start()
            proc = broker.procs["all-in-one"]
            pid = proc.popen.pid
            http_address = proc.address("http")
            base = f"http://{http_address}"
            admin = requests.Session()
            admin.auth = ("guest", "guest")
            admin.put(f"{base}/api/users/{USER}",
                      json={"password": PASSWORD, "tags": "monitoring"}).raise_for_status()
            admin.put(f"{base}/api/permissions/%2F/{USER}",
                      json={"configure": "", "write": "", "read": ".*"}).raise_for_status()
            started = time.perf_counter()
            ctx = mp.get_context("fork")
            step = -(-QUEUES // DECLARERS)
            declarers = [ctx.Process(target=declare,
                                     args=(broker.host, broker.port, i, min(i + step, QUEUES)))
                         for i in range(0, QUEUES, step)]
            for declarer in declarers:
                declarer.start()
            for declarer in declarers:
                declarer.join()
                if declarer.exitcode != 0:
                    raise RuntimeError("declaring the queues failed")
            log(f"{QUEUES:,} queues declared in {time.perf_counter() - started:.1f} s; "
                f"broker RSS {rss_kib(pid) / 1024:.0f} MiB")
            one = admin.get(f"{base}/api/queues/%2F/{POLLED}")
            one.raise_for_status()
            runs = [phase("quiet", broker, http_address, pid, 0),
                    phase("polling", broker, http_address, pid, POLLERS)]
        finally:
            try:
                broker.stop()
            finally:
                broker.kill()
    print(f"\n{QUEUES:,} queues; {POLLERS} clients polling GET /api/queues/%2F/{POLLED}; "
          f"{SECONDS:.0f} s a phase")
    print("| phase | bystander msg/s | publish p50 / p99 / max ms | polls/s | poll p50 / p99 ms "
          "| failed polls | broker RSS peak MiB (VmHWM) |")
    print("|---|---|---|---|---|---|---|")
    for f in runs:
        print(f"| {f['phase']} | {f['published']:,.0f} | {f['publish_p50_ms']:.2f} / "
              f"{f['publish_p99_ms']:.2f} / {f['publish_max_ms']:.0f} | {f['polls']:,.1f} | "
              f"{f['poll_p50_ms']:.1f} / {f['poll_p99_ms']:.1f} | {f['poll_failures']} | "
              f"{f['rss_peak_mib']:.0f} ({f['hwm_mib']:.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
