"""The figures operators read, from the hour rows (analytics.job's EVENT_HOUR_COLUMNS and
SUBSCRIBER_HOUR_COLUMNS) of the archive and the hot tables: per queue and event, per
subscriber, and their trends per hour and per day.

Every figure is a sum, a minimum, a maximum or a sketch merge of hour rows, so the same code
serves the whole history, a window of days (--since/--until), an hour and a day. The archive
and the hot tables can each hold part of an hour (a message kept back by a dead letter): their
rows of that hour are merged first, then read.

All of it over whole columns (analytics.groups, analytics.sketch.Sketches), no Python loop per
row: a few months of history are tens of thousands of event hours and millions of subscriber
hour rows, which Python objects for each took most of a rerun's minute (issue 32). The stats are
returned as dicts (a row per queue and event, per subscriber), the trends as Arrow tables.
"""

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import windows
from .groups import Groups, number
from .job import HOUR_US, MINUTE_US, STATUSES
from .sketch import Sketches

PERCENTILES = (0.5, 0.95, 0.99)

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
DAY_US = 24 * HOUR_US
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def in_window(day, since=None, until=None):
    """Whether a day ("YYYY-MM-DD") is within since..until, both included (None: open)."""
    return (since is None or day >= since.isoformat()) and (until is None or day <= until.isoformat())


def event_figures(table, *, since=None, until=None):
    """(event stats, event trends) from event hour rows (an Arrow table in
    analytics.hours.EVENT_HOUR_SCHEMA; several rows of one hour are added up): the stats as
    dicts in RESULT_SCHEMAS["event_stats"], by queue and event; the trends a table in
    RESULT_SCHEMAS["event_trends"], its hours then its days, each by queue, event and start."""
    events = _EventHours(_in_window(table, since, until))
    return events.stats(), events.trends()


class _EventHours:
    """Event hour rows added up per queue, event and hour, what every event figure reads."""

    def __init__(self, table):
        self.hours = Groups.by(table, ["queue", "event", "hour"])
        self.sums = {c: self.hours.sum(table[c]) for c in COUNTED}
        self.first_at = self.hours.earliest(table["first_at"])
        self.last_at = self.hours.latest(table["last_at"])
        self.peak_minute = _peak_minutes(table, self.hours)
        self.sketches = Sketches(table["latency_count"], table["latency_points"])

    def stats(self):
        keys = self.hours.keys
        events = Groups.by(keys, ["queue", "event"])
        sums = {c: events.sum(self.sums[c]) for c in COUNTED}
        first, last = events.earliest(self.first_at), events.latest(self.last_at)
        return pa.table(
            {
                "queue": events.keys["queue"],
                "event": events.keys["event"],
                **{c: sums[c] for c in ("messages", "deliveries", *STATUSES)},
                "fanout": _ratio(sums["deliveries"], sums["messages"]),
                **self._latency(events),
                "attempts_mean": _ratio(sums["attempts_sum"], sums["acked"] + sums["dead"]),
                "dead_letter_rate": _ratio(sums["dead"], sums["deliveries"]),
                # Means over the minutes (hours) from the first message's to the last's, both included.
                "messages_per_minute": _per(sums["messages"], first, last, MINUTE_US),
                "messages_per_hour": _per(sums["messages"], first, last, HOUR_US),
                "peak_per_minute": events.largest(self.peak_minute),
                "peak_per_hour": events.largest(self.sums["messages"]),
                "first_published_at": first,
                "last_published_at": last,
            },
            schema=RESULT_SCHEMAS["event_stats"],
        ).to_pylist()

    def trends(self):
        keys = self.hours.keys
        days = Groups.by(
            pa.table({"queue": keys["queue"], "event": keys["event"], "day": _day_starts(keys["hour"])}),
            ["queue", "event", "day"],
        )
        by_hour = self._trend("hour", keys, Groups(np.arange(self.hours.size), self.hours.size), "hour")
        return pa.concat_tables([by_hour, self._trend("day", days.keys, days, "day")])

    def _trend(self, period, keys, groups, start):
        """The trend rows of `groups` of the hours (`keys` their keys, the column `start` their
        period's start)."""
        sums = {c: groups.sum(self.sums[c]) for c in ("messages", "deliveries", "acked", "dead")}
        return pa.table(
            {
                "queue": keys["queue"],
                "event": keys["event"],
                "period": pa.repeat(period, groups.size),
                "period_start": keys[start],
                **sums,
                "dead_letter_rate": _ratio(sums["dead"], sums["deliveries"]),
                **self._latency(groups),
            },
            schema=RESULT_SCHEMAS["event_trends"],
        )

    def _latency(self, groups):
        """The latency percentiles of `groups` of the hours: the merge of their rows' sketches."""
        return _latency_columns(
            *self.sketches.quantiles(groups.of_rows(self.hours).of, groups.size, PERCENTILES)
        )


