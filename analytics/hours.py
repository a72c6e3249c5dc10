"""Hour rows, in Arrow: the parts of the hot tables' snapshot (what analytics.job computes
of the archive with Spark), and the event and subscriber hours derived from either's parts.

    rows --parts--> message_hours, delivery_cells, latency_sketches   (Spark: the archive;
                                                                       here: the hot snapshot)
    parts --here--> event hours (EVENT_HOUR_SCHEMA), subscriber hours (SUBSCRIBER_HOUR_SCHEMA)

The hot tables hold the last days only (the archive takes the rest), so their snapshot is
small: its parts are computed in this process, where the COPY put it, in a fraction of a
second and with no Spark job, which is what lets a run with no archived day changed answer in
a few seconds. Past MQ_ANALYTICS_HOT_SPARK_ROWS deliveries the snapshot goes to Spark instead
(analytics.analysis). The parts follow analytics.job's transforms rule for rule (the same
sketch points, analytics.sketch); tests/analytics/test_job.py holds both engines to the same
rows.
"""

import pyarrow as pa
import pyarrow.compute as pc

from . import sketch
from .job import STATUSES

TIMESTAMP = pa.timestamp("us", tz="UTC")
_MINUTES = pa.list_(pa.struct([("minute", pa.int32()), ("n", pa.int64())]))
_KEY = [("queue", pa.string()), ("day", pa.string())]

# The parts (analytics.job's MESSAGE_HOUR_COLUMNS, CELL_COLUMNS, SKETCH_COLUMNS).
PART_SCHEMAS = {
    "message_hours": pa.schema(
        [
            *_KEY,
            ("event", pa.string()),
            ("hour", TIMESTAMP),
            ("messages", pa.int64()),
            ("minute_counts", _MINUTES),
            ("first_at", TIMESTAMP),
            ("last_at", TIMESTAMP),
        ]
    ),
    "delivery_cells": pa.schema(
        [
            *_KEY,
            ("event", pa.string()),
            ("subscriber", pa.string()),
            ("hour", TIMESTAMP),
            ("acked_hour", TIMESTAMP),
            ("status", pa.string()),
            ("n", pa.int64()),
            ("attempts", pa.int64()),
            ("first_created_at", TIMESTAMP),
        ]
    ),
    "latency_sketches": pa.schema(
        [
            *_KEY,
            ("event", pa.string()),
            ("hour", TIMESTAMP),
            ("latency_count", pa.int64()),
            ("latency_points", pa.list_(pa.float64())),
        ]
    ),
    "subscriber_latency_sketches": pa.schema(
        [
            *_KEY,
            ("subscriber", pa.string()),
            ("hour", TIMESTAMP),
            ("latency_count", pa.int64()),
            ("latency_points", pa.list_(pa.float64())),
        ]
    ),
}
EVENT_HOUR_SCHEMA = pa.schema(
    [
        *_KEY,
        ("event", pa.string()),
        ("hour", TIMESTAMP),
        *[(c, pa.int64()) for c in ("messages", "deliveries", *STATUSES, "attempts_sum")],
        ("minute_counts", _MINUTES),
        ("first_at", TIMESTAMP),
        ("last_at", TIMESTAMP),
        ("latency_count", pa.int64()),
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
        ("latency_count", pa.int64()),
        ("latency_points", pa.list_(pa.float64())),
    ]
)


# --- the parts of the hot tables' snapshot (analytics.job's transforms, in Arrow) ----------------


def parts(messages: pa.Table, deliveries: pa.Table):
    """{name: table} of the snapshot's parts, in PART_SCHEMAS. Each row has its `day`,
    the partition's (layout.partition_days), which the parts keep: a delivery a replay made
    days after its message is counted in the hour it was made, under its message's day."""
    return {
        "message_hours": message_hours(messages),
        "delivery_cells": delivery_cells(deliveries),
        "latency_sketches": latency_sketches(deliveries),
        "subscriber_latency_sketches": latency_sketches(deliveries, "subscriber"),
    }


