"""The analytics run behind `manage.py analyze` and the beat's "analyze": incremental by day.

    archive partitions --list--> changed ones --Arrow (up to MQ_ANALYTICS_LOCAL_BYTES)
                                                or Spark (past it)--> hour rows, kept in the run folder
    hot tables --COPY--> Arrow snapshot --less what is archived--> hour rows (Arrow, or Spark if big)
    hour rows --figures--> event and subscriber stats, trends --> run folder --switch--> loaded

A run lists the archive's (queue, day) partitions and their fingerprints (analytics.partitions).
The hour rows of every partition whose fingerprint the current run folder already holds are
kept; only the others are recomputed: in this process with Arrow, a partition at a time on
every core, when they are at most MQ_ANALYTICS_LOCAL_BYTES of Parquet (the last hour's files,
or a first run over a history of a few million deliveries: far cheaper than a JVM's start),
else by Spark. The hot tables are small: their hour rows are computed in this process unless
they pass MQ_ANALYTICS_HOT_SPARK_ROWS. So a run with no archived day changed starts no Spark job.

One run at a time per archive, and none while the archive or its compaction writes: the run
holds the archive's lock (analytics.archive.exclusive) from the listing to the last file Spark
reads, so the files it listed are the files it reads, and the snapshot and the archive never
disagree except by the overlap analytics.overlap removes.

Results go to a new run folder (analytics.runs), switched to atomically once complete, then
loaded into the tables the admin, /metrics and GET /api/analytics read. A run over a window of
days (since/until) computes and returns its figures, and writes its folder, but does not
become the current run: the stored figures stay those of the whole history.
"""

import dataclasses
import functools
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from django.conf import settings
from django.utils import timezone

from mqsite.workarounds import spark_jvm

from . import (
    archive,
    extract,
    figures,
    hours,
    job,
    layout,
    load,
    overlap,
    partitions,
    reuse,
    runs,
    spark_settings,
    stored,
)

log = logging.getLogger(__name__)

# A driver JVM started by a run ends with the process running it, even while it starts.
spark_jvm.install()

# Below this much Parquet to read, a local run is over before the JVM's optimising compiler
# pays for itself: measured on the 5 M archive (182 MB), the quick compiler alone makes the
# first pass 2.6 s shorter and each later one 3.2 s longer, so it breaks even near 330 MB.
QUICK_JIT_BYTES = 256 * 1024 * 1024

# The in-process reduction's batches: at most this much Parquet (about 2 million deliveries).
LOCAL_BATCH_BYTES = 64 * 1024 * 1024

EVENT_HOURS = "archive_event_hours.parquet"
SUBSCRIBER_HOURS = "archive_subscriber_hours.parquet"


class AnalysisBusy(RuntimeError):
    """Another analysis, the archive or its compaction holds the archive."""


def default_out():
    return f"{str(settings.MQ_ARCHIVE_DIR).rstrip('/')}/_analytics"


def run_analysis(*, now=None, out=None, master=None, since=None, until=None, progress=None):
    """Compute the figures, store them (unless over a window) and return them as `analyze
    --json` prints them. Raises AnalysisBusy when the archive is held past
    MQ_ANALYZE_LOCK_WAIT_SECS. Calls `progress(what)` after each step (a first run reads the
    whole archive in Spark, minutes of silence otherwise)."""
    progress = progress or _quiet
    root = _spark_path(settings.MQ_ARCHIVE_DIR)
    out = _spark_path(out or default_out())
    try:
        with archive.exclusive(root, wait_secs=settings.MQ_ANALYZE_LOCK_WAIT_SECS):
            progress("holds the archive")
            snapshot = extract.hot_snapshot()
            progress(f"read the hot tables ({snapshot.deliveries.num_rows} deliveries)")
            run = compute(
                root,
                out,
                snapshot,
                now=now or timezone.now(),
                master=master,
                since=since,
                until=until,
                progress=progress,
            )
    except archive.ArchiveBusy as exc:
        raise AnalysisBusy(str(exc)) from exc
    if since is None and until is None:
        runs.switch(out, run.run_id)
        load.load_run(out, run.run_id)
        runs.prune(out)
        progress("stored the results")
    return stored.as_json(run.event_stats, run.subscriber_stats)


