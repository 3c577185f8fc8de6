"""Priority queues with pika and with Celery: higher priorities first, equal ones in
publish order, RabbitMQ's refusals of a bad x-max-priority; Celery's priority tasks
(task_queue_max_priority, priority= on apply_async) overtaking a backlog. Every test here
also passes against RabbitMQ 3.10 (tests/python/with-rabbitmq.sh)."""

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pika
import pika.exceptions as pe
import pytest

from spillway_testlib import drain


def test_higher_priorities_first_equal_ones_in_order(ch, names):
    q = names.queue()
    ch.queue_declare(q, arguments={"x-max-priority": 10})
    ch.confirm_delivery()
    for body, priority in [(b"a0", None), (b"b7", 7), (b"c10", 10), (b"d99", 99), (b"e7", 7),
                           (b"f1", 1), (b"g0", 0)]:
        ch.basic_publish("", q, body, pika.BasicProperties(priority=priority))
    assert [b for _, _, b in drain(ch, q)] == [b"c10", b"d99", b"b7", b"e7", b"f1", b"a0",
                                               b"g0"]


@pytest.mark.parametrize("value, why", [
    (256, "{max_value_exceeded,256}"),
    (-1, "{value_negative,-1}"),
    ("5", '"expected integer, got longstr"'),
])
def test_a_bad_maximum_is_refused_in_rabbitmqs_words(conn, names, value, why):
    q = names.queue()
    ch = conn.channel()
    with pytest.raises(pe.ChannelClosedByBroker) as refused:
        ch.queue_declare(q, arguments={"x-max-priority": value})
    assert refused.value.reply_code == 406
    assert refused.value.reply_text == (
        f"PRECONDITION_FAILED - invalid arg 'x-max-priority' for queue '{q}' in vhost '/': "
        f"{why}")


def test_celery_priority_tasks_overtake_a_backlog(broker, names, tmp_path):
    """A backlog of low-priority tasks is waiting when high-priority ones are sent; a real
    worker (solo pool, one task at a time), started afterwards, runs every high-priority
    task before the backlog."""
    queue = names.queue()
    log = tmp_path / "ran.log"
    env = dict(os.environ, SPILLWAY_CELERY_BROKER=broker.kombu_url, SPILLWAY_CELERY_QUEUE=queue,
               SPILLWAY_CELERY_LOG=str(log), PYTHONPATH=str(Path(__file__).parent))
    os.environ.update({k: env[k] for k in ("SPILLWAY_CELERY_BROKER", "SPILLWAY_CELERY_QUEUE",
                                           "SPILLWAY_CELERY_LOG")})
    try:
        import celery_priority_app as tasks
        importlib.reload(tasks)  # this test's broker and queue
        for n in range(20):
            tasks.record.apply_async((f"low-{n}",), priority=0)
        for n in range(5):
            tasks.record.apply_async((f"high-{n}",), priority=9)
    finally:
        for k in ("SPILLWAY_CELERY_BROKER", "SPILLWAY_CELERY_QUEUE", "SPILLWAY_CELERY_LOG"):
            os.environ.pop(k, None)

    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_priority_app", "worker", "--pool=solo",
         "--concurrency=1", "--prefetch-multiplier=100", "--without-heartbeat",
         "--without-mingle", "--without-gossip", "--loglevel=WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        ran = []
        while len(ran) < 25:
            assert worker.poll() is None, f"the worker exited: {worker.stderr.read()}"
            assert time.monotonic() < deadline, f"only {len(ran)} tasks ran: {ran}"
            time.sleep(0.05)  # polling the worker's log, not waiting a fixed time
            ran = log.read_text().split() if log.exists() else []
    finally:
        worker.terminate()
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    assert ran[:5] == [f"high-{n}" for n in range(5)]
    assert ran[5:] == [f"low-{n}" for n in range(20)]
    # The queue Celery declared is a priority queue.
    with broker.connect() as conn:
        ch = conn.channel()
        with pytest.raises(pe.ChannelClosedByBroker) as inequivalent:
            ch.queue_declare(queue, durable=True)
        assert inequivalent.value.reply_code == 406
        assert "x-max-priority" in inequivalent.value.reply_text
