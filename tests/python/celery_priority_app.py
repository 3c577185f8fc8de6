"""The Celery app test_priorities.py runs a real worker on: one task that appends its
label to a file, so the test sees the order tasks ran in. Configured from the
environment the test sets."""

import os

from celery import Celery

app = Celery("spillway_priorities", broker=os.environ["SPILLWAY_CELERY_BROKER"])
app.conf.update(
    task_default_queue=os.environ["SPILLWAY_CELERY_QUEUE"],
    task_queue_max_priority=10,
    task_default_priority=0,
    broker_connection_retry_on_startup=False,
    task_ignore_result=True,
)


@app.task(name="record")
def record(label):
    with open(os.environ["SPILLWAY_CELERY_LOG"], "a") as log:
        log.write(label + "\n")