@dataclass
class Run:
    run_id: str
    manifest: dict
    event_stats: list
    subscriber_stats: list
    event_windows: list
    subscriber_windows: list
    folder: str

    # The trends are millions of rows on a long history: read from the folder when asked for
    # (a run with nothing new shares the last run's files and never reads them).
    @functools.cached_property
    def event_trends(self):
        return load.read_table(self.folder, "event_trends.parquet")

    @functools.cached_property
    def subscriber_trends(self):
        return load.read_table(self.folder, "subscriber_trends.parquet")


def _quiet(what):
    pass


@dataclass
class Hot:
    """The hot tables' snapshot with what the archive holds removed and each row's day, and its
    hour rows ({"events", "subscribers"}; None when it goes to Spark, past
    MQ_ANALYTICS_HOT_SPARK_ROWS deliveries)."""

    snapshot: extract.HotSnapshot
    overlapping: int
    in_spark: bool
    rows: dict | None


def compute(root, out, snapshot, *, now, master=None, since=None, until=None, progress=_quiet):
    """One run over the archive under `root` and the hot tables' `snapshot` (an
    extract.HotSnapshot), written to a new run folder under `out` (not switched to). No
    database: the caller holds the lock and took the snapshot."""
    started_at, started = timezone.now(), time.monotonic()
    run_id = runs.new_run_id()
    folder = runs.run_path(out, run_id)
    listing = partitions.list_archive(root)
    hot = _hot(snapshot, listing)
    # A run over the whole history whose inputs are the current run's takes its figures
    # (analytics.reuse); the windows of days and big hot tables always compute theirs.
    digest = reuse.inputs(listing, hot.rows) if since is None and until is None and hot.rows else None
    previous = reuse.reusable(out, digest, now) if digest else None
    taken = _taken(out, previous, folder, hot, now) if previous is not None else None
    if taken is not None:
        results, kept = taken
        facts = _facts(listing, {}, [], hot, spark=False) | {"figures_of": kept["figures_of"]}
        progress(f"took the figures of run {previous['run_id']} (nothing new since)")
    else:
        # The hour rows' files, the subscribers' figures and the events' are independent: on
        # threads, as Arrow and numpy leave the GIL (a 120-day first run: 3.6 s one after
        # another on 2 cores).
        with _Beside() as pool:
            rows, archived, facts = _hour_rows(
                root, out, folder, listing, hot, master, since, until, progress, pool
            )
            subscribers = pool.submit(
                figures.subscriber_results, rows["subscribers"], now=now, since=since, until=until
            )
            event_stats, event_trends = figures.event_figures(rows["events"], since=since, until=until)
            pool.submit(layout.write_run_file, folder, "event_trends.parquet", event_trends)
            subscriber_stats, subscriber_trends, oldest = subscribers.result()
            pool.submit(layout.write_run_file, folder, "subscriber_trends.parquet", subscriber_trends)
            results = (event_stats, subscriber_stats, *figures.window_figures(rows, now))
            layout.write_run_file(folder, "event_stats.parquet", _result_table("event_stats", event_stats))
            kept = reuse.keep(folder, archived, oldest, now, digest, run_id) if digest else None
        progress("computed the figures")
    event_stats, subscriber_stats, event_windows, subscriber_windows = results
    for name, rows in (
        ("subscriber_stats", subscriber_stats),
        ("event_windows", event_windows),
        ("subscriber_windows", subscriber_windows),
    ):
        layout.write_run_file(folder, f"{name}.parquet", _result_table(name, rows))
    manifest = {
        "run_id": run_id,
        "started_at": started_at.isoformat(),
        "finished_at": timezone.now().isoformat(),
        "duration_s": round(time.monotonic() - started, 3),
        "now": now.isoformat(),
        "window": {
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
        },
        **facts,
        "reuse": kept,
    }
    _write_bytes(folder, "manifest.json", json.dumps(manifest, indent=1).encode())
    log.info(
        "analyze: %s partitions recomputed, %s reused, Spark %s, %.1f s",
        facts["partitions"]["recomputed"],
        facts["partitions"]["reused"],
        "used" if facts["spark"] else "not used",
        manifest["duration_s"],
    )
    return Run(run_id, manifest, event_stats, subscriber_stats, event_windows, subscriber_windows, folder)


