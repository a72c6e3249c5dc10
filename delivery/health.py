"""The health of the processes that do the work, for /healthz (mqsite.health): how many web and
worker processes are alive (their beats, delivery.liveness) and how long ago the sweep ran
(its Heartbeat row). Read path: one count per kind and one row, whatever the traffic."""

from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Q
from django.utils import timezone

from subscribers.models import Heartbeat, ServerProcess

from . import liveness

SWEEP = "sweep"


def swept(now=None):
    """The sweep ran (delivery.tasks.sweep): one row's update."""
    now = now or timezone.now()
    if not Heartbeat.objects.filter(name=SWEEP).update(at=now):
        Heartbeat.objects.update_or_create(name=SWEEP, defaults={"at": now})


def process_checks():
    """({"web": {"alive"}, "worker": {"alive"}, "sweep": {"last_run_s"}}, [problems])."""
    now = timezone.now()
    alive = ServerProcess.objects.aggregate(
        web=Count(
            "pk", filter=Q(kind="web", last_beat__gte=now - timedelta(seconds=liveness.DEAD_AFTER_SECS))
        ),
        worker=Count(
            "pk",
            filter=Q(kind="worker", last_beat__gte=now - timedelta(seconds=liveness.WORKER_DEAD_AFTER_SECS)),
        ),
    )
    last = Heartbeat.objects.filter(name=SWEEP).values_list("at", flat=True).first()
    age = None if last is None else round(max((now - last).total_seconds(), 0.0), 1)
    problems = []
    if not alive["worker"]:
        problems.append("no worker is alive")
    if age is None or age > settings.MQ_HEALTH_SWEEP_SECS:
        problems.append("the sweep has not run" if age is None else f"the sweep last ran {age} s ago")
    figures = {
        "web": {"alive": alive["web"]},
        "worker": {"alive": alive["worker"]},
        "sweep": {"last_run_s": age},
    }
    return figures, problems
