"""A run with nothing new takes the current run's figures, and makes anew only what the clock moves.

Every figure of a run over the whole history is a function of three things: the archive's
partitions (their fingerprints), the hot tables' hour rows, and the run's `now`. Of `now`, only
two: the subscribers' oldest pending age and the windows (the last hour, the last 24 hours). So
when the archive lists the same fingerprints and the hot tables give the same hour rows as for
the current run (one digest of both, `inputs`, kept in each run's manifest), a run takes that
run's files as they are (hard links: the hour rows, the event stats, the trends) and computes
only those two:

- the ages, from each subscriber's oldest pending delivery (SUBSCRIBER_OLDEST, kept by every run);
- the windows, from the archive's hour rows of every hour a later window can reach (RECENT_*, the
  hours from the run's own longest window on: a later `now` only starts its windows later) and
  the hot tables' rows, by the same code as a full run.

A rerun over months of history then reads kilobytes instead of the archive's hour rows (tens
of MB) and sorts no sketch: bench/README.md has the numbers. The figures are the same, to the
bit, as a full run's at the same `now` (tests/analytics/test_reuse.py). Any difference in the
inputs, a window of days (--since/--until), a `now` whose windows reach before the hours kept,
another release or analytics code, or a current run without these files, and the run is a
full one.
"""

import functools
import hashlib
from datetime import datetime
from pathlib import Path

import pyarrow as pa

from mqsite.version import VERSION

from . import figures, layout, load, runs, windows

RECENT = {"events": "recent_event_hours.parquet", "subscribers": "recent_subscriber_hours.parquet"}
SUBSCRIBER_OLDEST = "subscriber_oldest.parquet"
# What a run with nothing new takes from the current run unchanged.
SHARED = ("event_stats.parquet", "event_trends.parquet", "subscriber_trends.parquet", *RECENT.values())

LONGEST = max(windows.WINDOWS.values())


@functools.cache
def _code():
    """The digest of the analytics package's source: a deployment of unreleased code (the
    same VERSION) that computes a figure otherwise, or adds one, must not take the last run's."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def inputs(listing, hot):
    """The digest of what a run's figures are made of, but the time: this release and its
    analytics code, the archive's partitions (analytics.partitions.list_archive) and the hot
    tables' hour rows ({"events": ..., "subscribers": ...} Arrow tables). Tables of equal rows
    in another order digest apart (then a full run: slower, never wrong)."""
    digest = hashlib.sha256(f"{VERSION}\0{_code()}".encode())
    for key in sorted(listing):
        digest.update("\0".join((*key, listing[key].fingerprint, "\n")).encode())
    for name in ("events", "subscribers"):
        sink = pa.BufferOutputStream()
        table = hot[name].combine_chunks()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        digest.update(sink.getvalue())
    return digest.hexdigest()


def reusable(out, digest, now):
    """The current run's manifest when its figures can be this run's (same inputs, and its
    recent hour rows reach back to this run's longest window), else None."""
    current = runs.current(out)
    if current is None:
        return None
    try:
        manifest = runs.read_manifest(out, current)
    except (OSError, runs.BadRun, ValueError):
        return None
    kept, window = manifest.get("reuse") or {}, manifest.get("window") or {}
    if kept.get("inputs") != digest or window.get("since") or window.get("until"):
        return None
    if windows.start_of(now, LONGEST) < datetime.fromisoformat(kept["recent_since"]):
        return None
    return manifest


def keep(folder, archived, oldest, now, digest, figures_of):
    """Write what a later run with nothing new needs into the run `folder`: the archive's hour
    rows from this run's longest window on, each subscriber's oldest pending delivery. Returns
    the manifest's "reuse" entry."""
    since = windows.start_of(now, LONGEST)
    for name, file in RECENT.items():
        layout.write_run_file(folder, file, figures.from_hour(archived[name], since))
    layout.write_run_file(folder, SUBSCRIBER_OLDEST, oldest)
    return {"inputs": digest, "recent_since": since.isoformat(), "figures_of": figures_of}


def results(out, manifest, folder, hot, now):
    """(event stats, subscriber stats, event windows, subscriber windows) of a run with nothing
    new at `now`, the current run's (`manifest`) files shared into `folder`, and the manifest's
    "reuse" entry. The stats as dicts, as analytics.figures gives them."""
    source = runs.run_path(out, manifest["run_id"])
    for file in (*SHARED, SUBSCRIBER_OLDEST):
        layout.share_file(f"{source}/{file}", folder, file)
    event_stats = load.read_table(source, "event_stats.parquet").to_pylist()
    subscriber_stats = load.read_table(source, "subscriber_stats.parquet")
    oldest = load.read_table(source, SUBSCRIBER_OLDEST)
    if not subscriber_stats["subscriber"].equals(oldest["subscriber"]):
        raise runs.BadRun(f"run {manifest['run_id']}: {SUBSCRIBER_OLDEST} is not of its subscriber stats")
    ages = figures.pending_ages(oldest["oldest_pending_at"], now)
    at = subscriber_stats.schema.get_field_index("oldest_pending_age_s")
    subscriber_stats = subscriber_stats.set_column(at, subscriber_stats.field(at), ages)
    rows = {
        name: pa.concat_tables([load.read_table(source, file).cast(hot[name].schema), hot[name]])
        for name, file in RECENT.items()
    }
    event_windows, subscriber_windows = figures.window_figures(rows, now)
    return (event_stats, subscriber_stats.to_pylist(), event_windows, subscriber_windows), manifest["reuse"]
