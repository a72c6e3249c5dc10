"""The hour rows (analytics.job's EVENT_HOUR_COLUMNS, SUBSCRIBER_HOUR_COLUMNS) of the hot
tables' snapshot, computed in this process with Arrow.

The hot tables hold the last days only (the archive takes the rest), so their snapshot is
small; aggregating it here, where the COPY put it, costs a fraction of a second and needs no
Spark job, which is what lets a run with no archived day changed answer in a few seconds.
Past MQ_ANALYTICS_HOT_SPARK_ROWS deliveries the snapshot goes to Spark instead, through the
same transforms as the archive (analytics.analysis).

The same rules as analytics.job's transforms, in Arrow: tests/test_analytics_hours.py holds
the two to the same rows on the same snapshot.
"""

import pyarrow as pa
import pyarrow.compute as pc

from . import sketch
from .job import STATUSES

TIMESTAMP = pa.timestamp("us", tz="UTC")
_KEY = [("queue", pa.string()), ("day", pa.string())]
EVENT_HOUR_SCHEMA = pa.schema(
    [
        *_KEY,
        ("event", pa.string()),
        ("hour", TIMESTAMP),
        *[(c, pa.int64()) for c in ("messages", "deliveries", *STATUSES, "attempts_sum")],
        ("minute_counts", pa.list_(pa.struct([("minute", pa.int32()), ("n", pa.int64())]))),
        ("first_at", TIMESTAMP),
        ("last_at", TIMESTAMP),
        ("latency_points", pa.list_(pa.float64())),
    ]
)
SUBSCRIBER_HOUR_SCHEMA = pa.schema(
    [
        *_KEY,
        ("subscriber", pa.string()),
        ("hour", TIMESTAMP),
        *[(c, pa.int64()) for c in ("published", *STATUSES, "acks")],
        ("oldest_pending_at", TIMESTAMP),
    ]
)


def event_hours(messages: pa.Table, deliveries: pa.Table) -> pa.Table:
    by_minute = _group(
        _with(messages, day=_day(messages["created_at"]), minute=_floor(messages["created_at"], "minute")),
        ["queue", "day", "event", "minute"],
        n=("created_at", "count"),
        first_at=("created_at", "min"),
        last_at=("created_at", "max"),
    )
    by_minute = _with(
        by_minute,
        hour=_floor(by_minute["minute"], "hour"),
        minute_of_hour=pc.cast(pc.minute(by_minute["minute"]), pa.int32()),
    )
    published = _group(
        by_minute,
        ["queue", "day", "event", "hour"],
        messages=("n", "sum"),
        minutes=("minute_of_hour", "list"),
        counts=("n", "list"),
        first_at=("first_at", "min"),
        last_at=("last_at", "max"),
    )
    published = _with(
        published.drop_columns(["minutes", "counts"]),
        minute_counts=_zip_lists(published["minutes"], published["counts"], ["minute", "n"]),
    )
    status = deliveries["status"]
    settled = pc.is_in(status, value_set=pa.array(["acked", "dead"]))
    rows = _with(
        deliveries,
        day=_day(deliveries["created_at"]),
        hour=_floor(deliveries["created_at"], "hour"),
        settled_attempts=pc.if_else(settled, deliveries["attempts"], pa.scalar(None, pa.int64())),
        **{f"is_{s}": pc.cast(pc.equal(status, s), pa.int64()) for s in STATUSES},
    )
    keys = ["queue", "day", "event", "hour"]
    delivered = _group(
        rows,
        keys,
        deliveries=("status", "count"),
        attempts_sum=("settled_attempts", "sum"),
        **{s: (f"is_{s}", "sum") for s in STATUSES},
    )
    acked = rows.filter(pc.equal(rows["status"], "acked"))
    acked = _with(acked, latency=_latency_ms(acked))
    latency = _group(acked, keys, latencies=("latency", "list"))
    latency = _with(
        latency.drop_columns(["latencies"]),
        latency_points=pa.array(
            [sketch.points(v) for v in latency["latencies"].to_pylist()], pa.list_(pa.float64())
        ),
    )
    return _outer_join([published, delivered, latency], keys, EVENT_HOUR_SCHEMA)


def subscriber_hours(deliveries: pa.Table) -> pa.Table:
    status = deliveries["status"]
    rows = _with(
        deliveries,
        day=_day(deliveries["created_at"]),
        hour=_floor(deliveries["created_at"], "hour"),
        pending_at=pc.if_else(
            pc.equal(status, "pending"), deliveries["created_at"], pa.scalar(None, TIMESTAMP)
        ),
        **{f"is_{s}": pc.cast(pc.equal(status, s), pa.int64()) for s in STATUSES},
    )
    keys = ["queue", "day", "subscriber", "hour"]
    made = _group(
        rows,
        keys,
        published=("status", "count"),
        oldest_pending_at=("pending_at", "min"),
        **{s: (f"is_{s}", "sum") for s in STATUSES},
    )
    acked = rows.filter(pc.equal(status, "acked"))
    acks = _group(
        _with(acked.drop_columns(["hour"]), hour=_floor(acked["acked_at"], "hour")),
        keys,
        acks=("status", "count"),
    )
    return _outer_join([made, acks], keys, SUBSCRIBER_HOUR_SCHEMA)


# --- Arrow helpers -------------------------------------------------------------------------------


def _with(table, **columns):
    for name, values in columns.items():
        table = table.append_column(name, values)
    return table


def _group(table, keys, **aggregates):
    """group_by(keys), each output named by its keyword: name=(column, function)."""
    out = table.group_by(keys, use_threads=False).aggregate([(col, fn) for col, fn in aggregates.values()])
    return out.rename_columns(
        {f"{col}_{fn}": name for name, (col, fn) in aggregates.items()} | {k: k for k in keys}
    )


def _outer_join(tables, keys, schema):
    """The rows of these aggregates joined on `keys` (a key missing from one gets its columns
    as nulls, its counts as 0), in `schema`. In Python: Arrow's joins take no list columns,
    and there are a few rows per hour and key."""
    rows = {}
    for table in tables:
        for row in table.to_pylist():
            rows.setdefault(tuple(row[k] for k in keys), {}).update(row)
    counts = {f.name for f in schema if pa.types.is_integer(f.type)}
    return pa.Table.from_pylist(
        [{f: (r.get(f) or 0) if f in counts else r.get(f) for f in schema.names} for r in rows.values()],
        schema=schema,
    )


def _zip_lists(left, right, names):
    """Two list columns of equal lengths as one list of structs, as Spark's collect_list of a
    struct gives."""
    left, right = left.combine_chunks(), right.combine_chunks()
    values = pa.StructArray.from_arrays([left.flatten(), right.flatten()], names=names)
    return pa.ListArray.from_arrays(left.offsets, values)


def _floor(timestamps, unit):
    return pc.floor_temporal(timestamps, unit=unit)


def _day(timestamps):
    return pc.strftime(timestamps, format="%Y-%m-%d")


def _latency_ms(rows):
    micros = pc.subtract(pc.cast(rows["acked_at"], pa.int64()), pc.cast(rows["created_at"], pa.int64()))
    return pc.divide(pc.cast(micros, pa.float64()), 1000.0)
