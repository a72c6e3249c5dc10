"""The Celery app: webhook posts and the sweeper. Redis carries the jobs in the services mode,
a folder under var/ in the embedded mode. Either way the ledger is the truth: a lost job costs
time, never a message, because the sweeper finds due work in the database again."""

import logging
import os

from celery import Celery
from celery.signals import (
    celeryd_init,
    setup_logging,
    task_prerun,
    worker_init,
    worker_ready,
    worker_shutdown,
)

from mqsite import heap, log_context, prometheus, tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

app = Celery("mqsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _trace(**kwargs):
    """OTEL_*: spans of this worker's jobs and webhook posts (mqsite.tracing), set up before
    its pool starts."""
    tracing.start("worker")


@worker_ready.connect
def _freeze_startup_heap(**kwargs):
    """Once the worker is ready (its tasks imported, its pool started): mqsite.heap."""
    heap.freeze()


@celeryd_init.connect
def _serving(sender=None, **kwargs):
    """A worker's process_* figures on /metrics, as its node name's role (webhooks@host: webhooks)."""
    prometheus.register_process(str(sender or "celery").partition("@")[0])


@worker_shutdown.connect
def _not_serving(**kwargs):
    """Stopping (a cold shutdown may skip the interpreter's exit hooks): its process_* go."""
    prometheus.exiting()


@setup_logging.connect
def _log_as_the_web_does(loglevel=None, **kwargs):
    """A worker logs as every process does (settings.LOGGING: MQ_LOG_FORMAT, the ids, tokens
    blanked) at the level its command line asks (-l), not in Celery's own format."""
    from django.conf import settings

    log_context.configure(settings.LOGGING)
    if loglevel:
        logging.getLogger().setLevel(loglevel)


@task_prerun.connect
def _bind_the_task(task_id=None, **kwargs):
    """A job's log lines carry its id, and none of the ids an earlier job of the same thread
    bound (a job binds what it is about itself: a webhook job its subscriber)."""
    log_context.bind(**{**dict.fromkeys(log_context.FIELDS), "task_id": task_id})
