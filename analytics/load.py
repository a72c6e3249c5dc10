"""Load: the job's Parquet results into the Django tables the admin shows (analytics.stored
reads them back).

Reads the results with pyarrow, so it works the same whether the job ran in this process or was
spark-submitted to a cluster that wrote them to shared storage. The statistics and the recent
windows are a few rows a queue, event and subscriber, replaced whole. The trends are a row per
hour and day of each over the history (hundreds of thousands over months), of which a run
changes few: they are compared in Arrow with the last loaded run's and only what changed is
written.
"""

import functools
import hashlib
import math
from dataclasses import dataclass
from datetime import date, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from django.db import connection, models, transaction
from django.utils import timezone
from pyarrow import fs as pafs

from . import layout, runs
from .models import (
    AnalyticsRun,
    EventStats,
    EventTrend,
    EventWindowStats,
    Period,
    SubscriberStats,
    SubscriberTrend,
    SubscriberWindowStats,
    Window,
)
from .stored import EVENT_FIELDS, SUBSCRIBER_FIELDS, last_run

EVENT_TREND_FIELDS = [f.name for f in EventTrend._meta.concrete_fields if f.name != "id"]
SUBSCRIBER_TREND_FIELDS = [f.name for f in SubscriberTrend._meta.concrete_fields if f.name != "id"]
EVENT_WINDOW_FIELDS = [
    f.name for f in EventWindowStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]
SUBSCRIBER_WINDOW_FIELDS = [
    f.name for f in SubscriberWindowStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]
STATS = ("event_stats", "subscriber_stats")
# Results a run of an older release did not write: loaded as none.
LATER_RESULTS = ("event_windows", "subscriber_windows")
# Each trend result, its table and its columns.
TRENDS = {
    "event_trends": (EventTrend, EVENT_TREND_FIELDS),
    "subscriber_trends": (SubscriberTrend, SUBSCRIBER_TREND_FIELDS),
}
# The column _changes marks each row's run in (no field's name has a space).
SIDE = " run"
# Loads wait for each other (PostgreSQL; SQLite's write transactions queue anyway): a load
# writes the difference from the run it found loaded, which must still be the one loaded.
LOAD_LOCK = int.from_bytes(hashlib.sha256(b"mqsite.analytics.load").digest()[:8], "big", signed=True)


def read_result(out, name):
    """One result of the job as a list of dicts."""
    return read_table(out, name).to_pylist()


def read_table(out, name):
    """One result of the job as an Arrow table."""
    fs, base = layout.filesystem(out)
    return layout.read_file(fs, f"{base}/{name}")