class _Beside(ThreadPoolExecutor):
    """Threads for work beside the caller's; leaving it waits for every task and raises the
    first one's error, as if done in line (a file that cannot be written fails the run). Three:
    the hour rows' two files and the subscribers' figures start at once."""

    def __init__(self):
        super().__init__(max_workers=3)
        self._futures = []

    def submit(self, fn, /, *args, **kwargs):
        future = super().submit(fn, *args, **kwargs)
        self._futures.append(future)
        return future

    def __exit__(self, *exc_info):
        super().__exit__(*exc_info)
        if exc_info[0] is None:
            for future in self._futures:
                future.result()
        return False


def _taken(out, previous, folder, hot, now):
    """reuse.results of the current run (`previous`, its manifest), its hour rows shared into
    `folder` too; None when its files cannot be read (removed by hand, half copied): then the
    run computes its figures."""
    try:
        taken = reuse.results(out, previous, folder, hot.rows, now)
        _share_hour_rows(out, previous["run_id"], folder)
    except (OSError, pa.ArrowException, runs.BadRun) as exc:
        log.warning("analyze: cannot take run %s's figures (%s); computing them", previous["run_id"], exc)
        return None
    return taken


def _share_hour_rows(out, run_id, folder):
    """The archive's hour rows of run `run_id` are those of the run in `folder` too (linked)."""
    for file in (EVENT_HOURS, SUBSCRIBER_HOURS):
        layout.share_file(f"{runs.run_path(out, run_id)}/{file}", folder, file)


def _result_table(name, rows):
    return pa.Table.from_pylist(rows, schema=figures.RESULT_SCHEMAS[name])


def _hot(snapshot, listing):
    """The snapshot as a run reads it (Hot)."""
    # Each hot row with the day the archive will file it under: a window of days (since/until)
    # then takes a replayed delivery with its message, whether it is archived yet or not; and
    # the archive's partitions of those days are where an archived copy would be.
    messages, deliveries = layout.partition_days(snapshot.messages, snapshot.deliveries)
    snapshot = dataclasses.replace(snapshot, messages=messages, deliveries=deliveries)
    snapshot, overlapping = overlap.drop_archived(snapshot, listing)
    in_spark = snapshot.deliveries.num_rows > settings.MQ_ANALYTICS_HOT_SPARK_ROWS
    rows = None if in_spark else _derived(hours.parts(snapshot.messages, snapshot.deliveries))
    return Hot(snapshot, overlapping, in_spark, rows)


