"""Celery tasks of the analytics: the archive, on beat (CELERY_BEAT_SCHEDULE["archive"])."""

import logging
import time

from celery import shared_task
from django.conf import settings

from . import archive, compaction

log = logging.getLogger(__name__)

# Stop starting new batches (then partitions) after this long, well inside the hard time limit:
# a large backlog is archived over several runs instead of being killed halfway through one
# (which would be safe, but would redo that batch's files).
BUDGET_SECS = max(settings.CELERY_TASK_SOFT_TIME_LIMIT - 60, 30)


@shared_task(acks_late=True)
def archive_history():
    """Archive what has passed its queue's retention, then compact the closed partitions with
    what is left of the budget (a backlog's archiving comes first; closed partitions wait).
    Harmless when run twice, or while another run holds the archive (it then does nothing)."""
    started = time.monotonic()
    try:
        moved = archive.archive_history(budget_secs=BUDGET_SECS)
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
    return moved