def load_run(out, run_id):
    """Replace the stored statistics with those of the run folder `run_id` under `out`
    (analytics.runs), and record the run (AnalyticsRun); returns how many rows of each.

    The files are read and compared before the transaction (slow I/O holds no lock); the
    replacement is one transaction, so a reader sees the previous run's figures or this one's,
    never a mix. Loading the same run again gives the same rows."""
    raw = runs.read_manifest(out, run_id)
    manifest = run_fields(raw)
    folder = runs.run_path(out, run_id)
    rows = {name: read_result(folder, f"{name}.parquet") for name in STATS}
    rows |= {name: _read_if_there(folder, f"{name}.parquet") for name in LATER_RESULTS}
    computed_at = manifest["now"]
    events = [_clean(r, EVENT_FIELDS) for r in rows["event_stats"]]
    subscribers = [_clean(r, SUBSCRIBER_FIELDS) for r in rows["subscriber_stats"]]
    event_windows = [_clean(r, EVENT_WINDOW_FIELDS) for r in rows["event_windows"]]
    subscriber_windows = [_clean(r, SUBSCRIBER_WINDOW_FIELDS) for r in rows["subscriber_windows"]]
    for window in event_windows + subscriber_windows:
        if window["window"] not in Window.values:
            raise runs.BadRun(f"run {run_id}: a window is {window['window']!r}, not 1h or 24h")
    previous = last_run()
    trends = {name: _Trends(folder, name, run_id) for name in TRENDS}
    if _same_trends(out, raw, previous):
        # The very files of the run the tables hold (analytics.reuse): nothing to compare.
        changes = {name: Changes(before=trends[name].rows, gone=None, added=None) for name in TRENDS}
    else:
        # Compared with the run whose trends the tables hold, if its folder still has them.
        changes = {
            name: _changes(
                trends[name].table,
                _previous_trends(out, previous, name, trends[name].table.schema),
                _key(model),
            )
            for name, (model, _) in TRENDS.items()
        }
    with transaction.atomic():
        _hold_loads()
        _replace_stats(events, subscribers, computed_at)
        EventWindowStats.objects.all().delete()
        SubscriberWindowStats.objects.all().delete()
        EventWindowStats.objects.bulk_create(
            [EventWindowStats(**r, computed_at=computed_at) for r in event_windows], batch_size=500
        )
        SubscriberWindowStats.objects.bulk_create(
            [SubscriberWindowStats(**r, computed_at=computed_at) for r in subscriber_windows], batch_size=500
        )
        # Another load may have gone first while this one compared: then the tables hold
        # that run's trends, not the ones compared with.
        still = previous is not None and getattr(last_run(), "run_id", None) == previous.run_id
        for name, (model, _) in TRENDS.items():
            _store_trends(model, trends[name], changes[name] if still else None)
        AnalyticsRun.objects.update_or_create(
            run_id=manifest["run_id"], defaults={**manifest, "loaded_at": timezone.now()}
        )
    return {
        "events": len(events),
        "subscribers": len(subscribers),
        "event_trends": trends["event_trends"].rows,
        "subscriber_trends": trends["subscriber_trends"].rows,
        "event_windows": len(event_windows),
        "subscriber_windows": len(subscriber_windows),
    }


class _Trends:
    """A run's trend result, read (_trend_table) only when its rows are needed."""

    def __init__(self, folder, name, run_id):
        self.folder, self.name, self.run_id = folder, name, run_id

    @functools.cached_property
    def table(self):
        model, fields = TRENDS[self.name]
        return _trend_table(self.folder, self.name, model, fields, self.run_id)

    @functools.cached_property
    def rows(self):
        if "table" in self.__dict__:
            return self.table.num_rows
        fs, base = layout.filesystem(self.folder)
        with fs.open_input_file(f"{base}/{self.name}.parquet") as source:
            return pq.ParquetFile(source).metadata.num_rows


def _same_trends(out, manifest, previous):
    """Whether the run's trends are, file for file, those of the run the tables hold
    (`previous`, an AnalyticsRun): a run with nothing new shares the trend files of the run
    whose figures it takes (analytics.reuse), "figures_of" in both manifests."""
    mine = (manifest.get("reuse") or {}).get("figures_of")
    if previous is None or mine is None:
        return False
    try:
        theirs = runs.read_manifest(out, previous.run_id)
    except (OSError, ValueError, runs.BadRun):
        return False
    return (theirs.get("reuse") or {}).get("figures_of") == mine


def _read_if_there(folder, name):
    fs, base = layout.filesystem(folder)
    if fs.get_file_info(f"{base}/{name}").type == pafs.FileType.NotFound:
        return []
    return read_result(folder, name)


def _hold_loads():
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [LOAD_LOCK])


def _key(model):
    """The columns that name a trend row: its table's unique constraint."""
    (unique,) = [c for c in model._meta.constraints if isinstance(c, models.UniqueConstraint)]
    return list(unique.fields)


