"""Policies seen by an application that declares plain queues, as it did against RabbitMQ
where an operator set dead-lettering, TTL and length limits by policy: the operator runs
``spillctl policy set`` (``rabbitmqctl set_policy`` against RabbitMQ) and pika sees the
queue behave accordingly, at once, including a backlog already queued.

Runs against Spillway's all-in-one broker (the suite's separate wiring runs no management
process) and, under ``with-rabbitmq.sh``, against RabbitMQ through rabbitmqctl: the same
assertions hold for both."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pika
import pytest

from spillway_testlib import SpillwayBroker, drain, spillway_bin, uniq, wait_until


class PolicyTool:
    """Sets and clears policies on the broker under test, with its own operator tool."""

    def __init__(self, broker):
        if isinstance(broker, SpillwayBroker):
            if broker.wiring != "all-in-one":
                pytest.skip("needs the all-in-one broker's management port")
            addr = broker.procs["all-in-one"].address("management")
            self.base = [str(spillway_bin().with_name("spillctl")), "--addr", f"http://{addr}"]
            self.env = None
            self.rabbit = False
        elif os.environ.get("RABBITMQ_NODENAME") and os.environ.get("RABBITMQ_MNESIA_BASE"):
            # A node of with-rabbitmq.sh: its cookie is in its private home.
            home = Path(os.environ["RABBITMQ_MNESIA_BASE"]).parent
            self.base = ["/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", os.environ["RABBITMQ_NODENAME"]]
            self.env = {**os.environ, "HOME": str(home)}
            self.rabbit = True
        else:
            pytest.skip("no way to set policies on this external broker")
        self.names: list[tuple[str, bool]] = []

    def run(self, *args):
        out = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=60,
                             env=self.env)
        assert out.returncode == 0, f"{args}: {out.stdout}{out.stderr}"
        return out.stdout

    def set(self, name, pattern, definition, apply_to="queues", priority=0, operator=False):
        if self.rabbit:
            verb = "set_operator_policy" if operator else "set_policy"
            self.run(verb, name, pattern, definition, "--apply-to", apply_to,
                     "--priority", str(priority))
        else:
            noun = "operator-policy" if operator else "policy"
            self.run(noun, "set", name, pattern, definition, "--apply-to", apply_to,
                     "--priority", str(priority))
        self.names.append((name, operator))

    def clear(self, name, operator=False):
        if self.rabbit:
            self.run("clear_operator_policy" if operator else "clear_policy", name)
        else:
            self.run("operator-policy" if operator else "policy", "clear", name)
        self.names.remove((name, operator))

    def clear_all(self):
        for name, operator in list(self.names):
            self.clear(name, operator)


@pytest.fixture
def policies(broker):
    tool = PolicyTool(broker)
    yield tool
    tool.clear_all()


def count(ch, queue):
    return ch.queue_declare(queue, passive=True).method.message_count


def test_dead_lettering_and_ttl_set_by_policy(broker, policies, names):
    conn = broker.connect()
    try:
        ch = conn.channel()
        work, dead, dlx = names.queue("work"), names.queue("dead"), names.exchange("dlx")
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(dead)
        ch.queue_bind(dead, dlx)
        ch.queue_declare(work)  # the application's declare: no arguments
        policies.set(uniq("dlx"), f"^{work}$",
                     f'{{"dead-letter-exchange": "{dlx}", "message-ttl": 300}}')
        ch.confirm_delivery()
        ch.basic_publish("", work, b"expires")
        assert wait_until(lambda: count(ch, dead) == 1, timeout=10, conn=conn)
        [(props, body)] = [(p, b) for _, p, b in drain(ch, dead, 1)]
        assert body == b"expires"
        death = props.headers["x-death"][0]
        assert death["reason"] == "expired" and death["queue"] == work
    finally:
        conn.close()


def test_a_length_policy_trims_a_backlog_at_once(broker, policies, names):
    conn = broker.connect()
    try:
        ch = conn.channel()
        backlog = names.queue("backlog")
        ch.queue_declare(backlog)
        ch.confirm_delivery()
        for n in range(2000):
            ch.basic_publish("", backlog, b"%05d" % n + b"x" * 1019)
        assert count(ch, backlog) == 2000
        policies.set(uniq("cap"), f"^{backlog}$", '{"max-length": 100}')
        assert wait_until(lambda: count(ch, backlog) == 100, timeout=10, conn=conn)
        bodies = [body[:5] for _, _, body in drain(ch, backlog, 100)]
        assert bodies == [b"%05d" % n for n in range(1900, 2000)], "the newest stay"
    finally:
        conn.close()


def test_queue_arguments_win_or_the_lowest_number_does(broker, policies, names):
    """RabbitMQ's rules: for max-length the lower of argument and policy is in force; an
    operator policy is a ceiling over both; overflow from the argument wins."""
    conn = broker.connect()
    try:
        ch = conn.channel()
        low, high = names.queue("low"), names.queue("high")
        ch.queue_declare(low, arguments={"x-max-length": 2})
        ch.queue_declare(high, arguments={"x-max-length": 50, "x-overflow": "drop-head"})
        policies.set(uniq("p"), f"^({low}|{high})$",
                     '{"max-length": 5, "overflow": "reject-publish"}')
        # No confirms: `low` is reject-publish (from the policy) and nacks what is over.
        for n in range(10):
            ch.basic_publish("", low, b"%d" % n)
            ch.basic_publish("", high, b"%d" % n)
        assert count(ch, low) == 2
        assert count(ch, high) == 5
        # drop-head from the argument: the newest stay.
        assert [body for _, _, body in drain(ch, high, 5)] == [b"5", b"6", b"7", b"8", b"9"]
        policies.set(uniq("ops"), f"^{high}$", '{"max-length": 3}', operator=True)
        for n in range(10):
            ch.basic_publish("", high, b"%d" % n)
        assert count(ch, high) == 3
    finally:
        conn.close()


def test_max_priority_is_not_a_policy_key(broker, policies):
    if policies.rabbit:
        out = subprocess.run([*policies.base, "set_policy", "bad", ".*", '{"max-priority": 5}'],
                             capture_output=True, text=True, timeout=60, env=policies.env)
    else:
        out = subprocess.run([*policies.base, "policy", "set", "bad", ".*",
                              '{"max-priority": 5}'], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "not recognised policy settings" in out.stdout + out.stderr
