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

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .job import HOUR_US, MINUTE_US, SKETCH_POINTS, STATUSES

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


# --- the parts of rows in Arrow (the hot snapshot, or archived partitions) ------------------------
#
# analytics.job's transforms, in this process: hours and minutes as whole numbers since the epoch
# (truncated as Spark's `div`), the string keys as dictionary codes, so that every group_by
# hashes integers, and each hour's timestamp and day made once per group at the end rather than
# through a calendar for every row (measured on the 5 M archive: 33 s -> see bench/README.md).


def parts(messages: pa.Table, deliveries: pa.Table):
    """{name: table} of the rows' parts, in PART_SCHEMAS. Each row has its `day`, the
    partition's (layout.partition_days for the hot rows, partitions.read_rows for archived ones),
    which the parts keep: a delivery a replay made days after its message is counted in the hour
    it was made, under its message's day. The string columns (`day` included) may be plain or
    dictionary-encoded."""
    return {
        "message_hours": message_hours(messages),
        "delivery_cells": delivery_cells(deliveries),
        "latency_sketches": latency_sketches(deliveries),
        "subscriber_latency_sketches": latency_sketches(deliveries, "subscriber"),
    }


def message_hours(messages):
    queue, queues = _codes(messages["queue"])
    day, days = _codes(messages["day"])
    event, events = _codes(messages["event"])
    at = _micros(messages["created_at"])
    by_minute = _group(
        pa.table({"queue": queue, "day": day, "event": event, "m": pc.divide(at, MINUTE_US), "at": at}),
        ["queue", "day", "event", "m"],
        n=(None, "count_all"),
        first_at=("at", "min"),
        last_at=("at", "max"),
    )
    m = by_minute["m"]
    hours = _group(
        _with(
            by_minute,
            h=pc.divide(m, 60),
            minute=pc.cast(pc.subtract(m, pc.multiply(pc.divide(m, 60), 60)), pa.int32()),
        ),
        ["queue", "day", "event", "h"],
        messages=("n", "sum"),
        minutes=("minute", "list"),
        counts=("n", "list"),
        first_at=("first_at", "min"),
        last_at=("last_at", "max"),
    )
    hour = _hour_start(hours["h"])
    return _part(
        "message_hours",
        queue=pc.take(queues, hours["queue"]),
        day=pc.take(days, hours["day"]),
        event=pc.take(events, hours["event"]),
        hour=hour,
        messages=hours["messages"],
        minute_counts=_zip_lists(hours["minutes"], hours["counts"], ["minute", "n"]),
        first_at=_timestamps(hours["first_at"]),
        last_at=_timestamps(hours["last_at"]),
    )


def delivery_cells(deliveries):
    queue, queues = _codes(deliveries["queue"])
    day, days = _codes(deliveries["day"])
    event, events = _codes(deliveries["event"])
    subscriber, subscribers = _codes(deliveries["subscriber"])
    status, statuses = _codes(deliveries["status"])
    created = _micros(deliveries["created_at"])
    cells = _group(
        pa.table(
            {
                "queue": queue,
                "day": day,
                "event": event,
                "subscriber": subscriber,
                "h": pc.divide(created, HOUR_US),
                "acked_h": pc.divide(_micros(deliveries["acked_at"]), HOUR_US),
                "status": status,
                "attempts": deliveries["attempts"],
                "created": created,
            }
        ),
        ["queue", "day", "event", "subscriber", "h", "acked_h", "status"],
        n=(None, "count_all"),
        attempts=("attempts", "sum"),
        first_created_at=("created", "min"),
    )
    hour = _hour_start(cells["h"])
    return _part(
        "delivery_cells",
        queue=pc.take(queues, cells["queue"]),
        day=pc.take(days, cells["day"]),
        event=pc.take(events, cells["event"]),
        subscriber=pc.take(subscribers, cells["subscriber"]),
        hour=hour,
        acked_hour=_hour_start(cells["acked_h"]),
        status=pc.take(statuses, cells["status"]),
        n=cells["n"],
        attempts=cells["attempts"],
        first_created_at=_timestamps(cells["first_created_at"]),
    )


