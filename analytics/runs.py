"""The run folders of the analytics, and which of them is current.

    <out>/runs/<run_id>/manifest.json         what the run covered and how long it took
    <out>/runs/<run_id>/event_stats.parquet   ... and its results (analytics.load reads them)
    <out>/CURRENT                             the run_id readers should use

A run writes its own folder and nothing else; only `switch` makes it the one readers see, by
replacing CURRENT whole (a reader sees the old run id or the new one, never half of either).
So a run that dies halfway leaves a folder nobody reads, which `prune` removes later, and a
reader never meets a mix of two runs' files.

Run ids sort as their start times (UTC, to the microsecond), then a random suffix so that two
runs started in the same instant (two hosts) never share a folder. `out` is a local path or a
URI pyarrow knows (analytics.layout.filesystem).
"""

import json
import re
import secrets
from datetime import UTC, datetime

from pyarrow import fs as pafs

from . import layout

RUNS = "runs"
CURRENT = "CURRENT"
MANIFEST = "manifest.json"
RUN_ID_RE = re.compile(r"^\d{8}T\d{12}Z-[0-9a-f]{6}$")


class BadRun(ValueError):
    """A run id that is not one, or a run folder without its manifest."""


def new_run_id(now=None):
    """A fresh run id: '20261125T121300123456Z-3fa9c1' (sorts by start time)."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{now:%Y%m%dT%H%M%S%f}Z-{secrets.token_hex(3)}"


def _checked(run_id):
    # The id becomes a path: anything else (a '..', a slash) must never reach the filesystem.
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise BadRun(f"not a run id: {run_id!r}")
    return run_id


def _base(out):
    return str(out).rstrip("/")


def run_path(out, run_id):
    """The run's folder, in the form `out` was given (a path or a URI)."""
    return f"{_base(out)}/{RUNS}/{_checked(run_id)}"


def read_manifest(out, run_id):
    """The run's manifest as a dict; BadRun when the run has none (it did not finish)."""
    fs, base = layout.filesystem(_base(out))
    path = f"{base}/{RUNS}/{_checked(run_id)}/{MANIFEST}"
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError as exc:
        raise BadRun(f"run {run_id} has no {MANIFEST} (unfinished or removed)") from exc


def current(out):
    """The current run's id, or None before the first switch."""
    fs, base = layout.filesystem(_base(out))
    try:
        with fs.open_input_stream(f"{base}/{CURRENT}") as f:
            text = f.read().decode("utf-8").strip()
    except FileNotFoundError:
        return None
    return text if RUN_ID_RE.match(text) else None


def switch(out, run_id):
    """Make `run_id` the current run, atomically. Refused (BadRun) for a run without its
    manifest: the manifest is written last, so a run without one is unfinished."""
    read_manifest(out, run_id)
    fs, base = layout.filesystem(_base(out))
    layout.write_whole(
        fs, base, CURRENT, lambda out: out.write((run_id + "\n").encode("ascii")), durable=True
    )


def run_ids(out):
    """The ids of the run folders under `out`, oldest first (finished or not)."""
    fs, base = layout.filesystem(_base(out))
    selector = pafs.FileSelector(f"{base}/{RUNS}", allow_not_found=True)
    return sorted(
        info.base_name
        for info in fs.get_file_info(selector)
        if info.type == pafs.FileType.Directory and RUN_ID_RE.match(info.base_name)
    )


def prune(out, keep=3):
    """Delete the run folders older than the `keep` newest up to the current run (which counts
    as one of them); returns the ids deleted. Never the current run, nor one newer than it:
    that is a run still writing (or one that failed, which the next prune after a newer switch
    removes). Nothing before the first switch."""
    if keep < 1:
        raise ValueError("keep at least the current run")
    now_current = current(out)
    if now_current is None:
        return []
    older = [r for r in run_ids(out) if r < now_current]
    doomed = older[: max(len(older) - (keep - 1), 0)]
    fs, base = layout.filesystem(_base(out))
    for run_id in doomed:
        fs.delete_dir(f"{base}/{RUNS}/{run_id}")
    return doomed