def _hour_rows(root, out, folder, listing, hot, master, since, until, progress, pool):
    """(the hour rows of the archive's partitions within the window and of the hot tables, the
    archive's hour rows of every partition, what it took). Writes the latter (all partitions
    known, in or out of the window) to the run folder for the next run, on a thread of `pool`
    (a ThreadPoolExecutor its caller waits for)."""
    chosen = {key: p for key, p in listing.items() if figures.in_window(p.day, since, until)}
    current = runs.current(out)
    kept, whole = _kept_hours(out, current, {p.fingerprint for p in listing.values()})
    have = set(kept["events"]["fingerprint"].to_pylist()) | set(
        kept["subscribers"]["fingerprint"].to_pylist()
    )
    missing = sorted(
        (p for p in chosen.values() if p.fingerprint not in have), key=lambda p: (p.queue, p.day)
    )
    # What fits MQ_ANALYTICS_LOCAL_BYTES (a first run over a modest history, the last hour's
    # files, a batch archived late into an old day) is reduced in this process with Arrow,
    # partition by partition on every core, rule for rule like Spark: a JVM's start and first
    # query alone cost more than Arrow takes for a few million rows. Past it, Spark (the engine
    # of big histories and clusters); and always Spark when it starts anyway for big hot tables.
    in_process = not hot.in_spark and 0 < sum(p.bytes for p in missing) <= settings.MQ_ANALYTICS_LOCAL_BYTES
    to_spark = [] if in_process else missing
    # Spark reads whatever its schema says; a newer release's file is refused here instead
    # (partitions.read_rows checks the files it reads itself).
    layout.check_files(root, [path for p in to_spark for _, path in p.files])

    new = {"events": [], "subscribers": []}
    if in_process:
        new = _reduce_in_process(root, missing)
        progress(f"read {len(missing)} archived partitions in this process")
    hot_rows = hot.rows
    if to_spark or hot.in_spark:
        # A short run (little to read) gets a JVM that compiles sooner (job.build_session).
        quick = sum(p.bytes for p in to_spark) < QUICK_JIT_BYTES
        progress(f"starting Spark for {len(to_spark)} archived partitions")
        with job.session(**spark_settings.session_options(master), quick_jit=quick) as spark:
            progress("Spark started")
            chunks = list(_chunks(to_spark, settings.MQ_ANALYTICS_CHUNK_BYTES))
            for number, chunk in enumerate(chunks, 1):
                files = {kind: [f for p in chunk for f in p.paths(kind)] for kind in partitions.KINDS}
                derived = _derived(
                    job.compute_parts(
                        spark,
                        job.extract_archive(spark, root, layout.MESSAGES, files[layout.MESSAGES]),
                        job.extract_archive(spark, root, layout.DELIVERIES, files[layout.DELIVERIES]),
                    )
                )
                _add_tagged(new, derived, chunk)
                progress(f"read chunk {number} of {len(chunks)} ({len(chunk)} partitions) in Spark")
            if hot.in_spark:
                extract.write_snapshot(f"{folder}/hot", hot.snapshot)
                hot_rows = _derived(
                    job.compute_parts(
                        spark,
                        job.extract_snapshot(spark, f"{folder}/hot", layout.MESSAGES),
                        job.extract_snapshot(spark, f"{folder}/hot", layout.DELIVERIES),
                    )
                )
                layout.remove_tree(f"{folder}/hot")
                progress("reduced the hot tables in Spark")

    archived = {name: pa.concat_tables([kept[name], *new[name]]) for name in kept}
    if whole and not any(new.values()):
        # Nothing archived since: the last run's hour rows are this run's, file for file.
        _share_hour_rows(out, current, folder)
    else:
        pool.submit(layout.write_run_file, folder, EVENT_HOURS, archived["events"])
        pool.submit(layout.write_run_file, folder, SUBSCRIBER_HOURS, archived["subscribers"])

    untagged = {name: table.drop_columns(["fingerprint"]) for name, table in archived.items()}
    in_window = untagged
    if len(chosen) < len(listing):
        # A window of days: the rows of its partitions. (Over the whole history, all of them:
        # matching millions of rows' fingerprints took 2 s of a 120-day first run.)
        wanted = pa.array(sorted(p.fingerprint for p in chosen.values()), pa.string())
        in_window = {
            name: untagged[name].filter(pc.is_in(table["fingerprint"], value_set=wanted))
            for name, table in archived.items()
        }
    rows = {name: pa.concat_tables([in_window[name], hot_rows[name]]) for name in archived}
    facts = _facts(chosen, new, missing, hot, spark=bool(to_spark or hot.in_spark))
    facts["partitions"]["recomputed_in_process"] = len(missing) if in_process else 0
    return rows, untagged, facts


def _facts(chosen, new, missing, hot, *, spark):
    """What a run took: Spark or not, the partitions within its window recomputed or reused,
    the rows read."""
    events = new.get("events", [])
    return {
        "spark": spark,
        "partitions": {
            "total": len(chosen),
            "recomputed": len(missing),
            "recomputed_in_process": 0,
            "reused": len(chosen) - len(missing),
        },
        "rows": {
            # What was read of the archive (the partitions recomputed), from what was counted.
            "archive_messages": sum(pc.sum(t["messages"]).as_py() or 0 for t in events),
            "archive_deliveries": sum(pc.sum(t["deliveries"]).as_py() or 0 for t in events),
            "archive_files": sum(len(p.files) for p in missing),
            "archive_bytes": sum(p.bytes for p in missing),
            "hot_messages": hot.snapshot.messages.num_rows,
            "hot_deliveries": hot.snapshot.deliveries.num_rows,
            "hot_overlap_messages": hot.overlapping,
        },
    }


def _reduce_in_process(root, missing):
    """{"events": [...], "subscribers": [...]}: the hour rows of these partitions, each tagged
    with its partition's fingerprint, read and reduced with Arrow (analytics.hours) a batch at
    a time on a thread per core (Arrow and numpy leave the GIL)."""

    def one(batch):
        derived = _derived(
            hours.parts(
                pa.concat_tables([partitions.read_rows(root, p, layout.MESSAGES) for p in batch]),
                pa.concat_tables([partitions.read_rows(root, p, layout.DELIVERIES) for p in batch]),
            )
        )
        # One partition a queue in the batch, and the queue in every key: each row is one
        # partition's, whatever day its own hour is in.
        fingerprints = {p.queue: p.fingerprint for p in batch}
        return {
            name: table.append_column("fingerprint", _tags(table, fingerprints))
            for name, table in derived.items()
        }

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = list(pool.map(one, _local_batches(missing)))
    return {name: [d[name] for d in done] for name in ("events", "subscribers")}


