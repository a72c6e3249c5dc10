"""The figures operators read, from the hour rows (analytics.job's EVENT_HOUR_COLUMNS and
SUBSCRIBER_HOUR_COLUMNS) of the archive and the hot tables: per queue and event, per
subscriber, and their trends per hour and per day.

Every figure is a sum, a minimum, a maximum or a sketch merge of hour rows, so the same code
serves the whole history, a window of days (--since/--until), an hour and a day. The archive
and the hot tables can each hold part of an hour (a message kept back by a dead letter): their
rows of that hour are merged first, then read.
"""

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc

from . import windows
from .job import STATUSES
from .sketch import Merged

PERCENTILES = (0.5, 0.95, 0.99)
PERIODS = ("hour", "day")

_TS = pa.timestamp("us", tz="UTC")
_LATENCIES = [(f"latency_p{p}_ms", pa.float64()) for p in ("50", "95", "99")]
# What a run writes to its folder (analytics.analysis) and analytics.load stores.
RESULT_SCHEMAS = {
    "event_stats": pa.schema(
        [
            ("queue", pa.string()),
            ("event", pa.string()),
            ("messages", pa.int64()),
            ("deliveries", pa.int64()),
            *[(s, pa.int64()) for s in STATUSES],
            ("fanout", pa.float64()),
            *_LATENCIES,
            ("attempts_mean", pa.float64()),
            ("dead_letter_rate", pa.float64()),
            ("messages_per_minute", pa.float64()),
            ("messages_per_hour", pa.float64()),
            ("peak_per_minute", pa.int64()),
            ("peak_per_hour", pa.int64()),
            ("first_published_at", _TS),
            ("last_published_at", _TS),
        ]
    ),
    "subscriber_stats": pa.schema(
        [
            ("subscriber", pa.string()),
            ("deliveries", pa.int64()),
            *[(s, pa.int64()) for s in STATUSES],
            ("oldest_pending_age_s", pa.float64()),
            *_LATENCIES,
        ]
    ),
    "event_trends": pa.schema(
        [
            ("queue", pa.string()),
            ("event", pa.string()),
            ("period", pa.string()),
            ("period_start", _TS),
            *[(c, pa.int64()) for c in ("messages", "deliveries", "acked", "dead")],
            ("dead_letter_rate", pa.float64()),
            *_LATENCIES,
        ]
    ),
    "subscriber_trends": pa.schema(
        [
            ("subscriber", pa.string()),
            ("period", pa.string()),
            ("period_start", _TS),
            *[(c, pa.int64()) for c in ("published", "acked", "backlog")],
        ]
    ),
    # The last hour and the last 24 hours (analytics.windows).
    "event_windows": pa.schema(
        [
            ("window", pa.string()),
            ("since", _TS),
            ("queue", pa.string()),
            ("event", pa.string()),
            *[(c, pa.int64()) for c in ("messages", "deliveries", "acked", "dead")],
            ("dead_letter_rate", pa.float64()),
            *_LATENCIES,
        ]
    ),
    "subscriber_windows": pa.schema(
        [
            ("window", pa.string()),
            ("since", _TS),
            ("subscriber", pa.string()),
            *[(c, pa.int64()) for c in ("deliveries", "acked", "dead")],
            *_LATENCIES,
        ]
    ),
}


COUNTED = ("messages", "deliveries", *STATUSES, "attempts_sum")


@dataclass
class Sums:
    """Counts added up, and the span from the first message to the last."""

    messages: int = 0
    deliveries: int = 0
    pending: int = 0
    inflight: int = 0
    acked: int = 0
    dead: int = 0
    attempts_sum: int = 0
    first_at: datetime | None = None
    last_at: datetime | None = None

    def add_sums(self, value_of, first_at, last_at):
        for name in COUNTED:
            setattr(self, name, getattr(self, name) + value_of(name))
        self.first_at = _least(self.first_at, first_at)
        self.last_at = _greatest(self.last_at, last_at)


