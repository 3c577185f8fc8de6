"""Process management for the Spillway broker under test, and small AMQP helpers.

The broker contract (see README.md):

* ``$SPILLWAY_BIN --ready-file FILE [all-in-one|storage|engine|gateway]``
* settings through ``SPILLWAY_<SECTION>__<KEY>`` environment variables;
* once listening, the process atomically writes FILE as JSON with the addresses it
  bound, e.g. ``{"amqp": "127.0.0.1:41234", "engine": "...", "storage": "..."}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pika

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = float(os.environ.get("SPILLWAY_TEST_START_TIMEOUT", "60"))
STOP_TIMEOUT = float(os.environ.get("SPILLWAY_TEST_STOP_TIMEOUT", "20"))
LOG_TAIL_LINES = 80

# Environment variables of the test harness itself, never handed to the broker.
_HARNESS_VARS = {"SPILLWAY_BIN", "SPILLWAY_TEST_AMQP_URL", "SPILLWAY_TEST_HTTP_URL",
                 "SPILLWAY_TEST_START_TIMEOUT",
                 "SPILLWAY_TEST_STOP_TIMEOUT"}
# Every listener on an ephemeral loopback port, so that two runs can go at once.
_EPHEMERAL = {
    "SPILLWAY_GATEWAY__AMQP_LISTEN": "127.0.0.1:0",
    "SPILLWAY_STORAGE__LISTEN": "127.0.0.1:0",
    "SPILLWAY_ENGINE__LISTEN": "127.0.0.1:0",
    "SPILLWAY_MANAGEMENT__LISTEN": "127.0.0.1:0",
    "SPILLWAY_MANAGEMENT__HTTP_LISTEN": "127.0.0.1:0",
    # Message rates sampled often, so that a test sees them within a second.
    "SPILLWAY_MANAGEMENT__HTTP_SAMPLE_INTERVAL": "200ms",
    "SPILLWAY_TELEMETRY__METRICS_LISTEN": "127.0.0.1:0",
}


def uniq(prefix: str = "t") -> str:
    """A name no other test (or concurrent run against the same broker) uses."""
    return f"pytest.{prefix}.{uuid.uuid4().hex[:12]}"


def spillway_bin() -> Path:
    p = Path(os.environ.get("SPILLWAY_BIN", "target/release/spillway"))
    return p if p.is_absolute() else REPO_ROOT / p


class BrokerError(RuntimeError):
    pass


class _Proc:
    """One spillway process: its role, its Popen, its log files and its ready-file data."""

    def __init__(self, role: str, workdir: Path):
        self.role = role
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file = workdir / "ready.json"
        self.stderr_path = workdir / "stderr.log"
        self.stdout_path = workdir / "stdout.log"
        self.popen: subprocess.Popen | None = None
        self.ready: dict = {}
        self.starts = 0

    def start(self, env_extra: dict[str, str], timeout: float = START_TIMEOUT) -> dict:
        if self.popen is not None and self.popen.poll() is None:
            raise BrokerError(f"{self.role}: already running (pid {self.popen.pid})")
        binary = spillway_bin()
        if not binary.exists():
            raise BrokerError(
                f"spillway binary not found at {binary}: build it (cargo build --release) "
                "or set SPILLWAY_BIN, or run against another broker with SPILLWAY_TEST_AMQP_URL")
        env = {k: v for k, v in os.environ.items() if k not in _HARNESS_VARS}
        env.update(_EPHEMERAL)
        env.update(env_extra)
        try:
            self.ready_file.unlink()
        except FileNotFoundError:
            pass
        self.starts += 1
        cmd = [str(binary), "--ready-file", str(self.ready_file), self.role]
        with open(self.stderr_path, "ab") as err, open(self.stdout_path, "ab") as out:
            banner = f"\n===== start #{self.starts}: {' '.join(cmd)} =====\n".encode()
            err.write(banner)
            err.flush()
            self.popen = subprocess.Popen(
                cmd, env=env, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=out,
                stderr=err, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            rc = self.popen.poll()
            if rc is not None:
                raise BrokerError(f"{self.role}: exited with {rc} before it was ready\n"
                                  + self.log_tail())
            try:
                self.ready = json.loads(self.ready_file.read_text())
                return self.ready
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise BrokerError(f"{self.role}: not ready after {timeout:.0f}s\n"
                                  + self.log_tail())
            time.sleep(0.05)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Graceful stop (SIGTERM). Raises if the process had to be SIGKILLed."""
        if not self.running():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise BrokerError(f"{self.role}: did not stop within {timeout:.0f}s of SIGTERM; "
                              "killed\n" + self.log_tail())

    def kill(self) -> None:
        if not self.running():
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(10)

    def address(self, key: str) -> str:
        try:
            return self.ready[key]
        except KeyError:
            raise BrokerError(f"{self.role}: ready file has no {key!r}: {self.ready}") from None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"[{self.role}] (no stderr file)"
        status = "not started"
        if self.popen is not None:
            rc = self.popen.poll()
            status = "running" if rc is None else f"exited with {rc}"
        head = f"----- {self.role} ({status}) stderr, last {lines} lines of {self.stderr_path} -----"
        return "\n".join([head, *text[-lines:]])