def message_hours(messages):
    by_minute = _group(
        _with(messages, minute=_floor(messages["created_at"], "minute")),
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
    hours = _group(
        by_minute,
        ["queue", "day", "event", "hour"],
        messages=("n", "sum"),
        minutes=("minute_of_hour", "list"),
        counts=("n", "list"),
        first_at=("first_at", "min"),
        last_at=("last_at", "max"),
    )
    hours = _with(
        hours.drop_columns(["minutes", "counts"]),
        minute_counts=_zip_lists(hours["minutes"], hours["counts"], ["minute", "n"]),
    )
    return hours.select(PART_SCHEMAS["message_hours"].names).cast(PART_SCHEMAS["message_hours"])


def delivery_cells(deliveries):
    rows = _with(
        deliveries,
        hour=_floor(deliveries["created_at"], "hour"),
        acked_hour=_floor(deliveries["acked_at"], "hour"),
    )
    cells = _group(
        rows,
        ["queue", "day", "event", "subscriber", "hour", "acked_hour", "status"],
        n=("id", "count"),
        attempts=("attempts", "sum"),
        first_created_at=("created_at", "min"),
    )
    return cells.select(PART_SCHEMAS["delivery_cells"].names).cast(PART_SCHEMAS["delivery_cells"])


def latency_sketches(deliveries, key="event"):
    """The latency sketches per queue, day, `key` (event or subscriber) and hour."""
    name = "latency_sketches" if key == "event" else "subscriber_latency_sketches"
    acked = deliveries.filter(pc.equal(deliveries["status"], "acked"))
    micros = pc.subtract(pc.cast(acked["acked_at"], pa.int64()), pc.cast(acked["created_at"], pa.int64()))
    acked = _with(
        acked,
        hour=_floor(acked["created_at"], "hour"),
        latency=pc.divide(pc.cast(micros, pa.float64()), 1000.0),
    )
    groups = _group(acked, ["queue", "day", key, "hour"], latencies=("latency", "list"))
    sketches = _with(
        groups.drop_columns(["latencies"]),
        latency_count=pc.cast(pc.list_value_length(groups["latencies"]), pa.int64()),
        latency_points=pa.array(
            [sketch.points(v) for v in groups["latencies"].to_pylist()], pa.list_(pa.float64())
        ),
    )
    return sketches.select(PART_SCHEMAS[name].names).cast(PART_SCHEMAS[name])


# --- hours from the parts, whichever engine made them --------------------------------------------


def event_hours(parts):
    """Rows of queue, day, event and hour (EVENT_HOUR_SCHEMA): messages, deliveries by state,
    attempts of the settled ones (acked or dead), the sketch; up to three rows per key (one
    from each part), to be added up."""
    cells = parts["delivery_cells"]
    status = cells["status"]
    settled = pc.is_in(status, value_set=pa.array(["acked", "dead"]))
    cells = _with(
        cells,
        settled_attempts=pc.if_else(settled, cells["attempts"], pa.scalar(0, pa.int64())),
        **{f"n_{s}": pc.if_else(pc.equal(status, s), cells["n"], pa.scalar(0, pa.int64())) for s in STATUSES},
    )
    keys = ["queue", "day", "event", "hour"]
    counts = _group(
        cells,
        keys,
        deliveries=("n", "sum"),
        attempts_sum=("settled_attempts", "sum"),
        **{s: (f"n_{s}", "sum") for s in STATUSES},
    )
    return _union([parts["message_hours"], counts, parts["latency_sketches"]], EVENT_HOUR_SCHEMA)


def subscriber_hours(parts):
    """Rows of queue, day, subscriber and hour (SUBSCRIBER_HOUR_SCHEMA), up to three per key, to
    be added up: the deliveries made in the hour (`published`) by their state now, the oldest
    still pending, the acks made in the hour (`acks`, by when they came: what the backlog
    trend subtracts), and the latency sketch of its acked deliveries published in the hour."""
    cells = parts["delivery_cells"]
    status = cells["status"]
    cells = _with(
        cells,
        pending_at=pc.if_else(
            pc.equal(status, "pending"), cells["first_created_at"], pa.scalar(None, TIMESTAMP)
        ),
        **{f"n_{s}": pc.if_else(pc.equal(status, s), cells["n"], pa.scalar(0, pa.int64())) for s in STATUSES},
    )
    keys = ["queue", "day", "subscriber", "hour"]
    made = _group(
        cells,
        keys,
        published=("n", "sum"),
        oldest_pending_at=("pending_at", "min"),
        **{s: (f"n_{s}", "sum") for s in STATUSES},
    )
    acked = cells.filter(pc.equal(status, "acked"))
    acks = _group(
        _with(acked.drop_columns(["hour"]), hour=acked["acked_hour"]),
        keys,
        acks=("n", "sum"),
    )
    return _union([made, acks, parts["subscriber_latency_sketches"]], SUBSCRIBER_HOUR_SCHEMA)


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


def _union(tables, schema):
    """These tables' rows one after the other in `schema`: a column a table lacks is null, or 0
    for a count. Not joined: a key can have a row from each table, and whoever reads the rows
    adds up a key's rows anyway (analytics.figures), as it adds up the archive's and the hot
    tables' rows of one hour."""
    out = []
    for table in tables:
        columns = []
        for field in schema:
            if field.name in table.column_names:
                columns.append(table[field.name].cast(field.type))
            elif pa.types.is_integer(field.type):
                columns.append(pa.array([0] * table.num_rows, field.type))
            else:
                columns.append(pa.nulls(table.num_rows, field.type))
        out.append(pa.Table.from_arrays(columns, schema=schema))
    return pa.concat_tables(out)


def _zip_lists(left, right, names):
    """Two list columns of equal lengths as one list of structs, as Spark's collect_list of a
    struct gives."""
    left, right = left.combine_chunks(), right.combine_chunks()
    values = pa.StructArray.from_arrays([left.flatten(), right.flatten()], names=names)
    return pa.ListArray.from_arrays(left.offsets, values)


def _floor(timestamps, unit):
    return pc.floor_temporal(timestamps, unit=unit)