def _tags(table, fingerprints):
    """The fingerprint of each row's queue: looked up once per queue, not per row (a batch of
    small partitions has millions of subscriber hour rows)."""
    queues = pc.dictionary_encode(table["queue"]).combine_chunks()
    lookup = pa.array([fingerprints[q] for q in queues.dictionary.to_pylist()], pa.string())
    return pc.take(lookup, queues.indices)


def _local_batches(missing, most_bytes=LOCAL_BATCH_BYTES):
    """The partitions in batches of one day's, so of distinct queues, of at most `most_bytes`
    of Parquet each (a partition bigger than that alone): a reduction costs about 5 ms
    whatever its size (720 small partitions alone: 3 CPU s), and a batch bounds what a thread
    holds at once."""
    by_day = {}
    for partition in missing:
        by_day.setdefault(partition.day, []).append(partition)
    for day in sorted(by_day):
        yield from _chunks(by_day[day], most_bytes)


def _chunks(missing, most_bytes):
    """The partitions to recompute in runs of Spark jobs of at most `most_bytes` of Parquet each
    (a partition bigger than that alone): what a job holds at once (an hour's latencies, for
    its sketch) stays bounded however much history a first run meets."""
    chunk, size = [], 0
    for partition in missing:
        if chunk and size + partition.bytes > most_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(partition)
        size += partition.bytes
    if chunk:
        yield chunk


def _kept_hours(out, current, live):
    """(the archive's hour rows of the current run whose partition is unchanged (fingerprint
    still live), whether that is all of them); empty tables when there is no current run or its
    rows cannot be read."""
    schemas = {"events": hours.EVENT_HOUR_SCHEMA, "subscribers": hours.SUBSCRIBER_HOUR_SCHEMA}
    empty = {name: _with_fingerprint(schema).empty_table() for name, schema in schemas.items()}
    if current is None:
        return empty, False
    fs, base = layout.filesystem(runs.run_path(out, current))
    kept, whole = {}, True
    for name, file in (("events", EVENT_HOURS), ("subscribers", SUBSCRIBER_HOURS)):
        try:
            table = layout.read_file(fs, f"{base}/{file}").cast(_with_fingerprint(schemas[name]))
        except (OSError, ValueError) as exc:
            # ValueError (ArrowInvalid's base) too: the hour rows of a release with other
            # columns (before the subscribers' latency sketch) do not cast; they are made anew.
            log.warning("analyze: the last run's hour rows are unreadable (%s); recomputing every day", exc)
            return empty, False
        kept[name] = table.filter(
            pc.is_in(table["fingerprint"], value_set=pa.array(sorted(live), pa.string()))
        )
        whole = whole and kept[name].num_rows == table.num_rows
    return kept, whole


def _with_fingerprint(schema):
    return schema.append(pa.field("fingerprint", pa.string()))


def _derived(parts):
    """{"events": event hours, "subscribers": subscriber hours} of a run's parts (Spark's or
    Arrow's)."""
    parts = {name: table.cast(hours.PART_SCHEMAS[name]) for name, table in parts.items()}
    return {"events": hours.event_hours(parts), "subscribers": hours.subscriber_hours(parts)}


def _add_tagged(new, derived, recomputed):
    """Add these recomputed partitions' hour rows to `new`, each with its partition's
    fingerprint (what the next run keeps them by). A row's day is its partition's (the job
    keeps the folder's day; a replayed delivery's hour may be days later), so every row read
    from these partitions finds its own."""
    fingerprints = {(p.queue, p.day): p.fingerprint for p in recomputed}
    for name, table in derived.items():
        keys = zip(table["queue"].to_pylist(), table["day"].to_pylist(), strict=True)
        tags = pa.array([fingerprints[k] for k in keys], pa.string())
        new[name].append(table.append_column("fingerprint", tags))


def _write_bytes(folder, name, data):
    fs, base = layout.filesystem(folder)
    layout.write_whole(fs, base, name, lambda out: out.write(data), durable=True)


def _spark_path(path):
    """A local path made absolute (Spark would resolve it against its own working directory)."""
    path = str(path).rstrip("/")
    return path if "://" in path else os.path.abspath(path)
