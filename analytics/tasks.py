"""Celery tasks of the analytics, on beat: the archive (CELERY_BEAT_SCHEDULE["archive"], on the
maintenance queue) and the analysis ("analyze", on the analytics queue: a Spark run of minutes
must not hold up the per-second sweep)."""

import logging

from celery import shared_task
from django.conf import settings

from . import analysis, archive

log = logging.getLogger(__name__)

# Stop starting new batches after this long, well inside the hard time limit: a large backlog
# is archived over several runs instead of being killed halfway through one (which would be
# safe, but would redo that batch's files).
BUDGET_SECS = max(settings.CELERY_TASK_SOFT_TIME_LIMIT - 60, 30)


@shared_task(acks_late=True)
def archive_history():
    """Archive what has passed its queue's retention. Harmless when run twice, or while
    another run holds the archive (it then does nothing)."""
    try:
        moved = archive.archive_history(budget_secs=BUDGET_SECS)
    except archive.ArchiveBusy as exc:
        log.info("archive: %s; skipping this run", exc)
        return None
    if moved["messages"]:
        log.info("archive: moved %(messages)s messages and %(deliveries)s deliveries", moved)
    return moved


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
    twice: a run while another holds the analysis does nothing."""
    try:
        analysis.run_analysis()
    except analysis.AnalysisBusy as exc:
        log.info("analyze: %s; skipping this run", exc)
        return "busy"
    return "done"
