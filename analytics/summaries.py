"""What the dashboard shows of the analytics: the figures the last `manage.py analyze` stored,
read from their tables (never the run's Parquet). The dashboard sits beside this app and imports
nothing of it: analytics.apps hands these readers over at start (mqsite.readers)."""

from datetime import timedelta

from django.db.models import Count, Max, Q, Sum

from . import windows
from .models import (
    AnalyticsFailure,
    AnalyticsRun,
    EventStats,
    EventTrend,
    EventWindowStats,
    Period,
    SubscriberStats,
    SubscriberWindowStats,
)

# The analytics panel: its hourly chart covers the last this many hours of the analyzed
# history (ending at its newest message), and its tables at most this many rows each.
HISTORY_HOURS = 48
HISTORY_ROWS_LIMIT = 100

EVENT_HISTORY_FIELDS = (
    "queue",
    "event",
    "messages",
    "deliveries",
    "pending",
    "inflight",
    "acked",
    "dead",
    "fanout",
    "latency_p50_ms",
    "latency_p95_ms",
    "latency_p99_ms",
    "attempts_mean",
    "dead_letter_rate",
    "messages_per_minute",
    "messages_per_hour",
    "peak_per_minute",
    "peak_per_hour",
    "computed_at",
)


def history():
    """The stored results of the last analytics run (analytics.load), for the dashboard's
    history panel (dashboard.snapshot); `computed_at` None when `analyze` has not stored any
    yet. Three queries, however long the history: the event and subscriber rows (bounded), and
    the messages per hour summed over events for the newest HISTORY_HOURS hours that had any."""
    events = list(
        EventStats.objects.order_by("queue", "event").values(*EVENT_HISTORY_FIELDS)[:HISTORY_ROWS_LIMIT]
    )
    subscribers = [
        {
            "subscriber": s["subscriber"],
            "deliveries": s["deliveries"],
            "pending": s["pending"],
            "inflight": s["inflight"],
            "backlog": s["pending"] + s["inflight"],
            "dead": s["dead"],
            "lag_s": s["oldest_pending_age_s"],
            "computed_at": s["computed_at"],
        }
        for s in SubscriberStats.objects.order_by("-pending", "-inflight", "subscriber").values(
            "subscriber", "deliveries", "pending", "inflight", "dead", "oldest_pending_age_s", "computed_at"
        )[:HISTORY_ROWS_LIMIT]
    ]
    hours = dict(
        EventTrend.objects.filter(period=Period.HOUR)
        .order_by()
        .values_list("period_start")
        .annotate(n=Sum("messages"))
        .order_by("-period_start")[:HISTORY_HOURS]
    )
    # One run writes all three tables in one transaction; the rows name when it ran.
    stamps = [r.pop("computed_at") for r in events + subscribers]
    return {
        "computed_at": max(stamps) if stamps else None,
        "events": events,
        "subscribers": subscribers,
        "hourly": _hourly(hours),
    }


def _hourly(per_hour):
    """{hour: n} as consecutive hours from the oldest given to the newest (at most
    HISTORY_HOURS of them, ending at the newest), the hours without messages as 0."""
    if not per_hour:
        return {"start": None, "messages": []}
    last = max(per_hour)
    start = max(min(per_hour), last - timedelta(hours=HISTORY_HOURS - 1))
    count = int((last - start) / timedelta(hours=1)) + 1
    return {
        "start": start,
        "messages": [per_hour.get(start + timedelta(hours=i), 0) for i in range(count)],
    }


LATENCIES = ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")


def metrics():
    """The last loaded analytics run for /metrics (dashboard.metrics): {"run": its time, length
    and partitions, or None, "events": [(queue, event, messages, dead_letter_rate, p50, p95,
    p99)], "windows": {"events": [(window, queue, event, messages, deliveries, dead, p50, p95,
    p99)], "subscribers": [(window, subscriber, p50, p95, p99)], "since": {window: its start}},
    "failures": failures()} over every queue, event and subscriber (rows per queue, event and
    subscriber, so few; "all" the whole history's), or None before any run, loaded or failed.
    Two queries with no run loaded, five after one: the stored figures, never the run's
    Parquet."""
    run = (
        AnalyticsRun.objects.order_by("-loaded_at", "-id")
        .values("finished_at", "duration_s", "partitions_recomputed", "partitions_reused", "loaded_at", "now")
        .first()
    )
    failed = failures(run["loaded_at"] if run else None)
    if run is None and failed["last_failed_at"] is None:
        return None
    if run is None:  # only failed runs so far: nothing to show but that
        return {"run": None, "events": [], "failures": failed}
    stats = EventStats.objects.order_by("queue", "event").values_list(
        "queue", "event", "messages", "deliveries", "dead", "dead_letter_rate", *LATENCIES
    )
    events, window_events = [], []
    for queue, event, messages, deliveries, dead, rate, *latencies in stats:
        events.append([queue, event, messages, rate, *latencies])
        # The whole history's as window "all", beside the recent windows'.
        window_events.append(["all", queue, event, messages, deliveries, dead, *latencies])
    window_events += [
        list(e)
        for e in EventWindowStats.objects.order_by("window", "queue", "event").values_list(
            "window", "queue", "event", "messages", "deliveries", "dead", *LATENCIES
        )
    ]
    subscribers = [
        list(s)
        for s in SubscriberWindowStats.objects.order_by("window", "subscriber").values_list(
            "window", "subscriber", *LATENCIES
        )
    ]
    subscribers += [
        ["all", *s]
        for s in SubscriberStats.objects.order_by("subscriber").values_list("subscriber", *LATENCIES)
    ]
    since = {name: windows.start_of(run["now"], span) for name, span in windows.WINDOWS.items()}
    return {
        "run": run,
        "events": events,
        "windows": {"events": window_events, "subscribers": subscribers, "since": since},
        "failures": failed,
    }


def failures(loaded_at):
    """{"since_run": runs on beat that failed after the last run was loaded at `loaded_at`
    (None: no run, all of them), "last_failed_at": when the newest failed, or None}. One
    query, whatever the failures kept."""
    since = Count("id") if loaded_at is None else Count("id", filter=Q(failed_at__gt=loaded_at))
    return AnalyticsFailure.objects.aggregate(since_run=since, last_failed_at=Max("failed_at"))