@dataclass
class Hour(Sums):
    """One queue, event and hour, its rows (the archive's and the hot tables') added up."""

    peak_minute: int = 0
    sketches: list = field(default_factory=list)


@dataclass
class Totals(Sums):
    """Hours added together: a day, or a queue and event's whole window."""

    peak_per_minute: int = 0
    peak_per_hour: int = 0
    latency: Merged = field(default_factory=Merged)

    def add_hour(self, hour):
        self.add_sums(lambda name: getattr(hour, name), hour.first_at, hour.last_at)
        self.peak_per_minute = max(self.peak_per_minute, hour.peak_minute)
        self.peak_per_hour = max(self.peak_per_hour, hour.messages)
        for points, count in hour.sketches:
            self.latency.add(points, count)

    def latency_ms(self):
        return dict(zip(("p50", "p95", "p99"), self.latency.quantiles(PERCENTILES), strict=True))

    def dead_letter_rate(self):
        return self.dead / self.deliveries if self.deliveries else None


def in_window(day, since=None, until=None):
    """Whether a day ("YYYY-MM-DD") is within since..until, both included (None: open)."""
    return (since is None or day >= since.isoformat()) and (until is None or day <= until.isoformat())


def event_figures(table, *, since=None, until=None):
    """(event stats, event trends) from event hour rows (an Arrow table in
    analytics.hours.EVENT_HOUR_SCHEMA; several rows of one hour are added up).

    The sums, spans and peaks by Arrow's group_by, the sketches merged in Python: a history
    of many queues has hundreds of thousands of hour rows, which Python objects for every row
    took seconds to add up."""
    table = _in_window(table, since, until)
    keys = ["queue", "event", "hour"]
    hours = _hour_sums(table, keys)
    sketches = _hour_sketches(table)

    totals = defaultdict(Totals)
    days = defaultdict(Totals)
    hour_rows = []
    for row in hours.to_pylist():
        key = (row["queue"], row["event"])
        hour = Hour(
            **{name: row[name] or 0 for name in COUNTED}, first_at=row["first_at"], last_at=row["last_at"]
        )
        hour.peak_minute = row["peak_minute"] or 0
        hour.sketches = sketches.get((*key, row["hour"]), ())
        totals[key].add_hour(hour)
        days[(*key, _day_start(row["hour"]))].add_hour(hour)
        hour_rows.append(_trend(*key, "hour", row["hour"], hour, _latency_of(hour.sketches)))

    stats = [_event_stats(queue, event, t) for (queue, event), t in sorted(totals.items())]
    day_rows = [_trend(q, e, "day", start, t, t.latency_ms()) for (q, e, start), t in sorted(days.items())]
    hour_rows.sort(key=lambda r: (r["queue"], r["event"], r["period_start"]))
    return stats, hour_rows + day_rows


def _hour_sums(table, keys):
    """One row per queue, event and hour: its rows' counts added up, the span of its messages
    and its busiest minute (`peak_minute`: the minutes' counts of its rows added up first)."""
    sums = table.group_by(keys, use_threads=False).aggregate(
        [(c, "sum") for c in COUNTED] + [("first_at", "min"), ("last_at", "max")]
    )
    sums = sums.rename_columns(
        {f"{c}_sum": c for c in COUNTED}
        | {"first_at_min": "first_at", "last_at_max": "last_at"}
        | {k: k for k in keys}
    )
    minute_counts = table["minute_counts"].combine_chunks()
    parents = pc.list_parent_indices(minute_counts)
    flat = pc.list_flatten(minute_counts)
    minutes = pa.table(
        {
            **{k: pc.take(table[k], parents) for k in keys},
            "minute": pc.struct_field(flat, "minute"),
            "n": pc.struct_field(flat, "n"),
        }
    )
    per_minute = minutes.group_by([*keys, "minute"], use_threads=False).aggregate([("n", "sum")])
    peaks = per_minute.group_by(keys, use_threads=False).aggregate([("n_sum", "max")])
    peaks = peaks.rename_columns({"n_sum_max": "peak_minute"} | {k: k for k in keys})
    return sums.join(peaks, keys, join_type="left outer")


