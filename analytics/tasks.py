"""Celery tasks of the analytics, on beat: the archive (CELERY_BEAT_SCHEDULE["archive"], on the
maintenance queue) and the analysis ("analyze", on the analytics queue: a Spark run of minutes
must not hold up the per-second sweep)."""

import logging
import time

from celery import shared_task
from django.conf import settings

from .models import AnalyticsFailure

# The modules of the work itself (pyarrow, numpy, PySpark: half a CPU second and tens of MB)
# are imported by the task that runs it, not by every Celery process that lists the tasks
# (the worker of the sweeps and webhooks, beat) when it starts.

log = logging.getLogger(__name__)

# Stop starting new batches (then partitions) after this long, well inside the hard time limit:
# a large backlog is archived over several runs instead of being killed halfway through one
# (which would be safe, but would redo that batch's files).
BUDGET_SECS = max(settings.CELERY_TASK_SOFT_TIME_LIMIT - 60, 30)
# An analysis holds the archive while it reads it (tens of seconds at millions of rows): wait
# that long rather than skip the hour. The wait comes out of the budget.
LOCK_WAIT_SECS = min(60, BUDGET_SECS // 2)


@shared_task(acks_late=True)
def archive_history():
    """Archive what has passed its queue's retention, then compact the closed partitions with
    what is left of the budget (a backlog's archiving comes first; closed partitions wait).
    Harmless when run twice, or while another run holds the archive (it then does nothing)."""
    from . import archive, compaction

    started = time.monotonic()
    try:
        moved = archive.archive_history(budget_secs=BUDGET_SECS - LOCK_WAIT_SECS, wait_secs=LOCK_WAIT_SECS)
    except archive.ArchiveBusy as exc:
        log.info("archive: %s; skipping this run", exc)
        return None
    if moved["messages"]:
        log.info("archive: moved %(messages)s messages and %(deliveries)s deliveries", moved)
    left = BUDGET_SECS - (time.monotonic() - started)
    if left > 0:
        try:
            compacted = compaction.compact_archive(budget_secs=left)
        except archive.ArchiveBusy as exc:
            log.info("compaction: %s; skipping it this run", exc)
        else:
            if compacted["partitions"]:
                log.info(
                    "compaction: %(partitions)s partitions, %(files_before)s files now %(files_after)s",
                    compacted,
                )
    prune_archive(BUDGET_SECS - (time.monotonic() - started))
    return moved


def prune_archive(left):
    """The archive's retention (MQ_ARCHIVE_RETENTION_DAYS), with what is left of the budget:
    last, since a day past it is deleted whole whenever it comes."""
    if left <= 0 or not settings.MQ_ARCHIVE_RETENTION_DAYS:
        return
    from . import archive, retention

    try:
        pruned = retention.prune_archive(budget_secs=left)
    except archive.ArchiveBusy as exc:
        log.info("prunearchive: %s; skipping it this run", exc)
        return
    if pruned["partitions"]:
        log.info("prunearchive: deleted %(partitions)s partitions, %(files)s files", pruned)


# A run is not acked late: beat starts another at its next interval anyway, and a redelivery
# (a worker lost mid-run, or a run past Redis's visibility timeout) would only start a second
# run beside the first. The hard limit frees the worker from a stuck JVM; it is far beyond a
# full recomputation of the history.
ANALYZE_TIME_LIMIT_SECS = 4 * 3600


# Both given: a task's None would mean the global CELERY_TASK_SOFT_TIME_LIMIT (4 minutes).
@shared_task(
    acks_late=False, time_limit=ANALYZE_TIME_LIMIT_SECS, soft_time_limit=ANALYZE_TIME_LIMIT_SECS - 60
)
def analyze():
    """Compute and load the statistics (analytics.analysis.run_analysis). Harmless when run
    twice: a run while another holds the analysis does nothing. A run that fails is logged
    and recorded (AnalyticsFailure), and the next interval's runs again: the stored figures
    stay the last good run's, which /metrics and the API show with their age and the failure."""
    from . import analysis

    try:
        analysis.run_analysis()
    except analysis.AnalysisBusy as exc:
        log.info("analyze: %s; skipping this run", exc)
        return "busy"
    except Exception as exc:  # whatever broke (the soft time limit too), say it and go on
        log.exception("analyze: the run failed; the stored figures stay the last good run's")
        _record_failure(exc)
        return "failed"
    return "done"


def _record_failure(exc):
    try:
        AnalyticsFailure.record(f"{type(exc).__name__}: {exc}")
    except Exception:  # the database may be what failed: the log above has it anyway
        log.exception("analyze: could not record the failed run")
