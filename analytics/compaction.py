"""Compaction: each closed (queue, day) partition of the archive becomes one file.

The hourly archive writes one file per (kind, queue, day) per batch, so a busy day collects
dozens of small files, and every reader pays for each one. A partition is closed once its day
is before yesterday (UTC): the hourly runs no longer write into it, normally (a message acked
late, or `archive --older-than-days`, may still add a file; the next compaction folds it in).
A closed partition with more than one data file gets one file holding all its rows sorted by
id (then message_id), named part-<min message id>-<max message id>.parquet like the archive's.

The content never changes: the same rows, every column as it was, each once.

How the switch is made, so that a crash at any step loses no row and leaves none twice:

- A local archive: the new partition folder is built whole under <root>/_staging/ (written,
  fsynced), then swapped with the live folder in one step by renameat2(RENAME_EXCHANGE), so a
  reader sees the old files or the new one, never both or neither; then the old folder, now
  under _staging/, is deleted. Whatever a crash leaves under _staging/ is a redundant copy
  (the new folder before the swap, the old one after), deleted at the next start.
- Another filesystem (s3://, gs://, hdfs://, or a local one without RENAME_EXCHANGE): the new
  file is written under _staging/, then a manifest naming the old files beside it; then the
  old files are deleted and the new file moved into place. This is NOT atomic to outside
  readers: one that lists the partition in between sees part of its rows, or none. Crash-safe
  all the same: a staged partition with a manifest is rolled forward at the next start (the
  old files deleted, the new one moved in), one without is deleted.

It runs under the archive's lock (analytics.archive.exclusive), after the archive's journal is
replayed (no batch is half written while it reads a partition), from the beat's archive task
and `manage.py compactarchive`.
"""

import ctypes
import errno
import json
import logging
import os
import shutil
import time
from collections import defaultdict
from datetime import UTC, timedelta

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from django.conf import settings
from django.utils import timezone
from pyarrow import fs as pafs

from . import archive, layout

log = logging.getLogger(__name__)

STAGING = "_staging"
MANIFEST = "_manifest.json"

# The column whose first and last value name a compacted file, and the sort order, per kind.
NAME_COLUMN = {layout.MESSAGES: "id", layout.DELIVERIES: "message_id"}
SORT_KEYS = {
    layout.MESSAGES: [("id", "ascending")],
    layout.DELIVERIES: [("id", "ascending"), ("message_id", "ascending")],
}

# renameat2's flag (linux/fs.h) and "relative to the working directory" (fcntl.h).
RENAME_EXCHANGE = 2
AT_FDCWD = -100


def compact_archive(*, root=None, now=None, budget_secs=None, wait_secs=0, progress=None):
    """Compact every closed partition with more than one file, under the archive's lock.

    Returns {"partitions": n compacted, "files_before": n, "files_after": n}, the files
    counting every data file of the archive. With `budget_secs`, starts no partition after
    that long (the next run goes on). Raises archive.ArchiveBusy if the lock is held. Calls
    `progress(kind, queue, day, files)` after each partition compacted.
    """
    root = str(root or settings.MQ_ARCHIVE_DIR)
    now = now or timezone.now()
    started = time.monotonic()
    with archive.exclusive(root, wait_secs=wait_secs):
        recover(root)
        for _ in archive.replay_journal(root):
            pass
        fs, base = layout.filesystem(root)
        partitions = data_files(fs, base)
        result = {"partitions": 0, "files_before": sum(map(len, partitions.values()))}
        result["files_after"] = result["files_before"]
        closed_before = (now.astimezone(UTC) - timedelta(days=1)).strftime("%Y-%m-%d")
        for (kind, queue, day), names in sorted(partitions.items()):
            if day >= closed_before or len(names) < 2:
                continue
            if budget_secs is not None and time.monotonic() - started > budget_secs:
                log.info("compaction: budget of %s s spent, the next run goes on", budget_secs)
                break
            if compact_partition(fs, base, kind, queue, day, names):
                result["partitions"] += 1
                result["files_after"] -= len(names) - 1
                if progress is not None:
                    progress(kind, queue, day, len(names))
        _remove_dir(fs, f"{base}/{STAGING}")
    return result


def data_files(fs, base):
    """{(kind, queue, day): [file names]} of the archive's data files (not temporary ones)."""
    found = defaultdict(list)
    for kind in (layout.MESSAGES, layout.DELIVERIES):
        top = f"{base}/{kind}"
        if fs.get_file_info(top).type != pafs.FileType.Directory:
            continue
        for info in fs.get_file_info(pafs.FileSelector(top, recursive=True)):
            if info.type != pafs.FileType.File or not info.base_name.endswith(".parquet"):
                continue
            if info.base_name.startswith((".", "_")):
                continue
            parts = info.path[len(top) + 1 :].split("/")
            if len(parts) == 3 and parts[0].startswith("queue=") and parts[1].startswith("day="):
                found[(kind, parts[0][len("queue=") :], parts[1][len("day=") :])].append(info.base_name)
    return {key: sorted(names) for key, names in found.items()}


