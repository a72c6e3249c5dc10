"""Write an analytics run folder (analytics.runs) with pyarrow, as the job writes it: for tests of
what reads run folders (load, the API, /metrics, prune) without running Spark.

    write_run(out, events=[{"queue": "db", "event": "create", "messages": 3}], ...)

Rows are dicts; the columns they leave out get plain defaults (0, None, "hour").
"""

import itertools
import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq

from analytics import figures, layout, runs

# The columns of a run's results are the ones the analysis writes (one place: figures).
RESULTS = figures.RESULT_SCHEMAS


_clock = itertools.count()


def _default(field):
    if field.name == "period":
        return "hour"
    return 0 if pa.types.is_integer(field.type) else None


def table(schema, rows):
    full = [{f.name: r.get(f.name, _default(f)) for f in schema} for r in rows]
    return pa.Table.from_pylist(full, schema=schema)


def write_run(
    out,
    run_id=None,
    *,
    events=(),
    subscribers=(),
    event_trends=(),
    subscriber_trends=(),
    event_windows=None,
    subscriber_windows=None,
    manifest=None,
    finished=True,
    switch=True,
):
    """Write a run folder under `out`; returns its run_id. `manifest` overrides the defaults'
    fields. `finished` False leaves out the manifest (a run still writing, or dead); `switch`
    makes it the current run. The windows' files are written only when given (an older
    release's run has none)."""
    # Each run a second after the last: their ids sort in the order they were written.
    started = datetime(2026, 11, 25, 12, 0, tzinfo=UTC) + timedelta(seconds=next(_clock))
    run_id = run_id or runs.new_run_id(started)
    fs, base = layout.filesystem(runs.run_path(out, run_id))
    fs.create_dir(base, recursive=True)
    for name, rows in (
        ("event_stats", events),
        ("subscriber_stats", subscribers),
        ("event_trends", event_trends),
        ("subscriber_trends", subscriber_trends),
        ("event_windows", event_windows),
        ("subscriber_windows", subscriber_windows),
    ):
        if rows is None:
            continue
        with fs.open_output_stream(f"{base}/{name}.parquet") as f:
            pq.write_table(table(RESULTS[name], rows), f)
    if finished:
        body = {
            "run_id": run_id,
            "started_at": started.isoformat(),
            "finished_at": (started + timedelta(seconds=42.5)).isoformat(),
            "duration_s": 42.5,
            "now": started.isoformat(),
            "window": {"since": None, "until": None},
            "spark": True,
            "partitions": {"total": 10, "recomputed": 2, "reused": 8},
            "rows": {
                "archive_messages": 100,
                "archive_deliveries": 200,
                "hot_messages": 5,
                "hot_deliveries": 9,
            },
            **(manifest or {}),
        }
        with fs.open_output_stream(f"{base}/{runs.MANIFEST}") as f:
            f.write(json.dumps(body).encode("utf-8"))
        if switch:
            runs.switch(out, run_id)
    return run_id
