"""What GET /api/analytics answers: the last loaded run and its age, the runs on beat that failed
since (analytics.tasks), its statistics as `analyze --json` prints them
(analytics.stored.results_json), and, when asked, its hourly or daily trends.

All from the tables analytics.load fills, never from the run's Parquet: an answer costs a few
indexed queries, however large the history.
"""

from django.utils import timezone

from .models import AnalyticsFailure, EventTrend, SubscriberTrend
from .stored import last_run, results_json, run_json, windows_json
from .summaries import failures

# Rows of each trend list in one answer: a year of hours of one event is 8,760, so a narrower
# query (queue, event, since) fits; past it the answer says so ("truncated") and holds the
# first rows in (queue, event, time) order.
TRENDS_LIMIT = 10_000


def analytics_answer(trends=None, *, queue=None, event=None, subscriber=None, since=None, until=None):
    """{"run": manifest and its age | None, "failures": the runs on beat that failed,
    "events": [...], "subscribers": [...], "windows": the last hour's and 24 hours' figures
    (stored.windows_json)}, and "trends" when `trends` is "hour" or "day": its event and
    subscriber rows with period_start in [since, until), queue and event narrowing the event
    trends, subscriber the subscriber ones."""
    run = last_run()
    answer = {"run": run_json(run), "failures": _failures(run), **results_json(), "windows": windows_json()}
    if run is not None:
        # How old the figures are: a run that failed since left them as they were.
        answer["run"]["age_s"] = round((timezone.now() - run.finished_at).total_seconds(), 3)
    if trends is not None:
        answer["trends"] = trend_rows(
            trends, queue=queue, event=event, subscriber=subscriber, since=since, until=until
        )
    return answer


def _failures(run):
    failed = failures(run.loaded_at if run else None)
    last = None
    if failed["last_failed_at"] is not None:
        newest = AnalyticsFailure.objects.order_by("-failed_at", "-id").first()
        last = {"failed_at": newest.failed_at.isoformat(), "error": newest.error}
    return {"since_run": failed["since_run"], "last": last}


def trend_rows(period, *, queue=None, event=None, subscriber=None, since=None, until=None):
    spans = {}
    if since is not None:
        spans["period_start__gte"] = since
    if until is not None:
        spans["period_start__lt"] = until
    events = EventTrend.objects.filter(period=period, **spans)
    if queue is not None:
        events = events.filter(queue=queue)
    if event is not None:
        events = events.filter(event=event)
    subscribers = SubscriberTrend.objects.filter(period=period, **spans)
    if subscriber is not None:
        subscribers = subscribers.filter(subscriber=subscriber)
    event_rows = list(events.order_by("queue", "event", "period_start")[: TRENDS_LIMIT + 1])
    subscriber_rows = list(subscribers.order_by("subscriber", "period_start")[: TRENDS_LIMIT + 1])
    return {
        "period": period,
        "events": [_event_trend(t) for t in event_rows[:TRENDS_LIMIT]],
        "subscribers": [_subscriber_trend(t) for t in subscriber_rows[:TRENDS_LIMIT]],
        "truncated": len(event_rows) > TRENDS_LIMIT or len(subscriber_rows) > TRENDS_LIMIT,
    }


def _event_trend(t):
    return {
        "queue": t.queue,
        "event": t.event,
        "period_start": t.period_start.isoformat(),
        "messages": t.messages,
        "deliveries": t.deliveries,
        "acked": t.acked,
        "dead": t.dead,
        "dead_letter_rate": t.dead_letter_rate,
        "latency_ms": {"p50": t.latency_p50_ms, "p95": t.latency_p95_ms, "p99": t.latency_p99_ms},
    }


def _subscriber_trend(t):
    return {
        "subscriber": t.subscriber,
        "period_start": t.period_start.isoformat(),
        "published": t.published,
        "acked": t.acked,
        "backlog": t.backlog,
    }