def _hour_sketches(table):
    """{(queue, event, hour): [(points, count), ...]} of the rows with a sketch, the points as
    numpy slices rather than Python floats (200 a row)."""
    with_sketch = table.filter(pc.greater(table["latency_count"], 0))
    points = with_sketch["latency_points"].combine_chunks()
    values, offsets = points.values.to_numpy(zero_copy_only=False), points.offsets.to_numpy()
    out = defaultdict(list)
    columns = zip(
        with_sketch["queue"].to_pylist(),
        with_sketch["event"].to_pylist(),
        with_sketch["hour"].to_pylist(),
        with_sketch["latency_count"].to_pylist(),
        strict=True,
    )
    for i, (queue, event, hour, count) in enumerate(columns):
        if offsets[i + 1] > offsets[i]:
            out[(queue, event, hour)].append((values[offsets[i] : offsets[i + 1]], count))
    return out


def _latency_of(sketches):
    merged = Merged()
    for points, count in sketches:
        merged.add(points, count)
    return dict(zip(("p50", "p95", "p99"), merged.quantiles(PERCENTILES), strict=True))


def _trend(queue, event, period, start, t, latency):
    return {
        "queue": queue,
        "event": event,
        "period": period,
        "period_start": start,
        "messages": t.messages,
        "deliveries": t.deliveries,
        "acked": t.acked,
        "dead": t.dead,
        "dead_letter_rate": t.dead / t.deliveries if t.deliveries else None,
        **{f"latency_{k}_ms": v for k, v in latency.items()},
    }


def _event_stats(queue, event, t):
    settled = t.acked + t.dead
    latency = t.latency_ms()
    return {
        "queue": queue,
        "event": event,
        "messages": t.messages,
        "deliveries": t.deliveries,
        **{s: getattr(t, s) for s in STATUSES},
        "fanout": t.deliveries / t.messages if t.messages else None,
        "latency_p50_ms": latency["p50"],
        "latency_p95_ms": latency["p95"],
        "latency_p99_ms": latency["p99"],
        "attempts_mean": t.attempts_sum / settled if settled else None,
        "dead_letter_rate": t.dead_letter_rate(),
        # Means over the minutes (hours) from the first message's to the last's, both included.
        "messages_per_minute": _per(t, timedelta(minutes=1)),
        "messages_per_hour": _per(t, timedelta(hours=1)),
        "peak_per_minute": t.peak_per_minute,
        "peak_per_hour": t.peak_per_hour,
        "first_published_at": t.first_at,
        "last_published_at": t.last_at,
    }