def latency_sketches(deliveries, key="event"):
    """Per queue, day, `key` (event or subscriber) and hour made, the acked deliveries' latency
    sketch: one sort of all the rows by (group, latency), then the points of every group picked
    at once by their ranks (the rule of analytics.job's SKETCH_POINTS, vectorised)."""
    name = "latency_sketches" if key == "event" else "subscriber_latency_sketches"
    # (An ack with no time has no latency: Spark's collect_list leaves its null out too.) The
    # acked rows picked by the status's code and numpy masks of the few columns used, not by
    # filtering the table: comparing a dictionary column's strings and taking every column of
    # it was most of a sketch's time (58 of 77 ms for a day's 500,000 deliveries).
    status, statuses = _codes(deliveries["status"])
    acked = pc.and_(
        pc.equal(status, pa.scalar(statuses.index("acked").as_py(), pa.int32())),
        pc.is_valid(deliveries["acked_at"]),
    ).to_numpy(zero_copy_only=False)
    if not acked.any():
        return PART_SCHEMAS[name].empty_table()
    names = ["queue", "day", key]
    strings = [_codes(deliveries[column]) for column in names]
    created = _micros(deliveries["created_at"]).to_numpy()[acked]
    # Microseconds, as integers: the order of the ms Spark sorts (a division by 1000.0 keeps it).
    latency = pc.fill_null(_micros(deliveries["acked_at"]), 0).to_numpy()[acked] - created
    h = pc.divide(_micros(deliveries["created_at"]), HOUR_US).to_numpy()[acked]
    first_hour = int(h.min())
    # One key for (queue, day, key, hour), so that the sort compares two keys, not five.
    columns = [codes.to_numpy()[acked].astype(np.int64) for codes, _ in strings]
    key_of, decode = _one_key([*columns, h - first_hour])
    low, width = int(latency.min()), int(latency.max() - latency.min()) + 1
    if (int(key_of.max()) + 1) * width < 2**62:
        # Both in one integer, sorted by value alone (no permutation to apply: 3 times faster)
        combined = np.sort(key_of * width + (latency - low))
        key_of, latency = combined // width, combined % width + low
    else:
        order = np.lexsort((latency, key_of))
        key_of, latency = key_of[order], latency[order]
    starts = np.flatnonzero(np.r_[True, key_of[1:] != key_of[:-1]])
    counts = np.diff(np.r_[starts, len(key_of)])
    # m = min(n, K) points a group; point i (1..m) of a group is its ceil(i * n / m)-th value.
    m = np.minimum(counts, SKETCH_POINTS)
    offsets = np.r_[0, np.cumsum(m)]
    group = np.repeat(np.arange(len(starts)), m)
    i = np.arange(offsets[-1], dtype=np.int64) - offsets[group] + 1
    rank = np.maximum((i * counts[group] + m[group] - 1) // m[group], 1)
    points = pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(latency[starts[group] + rank - 1] / 1000.0)
    )
    *codes, h = decode(key_of[starts])
    values = {
        column: pc.take(dictionary, pa.array(c))
        for column, (_, dictionary), c in zip(names, strings, codes, strict=True)
    }
    return _part(
        name,
        **values,
        hour=_hour_start(pa.array(h + first_hour)),
        latency_count=pa.array(counts, pa.int64()),
        latency_points=points,
    )


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
    out = table.group_by(keys, use_threads=False).aggregate(
        [([] if col is None else col, fn) for col, fn in aggregates.values()]
    )
    return out.rename_columns(
        {(fn if col is None else f"{col}_{fn}"): name for name, (col, fn) in aggregates.items()}
        | {k: k for k in keys}
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


def _one_key(columns):
    """(key, decode) of these columns of non-negative integers: one int64 a row that sorts as
    the rows' tuples do, and decode(keys) -> the columns' values of those keys. Mixed radix
    (each column's largest value + 1), decoded by division; should the radices' product not fit
    63 bits (never met: queues x days x names x hours), the rows' rank among the distinct ones."""
    radices = [int(column.max()) + 1 for column in columns]
    if math.prod(radices) < 2**62:
        key = np.zeros(len(columns[0]), dtype=np.int64)
        for column, radix in zip(columns, radices, strict=True):
            key = key * radix + column

        def decode(keys):
            out = []
            for radix in reversed(radices):
                keys, value = np.divmod(keys, radix)
                out.append(value)
            return out[::-1]

        return key, decode
    distinct, key = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
    return key.reshape(-1).astype(np.int64), lambda keys: list(distinct[keys].T)


def _codes(column):
    """(int32 codes, dictionary) of a string column, plain or dictionary-encoded."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()  # unifies the chunks' dictionaries
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    return pc.cast(column.indices, pa.int32()), column.dictionary


def _micros(timestamps):
    return pc.cast(timestamps, pa.int64())


def _timestamps(micros):
    return pc.cast(micros, TIMESTAMP)


def _hour_start(h):
    return _timestamps(pc.multiply(h, HOUR_US))


def _part(name, **columns):
    schema = PART_SCHEMAS[name]
    return pa.Table.from_arrays([columns[f.name] for f in schema], names=schema.names).cast(schema)
