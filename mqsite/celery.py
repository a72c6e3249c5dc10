"""The Celery app: webhook posts and the sweeper. Redis carries the jobs in the services mode,
a folder under var/ in the embedded mode. Either way the ledger is the truth: a lost job costs
time, never a message, because the sweeper finds due work in the database again."""

import os

from celery import Celery
from celery.signals import worker_ready

from mqsite import heap

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

app = Celery("mqsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _freeze_startup_heap(**kwargs):
    """Once the worker is ready (its tasks imported, its pool started): mqsite.heap."""
    heap.freeze()