def _peak_minutes(table, hours):
    """Each hour's busiest minute: the counts of each minute of its rows added up first (the
    archive and the hot tables can each hold part of a minute), then the largest; 0 for none."""
    minute_counts = table["minute_counts"].combine_chunks()
    parents = pc.list_parent_indices(minute_counts).to_numpy()
    flat = pc.list_flatten(minute_counts)
    minute = pc.struct_field(flat, "minute").to_numpy(zero_copy_only=False).astype(np.int64)
    if not len(minute):
        return np.zeros(hours.size, np.int64)
    minutes, (hour, _) = number([hours.of[parents], minute - minute.min()])
    per_minute = Groups(minutes, len(hour)).sum(pc.struct_field(flat, "n"))
    return Groups(hour, hours.size).largest(per_minute)


def subscriber_figures(table, *, now, since=None, until=None):
    """(subscriber stats, subscriber trends) from subscriber hour rows (an Arrow table in
    analytics.hours.SUBSCRIBER_HOUR_SCHEMA): the stats as dicts in
    RESULT_SCHEMAS["subscriber_stats"], by subscriber; the trends a table in
    RESULT_SCHEMAS["subscriber_trends"], its hours then its days, each by subscriber and start.

    The backlog of a period is what the subscriber was owed at its end: the deliveries made
    up to then, less those acked by then and those dead letters (counted from the hour their
    message was published: a dead letter keeps no time of its death).
    """
    stats, trends, _ = subscriber_results(table, now=now, since=since, until=until)
    return stats, trends


def subscriber_results(table, *, now, since=None, until=None):
    """subscriber_figures' (stats, trends) and each subscriber's oldest pending delivery (a
    table of subscriber and oldest_pending_at, in the order of the stats): what a later run
    with nothing new makes the stats' ages again from (analytics.reuse)."""
    subscribers = _SubscriberHours(_in_window(table, since, until))
    return subscribers.stats(now), subscribers.trends(), subscribers.oldest()


class _SubscriberHours:
    """Subscriber hour rows, grouped per subscriber and hour."""

    def __init__(self, table):
        self.table = table
        self.hours = Groups.by(table, ["subscriber", "hour"])
        self.subscribers = Groups.by(self.hours.keys, ["subscriber"])
        self._oldest = None

    def oldest(self):
        """Each subscriber's oldest pending delivery (null for none), in the stats' order."""
        if self._oldest is None:
            subscribers = self.subscribers.of_rows(self.hours)
            self._oldest = pa.table(
                {
                    "subscriber": subscribers.keys["subscriber"],
                    "oldest_pending_at": subscribers.earliest(self.table["oldest_pending_at"]),
                }
            )
        return self._oldest

    def stats(self, now):
        table, subscribers = self.table, self.subscribers.of_rows(self.hours)
        sums = {c: subscribers.sum(table[c]) for c in ("published", *STATUSES)}
        sketches = Sketches(table["latency_count"], table["latency_points"])
        return pa.table(
            {
                "subscriber": subscribers.keys["subscriber"],
                "deliveries": sums["published"],
                **{s: sums[s] for s in STATUSES},
                "oldest_pending_age_s": pending_ages(self.oldest()["oldest_pending_at"], now),
                **_latency_columns(*sketches.quantiles(subscribers.of, subscribers.size, PERCENTILES)),
            },
            schema=RESULT_SCHEMAS["subscriber_stats"],
        ).to_pylist()

    def trends(self):
        keys, hours = self.hours.keys, self.hours
        published, acks = hours.sum(self.table["published"]), hours.sum(self.table["acks"])
        # The hours are in order of subscriber then hour: a running sum per subscriber.
        backlog = _running_sums(published - acks - hours.sum(self.table["dead"]), self.subscribers.of)
        days = Groups.by(
            pa.table({"subscriber": keys["subscriber"], "day": _day_starts(keys["hour"])}),
            ["subscriber", "day"],
        )
        # A day's backlog is its last hour's.
        last_hour = days.largest(np.arange(hours.size))
        return pa.concat_tables(
            [
                _subscriber_trend("hour", keys["subscriber"], keys["hour"], published, acks, backlog),
                _subscriber_trend(
                    "day",
                    days.keys["subscriber"],
                    days.keys["day"],
                    days.sum(published),
                    days.sum(acks),
                    backlog[last_hour],
                ),
            ]
        )