def compact_partition(fs, base, kind, queue, day, names):
    """Replace the partition's files by one holding all their rows (see the module's doc).
    Returns False, changing nothing, when the files' schemas differ (no column is invented)."""
    folder = layout.partition(base, kind, queue, day)
    staged = layout.partition(f"{base}/{STAGING}", kind, queue, day)
    table = _merged(fs, folder, names, kind)
    if table is None:
        log.warning("compaction: %s has files of different schemas; left as it is", folder)
        return False
    column = table.column(NAME_COLUMN[kind])
    name = layout.part_name(pc.min(column).as_py(), pc.max(column).as_py())
    _remove_dir(fs, staged)
    layout.write_file(fs, staged, name, table, durable=True)
    if isinstance(fs, pafs.LocalFileSystem) and _exchange(staged, folder):
        # The swap is on disk before the old files go: a power cut cannot bring them back
        # beside a lost new file.
        layout.fsync_dir(os.path.dirname(folder))
        layout.fsync_dir(os.path.dirname(staged))
        _remove_dir(fs, staged)
        return True
    _write_manifest(fs, staged, {"folder": folder, "old": names, "new": name})
    _roll_forward(fs, staged)
    return True


def recover(root):
    """Clean what a crashed compaction left under <root>/_staging: roll forward a staged
    partition whose manifest says its old files are going, delete the rest."""
    fs, base = layout.filesystem(root)
    top = f"{base}/{STAGING}"
    if fs.get_file_info(top).type == pafs.FileType.NotFound:
        return
    for info in fs.get_file_info(pafs.FileSelector(top, recursive=True)):
        if info.type == pafs.FileType.File and info.base_name == MANIFEST:
            log.info("compaction: finishing the switch of %s", os.path.dirname(info.path))
            _roll_forward(fs, os.path.dirname(info.path))
    _remove_dir(fs, top)


def _merged(fs, folder, names, kind):
    tables = [pq.read_table(f"{folder}/{name}", filesystem=fs) for name in names]
    for name, table in zip(names, tables, strict=True):
        # A newer release's file is left alone, never rewritten as this release's version.
        layout.check_version(table.schema.metadata, f"{folder}/{name}")
    if any(t.schema != tables[0].schema for t in tables):
        return None
    merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return layout.stamped(_once_per_id(merged.sort_by(SORT_KEYS[kind]).combine_chunks()))


def _once_per_id(table):
    """Each id once. An archive written before the journal can hold a batch twice (a rerun
    after a crash cut its batches differently); the copies are the same acked rows, and the
    analytics count every row they read, so the compacted file keeps one. Sorted by id, a
    row's copies are neighbours."""
    ids = table.column("id")
    if len(ids) < 2:
        return table
    differs = pc.not_equal(ids.slice(1), ids.slice(0, len(ids) - 1))
    return table.filter(pa.concat_arrays([pa.array([True]), differs.combine_chunks()]))


def _write_manifest(fs, staged, manifest):
    # Written whole under a temporary name, then moved: a manifest that exists is complete.
    tmp = f"{staged}/.{MANIFEST}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(json.dumps(manifest).encode())
    fs.move(tmp, f"{staged}/{MANIFEST}")
    if isinstance(fs, pafs.LocalFileSystem):
        layout.fsync_dir(staged)


def _roll_forward(fs, staged):
    """Delete the old files the manifest names, move the new one in, drop the staged folder.
    Idempotent: the staged file stays until it is in place, and is the proof it is not yet."""
    with fs.open_input_stream(f"{staged}/{MANIFEST}") as f:
        manifest = json.loads(f.read())
    folder, new = manifest["folder"], manifest["new"]
    source = f"{staged}/{new}"
    if fs.get_file_info(source).type == pafs.FileType.File:
        for name in manifest["old"]:
            layout.remove_file(fs, f"{folder}/{name}")
        _move_in(fs, source, f"{folder}/{new}")
    _remove_dir(fs, staged)


def _move_in(fs, source, target):
    fs.create_dir(os.path.dirname(target), recursive=True)
    fs.move(source, target)
    if isinstance(fs, pafs.LocalFileSystem):
        layout.fsync_dir(os.path.dirname(target))


def _exchange(a, b):
    """Swap two local folders in one step; False where the kernel, filesystem or libc cannot
    (the caller then takes the manifest's way)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _remove_dir(fs, path):
    if isinstance(fs, pafs.LocalFileSystem):
        if os.path.isdir(path):
            shutil.rmtree(path)
        return
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)