def _trend_table(folder, name, model, fields, run_id):
    """A run's trend result as an Arrow table of the model's fields (one an older release did
    not write: null), NaN as null (_clean); BadRun for a period that is not one, or two rows
    of one key (a full load would fail on the table's unique constraint)."""
    table = read_table(folder, f"{name}.parquet")
    table = pa.table(
        {f: _no_nan(table[f]) if f in table.column_names else pa.nulls(table.num_rows) for f in fields}
    )
    periods = table["period"]
    unknown = pc.filter(periods, pc.invert(pc.is_in(periods, value_set=pa.array(Period.values))))
    if len(unknown):
        raise runs.BadRun(f"run {run_id}: a trend's period is {unknown[0].as_py()!r}, not hour or day")
    if table.group_by(_key(model)).aggregate([]).num_rows != table.num_rows:
        raise runs.BadRun(f"run {run_id}: {name} has two rows for one {', '.join(_key(model))}")
    return table


def _no_nan(column):
    # NaN (0/0 in Spark) is not a number a database should hold: null, as _clean makes it.
    if not pa.types.is_floating(column.type):
        return column
    return pc.if_else(pc.is_nan(column), pa.scalar(None, column.type), column)


def _previous_trends(out, previous, name, schema):
    """The trend result `name` of the run the tables hold (an AnalyticsRun), as _trend_table
    gives it; None when there is none, its folder is gone (runs.prune), or it cannot be read
    or compared (another release's columns)."""
    if previous is None:
        return None
    model, fields = TRENDS[name]
    try:
        table = _trend_table(runs.run_path(out, previous.run_id), name, model, fields, previous.run_id)
    except (OSError, pa.ArrowException, runs.BadRun):
        return None
    return table if table.schema.equals(schema) else None


@dataclass
class Changes:
    """What turns the previous run's trend rows into the new run's."""

    before: int  # how many rows the previous run had
    gone: pa.Table | None  # the keys of its rows that are gone or changed (None: the same rows)
    added: pa.Table | None  # the new run's rows that are new or changed


def _changes(new, old, key):
    """Changes from `old` to `new` (trend tables of the same columns, keys unique); None
    without `old`. A row is kept when the other table has it whole, nulls equal (NaN is null
    by now): grouped on all the columns, each such row is a group of two, one from each side.
    One group_by costs half of joining on the key and comparing each column."""
    if old is None:
        return None
    side = pa.concat_arrays(
        [pa.repeat(pa.scalar(1, pa.int8()), new.num_rows), pa.repeat(pa.scalar(2, pa.int8()), old.num_rows)]
    )
    both = pa.concat_tables([new, old]).append_column(SIDE, side)
    # Single-threaded: faster than on 2 threads here, and leaves the other core to the server.
    rows = both.group_by(new.column_names, use_threads=False).aggregate([(SIDE, "sum")])
    sides = rows[f"{SIDE}_sum"]
    return Changes(
        before=old.num_rows,
        gone=rows.filter(pc.equal(sides, 2)).select(key),
        added=rows.filter(pc.equal(sides, 1)).select(new.column_names),
    )


def _store_trends(model, trends, changes):
    """Make the model's table hold the rows of `trends` (a _Trends): by `changes` from the
    previous run's rows when known and the table still holds those (as many rows, each row gone
    there to delete; none when gone is None: the same rows), else by replacing them all.
    Deleting row by row costs more than replacing all past half."""
    if changes is not None and changes.gone is None:  # the same rows (_same_trends)
        if model.objects.count() == changes.before:
            return
    elif changes is not None and changes.gone.num_rows <= changes.before // 2:
        if model.objects.count() == changes.before and _delete(model, changes.gone) == changes.gone.num_rows:
            _insert(model, changes.added)
            return
    model.objects.all().delete()
    _insert(model, trends.table)


def _delete(model, keys):
    """Delete the model's rows of these keys (an Arrow table of key columns); how many went. A
    statement per DELETE_CHUNK keys (row values IN a VALUES list), not one per row."""
    if not keys.num_rows:
        return 0
    quote = connection.ops.quote_name
    columns = ", ".join(quote(model._meta.get_field(f).column) for f in keys.column_names)
    row = f"({', '.join(['%s'] * keys.num_columns)})"
    rows, deleted = list(_db_rows(model, keys)), 0
    with connection.cursor() as cursor:
        for start in range(0, len(rows), DELETE_CHUNK):
            chunk = rows[start : start + DELETE_CHUNK]
            cursor.execute(
                f"DELETE FROM {quote(model._meta.db_table)} WHERE ({columns}) IN "
                f"(VALUES {', '.join([row] * len(chunk))})",
                [value for key in chunk for value in key],
            )
            deleted += cursor.rowcount
    return deleted


