"""The archive's own retention (MQ_ARCHIVE_RETENTION_DAYS): whole (queue, day) partitions older
than it are deleted, both kinds, under the archive's lock: `manage.py prunearchive`, and on beat
after the archive run and its compaction (analytics.tasks).

Whole partitions, never rows: a partition is the archive's unit (its files, its fingerprint),
so a deletion costs a folder's removal whatever it holds, and the analytics see a partition
gone, not one changed: their next run drops its kept hour rows (analytics.analysis keeps only
the hour rows of partitions still listed) and recomputes nothing. A day is kept while it is
within the last N days (today, UTC, and the N days before it); unset (0), forever.
"""

import logging
import os
import time
from datetime import UTC, timedelta

from django.conf import settings
from django.utils import timezone
from pyarrow import fs as pafs

from . import archive, layout, partitions

log = logging.getLogger(__name__)


def oldest_kept_day(now, days):
    """The first day (YYYY-MM-DD, UTC) a retention of `days` keeps: today and the days before
    it, `days` of them."""
    return (now.astimezone(UTC) - timedelta(days=days)).strftime("%Y-%m-%d")


def prune_archive(*, root=None, days=None, now=None, budget_secs=None, wait_secs=0, progress=None):
    """Delete every partition whose day is before oldest_kept_day(now, days) (default
    MQ_ARCHIVE_RETENTION_DAYS; 0 deletes nothing). Returns {"partitions": n, "files": n,
    "bytes": n} deleted. Raises archive.ArchiveBusy if the lock is held. With `budget_secs`,
    starts no partition after that long (the next run goes on). Calls `progress(queue, day,
    files)` after each partition."""
    root = str(root or settings.MQ_ARCHIVE_DIR)
    days = settings.MQ_ARCHIVE_RETENTION_DAYS if days is None else days
    result = {"partitions": 0, "files": 0, "bytes": 0}
    if not days:
        return result
    before = oldest_kept_day(now or timezone.now(), days)
    started = time.monotonic()
    with archive.exclusive(root, wait_secs=wait_secs):
        # A batch left half done by a crash is finished first (as compaction does): it may
        # write into a day about to go, and is deleted with it rather than left to come back.
        for _ in archive.replay_journal(root):
            pass
        fs, base = layout.filesystem(root)
        for (queue, day), partition in sorted(partitions.list_archive(root).items()):
            if day >= before:
                continue
            if budget_secs is not None and time.monotonic() - started > budget_secs:
                log.info("prunearchive: budget of %s s spent, the next run goes on", budget_secs)
                break
            for kind in partitions.KINDS:
                _remove_partition(fs, layout.partition(base, kind, queue, day))
            result["partitions"] += 1
            result["files"] += len(partition.files)
            result["bytes"] += partition.bytes
            if progress is not None:
                progress(queue, day, len(partition.files))
    return result


def _remove_partition(fs, folder):
    """Delete the partition's folder (its data files and any temporary file a crash left)."""
    if fs.get_file_info(folder).type == pafs.FileType.NotFound:
        return
    fs.delete_dir(folder)
    if isinstance(fs, pafs.LocalFileSystem):
        parent = os.path.dirname(folder)
        layout.fsync_dir(parent)
        # The queue's folder goes with its last day: an empty one would list as nothing anyway.
        if not os.listdir(parent):
            os.rmdir(parent)
            layout.fsync_dir(os.path.dirname(parent))