def _per(t, unit):
    if not t.messages or t.first_at is None:
        return None
    first = _truncate(t.first_at, unit)
    last = _truncate(t.last_at, unit)
    return t.messages / ((last - first) // unit + 1)


def subscriber_figures(table, *, now, since=None, until=None):
    """(subscriber stats, subscriber trends) from subscriber hour rows (an Arrow table in
    analytics.hours.SUBSCRIBER_HOUR_SCHEMA).

    The backlog of a period is what the subscriber was owed at its end: the deliveries made
    up to then, less those acked by then and those dead letters (counted from the hour their
    message was published: a dead letter keeps no time of its death).
    """
    table = _in_window(table, since, until)
    totals = _group(
        table,
        ["subscriber"],
        [(c, "sum") for c in ("published", *STATUSES)] + [("oldest_pending_at", "min")],
    )
    latency = subscriber_latency(table)
    stats = [
        {
            "subscriber": t["subscriber"],
            "deliveries": t["published"],
            **{s: t[s] for s in STATUSES},
            "oldest_pending_age_s": (
                (now - t["oldest_pending_at"]).total_seconds() if t["oldest_pending_at"] is not None else None
            ),
            **{f"latency_{k}_ms": v for k, v in latency[t["subscriber"]].latency_ms().items()},
        }
        for t in sorted(totals, key=lambda t: t["subscriber"])
    ]

    hours = sorted(
        _group(table, ["subscriber", "hour"], [(c, "sum") for c in ("published", "acks", "dead")]),
        key=lambda h: (h["subscriber"], h["hour"]),
    )
    trends = []
    for period in PERIODS:
        owed = defaultdict(int)
        grouped = defaultdict(lambda: defaultdict(int))
        for h in hours:
            name = h["subscriber"]
            start = h["hour"] if period == "hour" else _day_start(h["hour"])
            owed[name] += h["published"] - h["acks"] - h["dead"]
            g = grouped[(name, start)]
            g["published"] += h["published"]
            g["acked"] += h["acks"]
            g["backlog"] = owed[name]  # the last hour's running total: the period's end
        trends.extend(
            {"subscriber": name, "period": period, "period_start": start, **g}
            for (name, start), g in sorted(grouped.items())
        )
    return stats, trends


def subscriber_latency(table):
    """{subscriber: Totals whose latency is the merge of its hours' sketches} of subscriber hour
    rows (the other sums are left at 0: only latency_ms() is read). The points as numpy slices,
    as _hour_sketches takes them: a Python float each was most of a rerun's figures."""
    merged = defaultdict(Totals)
    with_sketch = table.filter(pc.greater(table["latency_count"], 0))
    points = with_sketch["latency_points"].combine_chunks()
    values, offsets = points.values.to_numpy(zero_copy_only=False), points.offsets.to_numpy()
    names, counts = with_sketch["subscriber"].to_pylist(), with_sketch["latency_count"].to_pylist()
    for i, (name, count) in enumerate(zip(names, counts, strict=True)):
        merged[name].latency.add(values[offsets[i] : offsets[i + 1]], count)
    return merged


def window_figures(rows, now):
    """(event window rows, subscriber window rows) in RESULT_SCHEMAS["event_windows"] and
    ["subscriber_windows"], for each of analytics.windows.WINDOWS before `now`, from hour rows
    ({"events": event hour rows, "subscribers": subscriber hour rows}, the archive's and the
    hot tables' together): what was published in the window, its states as the run saw them,
    the latency of those acked."""
    events, subscribers = [], []
    for name, span in windows.WINDOWS.items():
        since = windows.start_of(now, span)
        event_stats, _ = event_figures(_from_hour(rows["events"], since))
        events.extend(
            {"window": name, "since": since, **{f: s[f] for f in WINDOW_EVENT_FIELDS}} for s in event_stats
        )
        subscriber_stats, _ = subscriber_figures(_from_hour(rows["subscribers"], since), now=now)
        subscribers.extend(
            {"window": name, "since": since, **{f: s[f] for f in WINDOW_SUBSCRIBER_FIELDS}}
            for s in subscriber_stats
        )
    return events, subscribers


WINDOW_EVENT_FIELDS = RESULT_SCHEMAS["event_windows"].names[2:]
WINDOW_SUBSCRIBER_FIELDS = RESULT_SCHEMAS["subscriber_windows"].names[2:]


def _from_hour(table, since):
    """The rows of the hours starting at or after `since`."""
    return table.filter(pc.greater_equal(table["hour"], pa.scalar(since, table.schema.field("hour").type)))


def _in_window(table, since, until):
    """The rows of days within since..until (both included; None: open)."""
    if since is not None:
        table = table.filter(pc.greater_equal(table["day"], since.isoformat()))
    if until is not None:
        table = table.filter(pc.less_equal(table["day"], until.isoformat()))
    return table


def _group(table, keys, aggregates):
    """group_by(keys).aggregate(aggregates) as dicts, each aggregate under its column's name."""
    out = table.group_by(keys, use_threads=False).aggregate(aggregates)
    return out.rename_columns({f"{c}_{fn}": c for c, fn in aggregates}).to_pylist()


def _least(a, b):
    return b if a is None else a if b is None else min(a, b)


def _greatest(a, b):
    return b if a is None else a if b is None else max(a, b)


def _day_start(moment):
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def _truncate(moment, unit):
    if unit == timedelta(minutes=1):
        return moment.replace(second=0, microsecond=0)
    return moment.replace(minute=0, second=0, microsecond=0)