# Keys per DELETE: 4 parameters each, well inside SQLite's 32,766 and PostgreSQL's 65,535.
DELETE_CHUNK = 1000


def _insert(model, table):
    """Insert the rows of `table` (an Arrow table of the model's fields) into the model's table.
    On PostgreSQL by COPY (a tenth of the time bulk_create's SQL took to build); elsewhere by
    one INSERT executed for every row: bulk_create's SQL compiler prepared each value of each
    row in Python, a minute for 200,000 trend rows on SQLite."""
    if not table.num_rows:
        return
    quote = connection.ops.quote_name
    columns = ", ".join(quote(model._meta.get_field(f).column) for f in table.column_names)
    rows = _db_rows(model, table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # By psycopg's cursor: its errors as Django's (an IntegrityError is one either way).
            copy_sql = f"COPY {quote(model._meta.db_table)} ({columns}) FROM STDIN"
            with connection.wrap_database_errors, cursor.cursor.copy(copy_sql) as copy:
                for row in rows:
                    copy.write_row(row)
            return
        marks = ", ".join(["%s"] * table.num_columns)
        cursor.executemany(
            f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES ({marks})", list(rows)
        )


def _db_rows(model, table):
    """The rows of `table` (an Arrow table of some of the model's fields) as tuples of the values
    the database takes. Datetimes as connection.ops adapts them (SQLite stores text), once for
    each distinct value: a trend's period_start repeats for every queue, event and subscriber."""
    columns = []
    for name in table.column_names:
        column = table[name]
        if isinstance(model._meta.get_field(name), models.DateTimeField):
            distinct = pc.unique(column)
            adapted = [connection.ops.adapt_datetimefield_value(v) for v in distinct.to_pylist()]
            columns.append([adapted[i] for i in pc.index_in(column, value_set=distinct).to_pylist()])
        else:
            columns.append(column.to_pylist())
    return zip(*columns, strict=True)


def run_fields(manifest):
    """A manifest (analytics.runs) as AnalyticsRun's fields; BadRun naming what is missing or
    malformed."""
    try:
        return {
            "run_id": manifest["run_id"],
            "started_at": _when(manifest["started_at"]),
            "finished_at": _when(manifest["finished_at"]),
            "duration_s": float(manifest["duration_s"]),
            "now": _when(manifest["now"]),
            "window_since": _day(manifest["window"]["since"]),
            "window_until": _day(manifest["window"]["until"]),
            "spark": bool(manifest["spark"]),
            **{f"partitions_{k}": int(manifest["partitions"][k]) for k in ("total", "recomputed", "reused")},
            **{
                f"rows_{k}": int(manifest["rows"][k])
                for k in ("archive_messages", "archive_deliveries", "hot_messages", "hot_deliveries")
            },
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise runs.BadRun(f"malformed manifest ({type(exc).__name__}: {exc})") from exc


def _when(text):
    value = datetime.fromisoformat(text)
    if timezone.is_naive(value):
        raise ValueError(f"{text!r} has no time zone")
    return value


def _day(text):
    return None if text is None else date.fromisoformat(text)


def _replace_stats(events, subscribers, computed_at):
    EventStats.objects.all().delete()
    SubscriberStats.objects.all().delete()
    EventStats.objects.bulk_create([EventStats(**r, computed_at=computed_at) for r in events], batch_size=500)
    SubscriberStats.objects.bulk_create(
        [SubscriberStats(**r, computed_at=computed_at) for r in subscribers], batch_size=500
    )


def _clean(row, fields):
    # NaN (0/0 in Spark) is not a number a database or JSON should hold: store null.
    return {f: None if isinstance(row.get(f), float) and math.isnan(row[f]) else row.get(f) for f in fields}