class Broker:
    """What the tests get from the ``broker`` fixtures."""

    wiring: str
    host: str
    port: int

    can_restart = True

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}/%2F"

    @property
    def kombu_url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}//"

    def params(self, **kw) -> pika.ConnectionParameters:
        kw.setdefault("credentials", pika.PlainCredentials("guest", "guest"))
        kw.setdefault("virtual_host", "/")
        kw.setdefault("connection_attempts", 1)
        kw.setdefault("blocked_connection_timeout", 30)
        return pika.ConnectionParameters(host=self.host, port=self.port, **kw)

    def connect(self, **kw) -> pika.BlockingConnection:
        return pika.BlockingConnection(self.params(**kw))

    def kombu(self, **kw):
        import kombu
        kw.setdefault("connect_timeout", 10)
        return kombu.Connection(hostname=self.host, port=self.port, userid="guest",
                                password="guest", virtual_host="/", transport="pyamqp", **kw)

    def logs(self) -> str:
        return ""


class ExternalBroker(Broker):
    """A broker somebody else runs (SPILLWAY_TEST_AMQP_URL), e.g. a real RabbitMQ."""

    wiring = "external"
    can_restart = False

    def __init__(self, url: str):
        u = urllib.parse.urlparse(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 5672
        self._url = url

    @property
    def url(self) -> str:
        return self._url


class SpillwayBroker(Broker):
    """Spillway as one all-in-one process or as storage + engine + gateway processes."""

    def __init__(self, wiring: str, tmpdir: Path, config: str | None = None):
        """``config``: a ``spillway.toml`` for every process (written into each
        process's working directory, where the broker looks for it)."""
        assert wiring in ("all-in-one", "separate"), wiring
        self.wiring = wiring
        self.tmpdir = Path(tmpdir)
        self.data_dir = self.tmpdir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if wiring == "all-in-one":
            self.procs = {"all-in-one": _Proc("all-in-one", self.tmpdir / "all-in-one")}
        else:
            self.procs = {r: _Proc(r, self.tmpdir / r) for r in ("storage", "engine", "gateway")}
        self.host = "127.0.0.1"
        self.port = 0
        # The AMQPS port, when the configuration sets gateway.amqps_listen.
        self.amqps_port = 0
        if config is not None:
            for proc in self.procs.values():
                (proc.workdir / "spillway.toml").write_text(config)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        data = {"SPILLWAY_STORAGE__DATA_DIR": str(self.data_dir)}
        try:
            if self.wiring == "all-in-one":
                ready = self.procs["all-in-one"].start(data)
            else:
                # Every role gets the data directory: without a configured cluster
                # secret they share the one the first of them makes there.
                self.procs["storage"].start(data)
                storage = self.procs["storage"].address("storage")
                self.procs["engine"].start(
                    {**data, "SPILLWAY_ENGINE__STORAGE_ADDR": f"http://{storage}"})
                engine = self.procs["engine"].address("engine")
                ready = self.procs["gateway"].start(
                    {**data, "SPILLWAY_GATEWAY__ENGINE_ADDR": f"http://{engine}"})
            host, _, port = self._ready_amqp(ready).rpartition(":")
        except Exception:
            self.kill()
            raise
        self.host, self.port = host.strip("[]"), int(port)
        if "amqps" in ready:
            self.amqps_port = int(ready["amqps"].rpartition(":")[2])
        self._wait_for_recovery()

    def _wait_for_recovery(self, timeout: float = 60.0) -> None:
        """The broker serves before durable queues' stored messages are in (background
        recovery); a test that restarts and then counts a queue waits for them."""
        engine = self.procs["all-in-one" if self.wiring == "all-in-one" else "engine"]
        url = f"http://{engine.address('metrics')}/metrics"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    text = response.read().decode()
                if any(line.split() == ["spillway_recovery_complete", "1"]
                       for line in text.splitlines()):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BrokerError(f"recovery not complete after {timeout:.0f}s\n{self.logs()}")
            time.sleep(0.05)

    def _ready_amqp(self, ready: dict) -> str:
        if "amqp" not in ready:
            raise BrokerError(f"ready file has no 'amqp' address: {ready}")
        return ready["amqp"]

    def stop(self) -> None:
        """Graceful: SIGTERM the gateway, then the engine, then the storage node."""
        errors = []
        for proc in reversed(list(self.procs.values())):
            try:
                proc.stop()
            except BrokerError as e:
                errors.append(str(e))
        if errors:
            raise BrokerError("\n".join(errors))

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL every process of the broker."""
        for proc in reversed(list(self.procs.values())):
            proc.kill()

    def restart_storage(self) -> None:
        """Restart only the storage process (separate wiring), on the same address,
        while the engine and gateway keep running."""
        if self.wiring != "separate":
            raise BrokerError("restart_storage() needs the 'separate' wiring")
        storage = self.procs["storage"]
        addr = storage.address("storage")
        storage.stop()
        env = {"SPILLWAY_STORAGE__DATA_DIR": str(self.data_dir),
               "SPILLWAY_STORAGE__LISTEN": addr}
        # The old socket is closed; on a rare EADDRINUSE (TIME_WAIT without SO_REUSEADDR) retry.
        deadline = time.monotonic() + 15
        while True:
            try:
                storage.start(env)
                break
            except BrokerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        if storage.address("storage") != addr:
            raise BrokerError(f"storage came back on {storage.address('storage')}, not {addr}")

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in self.procs.values())

    def crashed(self) -> list[str]:
        return [p.role for p in self.procs.values()
                if p.popen is not None and p.popen.poll() is not None]


# -- small AMQP helpers ------------------------------------------------------------------

def spillctl(broker, *args):
    """Runs spillctl against the all-in-one broker's management port as guest (loopback)."""
    addr = broker.procs["all-in-one"].address("management")
    out = subprocess.run(
        [str(spillway_bin().with_name("spillctl")), "--addr", f"http://{addr}", *args],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"spillctl {args}: {out.stderr}"
    return out.stdout


def wait_until(probe, timeout: float = 3.0, conn=None, interval: float = 0.05):
    """Call ``probe()`` until it returns something truthy or ``timeout`` seconds pass;
    returns its last answer (falsy on timeout), so ``assert wait_until(...)`` fails
    with what was last seen. Between calls it serves ``conn``'s events (a blocking pika
    connection must, or it misses heartbeats and callbacks), else it sleeps.
    Use it instead of a fixed sleep before an assertion."""
    deadline = time.monotonic() + timeout
    while True:
        answer = probe()
        if answer or time.monotonic() > deadline:
            return answer
        if conn is not None:
            conn.process_data_events(time_limit=interval)
        else:
            time.sleep(interval)


def drain(ch, queue: str, n: int | None = None, timeout: float = 5.0, ack: bool = True):
    """basic.get messages from ``queue`` until it is empty (or ``n`` were got).
    Returns a list of (method, properties, body). Waits up to ``timeout`` for ``n``."""
    got = []
    deadline = time.monotonic() + timeout
    while n is None or len(got) < n:
        method, props, body = ch.basic_get(queue, auto_ack=False)
        if method is None:
            if n is None or time.monotonic() > deadline:
                break
            ch.connection.process_data_events(time_limit=0.05)
            continue
        got.append((method, props, body))
        if ack:
            ch.basic_ack(method.delivery_tag)
    return got


def collect(conn, ch, queue: str, n: int, timeout: float = 5.0, auto_ack: bool = False,
            ack: bool = True):
    """Consume exactly ``n`` messages with basic.consume (waits up to ``timeout``), then
    checks that nothing more arrives within a short grace period. Cancels the consumer."""
    got = []

    def on_msg(chan, method, props, body):
        got.append((method, props, body))
        if ack and not auto_ack:
            chan.basic_ack(method.delivery_tag)

    tag = ch.basic_consume(queue, on_msg, auto_ack=auto_ack)
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    conn.process_data_events(time_limit=0.2)
    ch.basic_cancel(tag)
    return got


def queue_exists(conn, name: str) -> bool:
    import pika.exceptions as pe
    ch = conn.channel()
    try:
        ch.queue_declare(name, passive=True)
    except pe.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return False
        raise
    ch.close()
    return True


def exchange_exists(conn, name: str) -> bool:
    import pika.exceptions as pe
    ch = conn.channel()
    try:
        ch.exchange_declare(name, passive=True)
    except pe.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            return False
        raise
    ch.close()
    return True


def assert_same(a, b, path="$"):
    """Deep equality that also compares types (True != 1, 1 != 1.0, b'x' != 'x')."""
    def kind(x):  # pika decodes 64-bit ints as pika.compat.long, an int subclass
        return int if isinstance(x, int) and not isinstance(x, bool) else type(x)
    assert kind(a) is kind(b), f"{path}: type {type(a).__name__} != {type(b).__name__} ({a!r} vs {b!r})"
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