def pending_ages(oldest, now):
    """The age in seconds at `now` of each oldest pending delivery (an Arrow timestamp column),
    null for none."""
    now_us = (now - _EPOCH) // _MICROSECOND
    return _ratio(now_us - _micros(oldest), np.where(_numpy_valid(oldest), 1_000_000, 0))


def _subscriber_trend(period, subscriber, start, published, acked, backlog):
    return pa.table(
        {
            "subscriber": subscriber,
            "period": pa.repeat(period, len(subscriber)),
            "period_start": start,
            "published": published,
            "acked": acked,
            "backlog": backlog,
        },
        schema=RESULT_SCHEMAS["subscriber_trends"],
    )


def _running_sums(values, group):
    """Each value's running sum within its group, the values of a group one after another."""
    total = np.cumsum(values)
    first = np.searchsorted(group, group)
    return total - (total - values)[first]


def window_figures(rows, now):
    """(event window rows, subscriber window rows) in RESULT_SCHEMAS["event_windows"] and
    ["subscriber_windows"], for each of analytics.windows.WINDOWS before `now`, from hour rows
    ({"events": event hour rows, "subscribers": subscriber hour rows}, the archive's and the
    hot tables' together): what was published in the window, its states as the run saw them,
    the latency of those acked."""
    events, subscribers = [], []
    for name, span in windows.WINDOWS.items():
        since = windows.start_of(now, span)
        event_stats = _EventHours(from_hour(rows["events"], since)).stats()
        events.extend(
            {"window": name, "since": since, **{f: s[f] for f in WINDOW_EVENT_FIELDS}} for s in event_stats
        )
        subscriber_stats = _SubscriberHours(from_hour(rows["subscribers"], since)).stats(now)
        subscribers.extend(
            {"window": name, "since": since, **{f: s[f] for f in WINDOW_SUBSCRIBER_FIELDS}}
            for s in subscriber_stats
        )
    return events, subscribers


WINDOW_EVENT_FIELDS = RESULT_SCHEMAS["event_windows"].names[2:]
WINDOW_SUBSCRIBER_FIELDS = RESULT_SCHEMAS["subscriber_windows"].names[2:]


def from_hour(table, since):
    """The rows of the hours starting at or after `since`."""
    return table.filter(pc.greater_equal(table["hour"], pa.scalar(since, table.schema.field("hour").type)))


def _in_window(table, since, until):
    """The rows of days within since..until (both included; None: open)."""
    if since is not None:
        table = table.filter(pc.greater_equal(table["day"], since.isoformat()))
    if until is not None:
        table = table.filter(pc.less_equal(table["day"], until.isoformat()))
    return table


def _latency_columns(values, found):
    return {f"latency_p{p}_ms": pa.array(values[:, i], mask=~found) for i, p in enumerate(("50", "95", "99"))}


def _ratio(numerator, denominator):
    """numerator / denominator (integers, as Python divides them: each made a float exactly,
    then divided), null where the denominator is 0."""
    zero = denominator == 0
    return pa.array(np.divide(numerator, np.where(zero, 1, denominator)), mask=zero)


def _per(messages, first, last, unit):
    """Messages per unit (a minute, an hour in microseconds) over the units from the first
    message's to the last's, both included; null with no messages or no time."""
    spanned = _micros(last) // unit - _micros(first) // unit + 1
    return _ratio(messages, np.where((messages == 0) | ~_numpy_valid(first), 0, spanned))


def _day_starts(hours):
    """The start of each hour's day (UTC)."""
    return pa.array(_micros(hours) // DAY_US * DAY_US).cast(hours.type)


def _micros(times):
    return pc.fill_null(pc.cast(times, pa.int64()), 0).to_numpy(zero_copy_only=False)


def _numpy_valid(column):
    return pc.is_valid(column).to_numpy(zero_copy_only=False)
