"""Load: the job's Parquet results into the Django tables the admin shows, and the JSON of
`analyze --json` from them.

Reads the results with pyarrow (they are small), so it works the same whether the job ran in
this process or was spark-submitted to a cluster that wrote them to shared storage.
"""

import math

import pyarrow.parquet as pq
from django.db import transaction

from . import layout
from .models import EventRate, EventStats, SubscriberStats

EVENT_FIELDS = [f.name for f in EventStats._meta.concrete_fields if f.name not in ("id", "computed_at")]
SUBSCRIBER_FIELDS = [
    f.name for f in SubscriberStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]


def read_result(out, name):
    """One result of the job as a list of dicts."""
    fs, base = layout.filesystem(out)
    return pq.read_table(f"{base}/{name}", filesystem=fs).to_pylist()


def load_results(out, computed_at):
    """Replace the stored statistics with the run's under `out`; returns how many rows of each."""
    events = [_clean(r, EVENT_FIELDS) for r in read_result(out, "event_stats")]
    rates = read_result(out, "event_rates_hour")
    subscribers = [_clean(r, SUBSCRIBER_FIELDS) for r in read_result(out, "subscriber_stats")]
    with transaction.atomic():
        EventStats.objects.all().delete()
        EventRate.objects.all().delete()
        SubscriberStats.objects.all().delete()
        EventStats.objects.bulk_create(
            [EventStats(**r, computed_at=computed_at) for r in events], batch_size=500
        )
        EventRate.objects.bulk_create(
            [
                EventRate(
                    queue=r["queue"],
                    event=r["event"],
                    hour=r["period_start"],
                    messages=r["messages"],
                    computed_at=computed_at,
                )
                for r in rates
            ],
            batch_size=1000,
        )
        SubscriberStats.objects.bulk_create(
            [SubscriberStats(**r, computed_at=computed_at) for r in subscribers], batch_size=500
        )
    return {"events": len(events), "rates": len(rates), "subscribers": len(subscribers)}


def _clean(row, fields):
    # NaN (0/0 in Spark) is not a number a database or JSON should hold: store null.
    return {f: None if isinstance(row.get(f), float) and math.isnan(row[f]) else row.get(f) for f in fields}


# Beyond the fields ../shared/API.md lists (which keep their names and meaning), `--json` adds
# the job's other figures: a reader of the contract's fields sees no change.
EVENT_EXTRAS = (
    "pending",
    "inflight",
    "fanout",
    "dead_letter_rate",
    "messages_per_minute",
    "messages_per_hour",
    "peak_per_minute",
    "peak_per_hour",
)
SUBSCRIBER_EXTRAS = ("deliveries", "inflight", "backlog", "lag_s")


def results_json():
    """The stored statistics as `analyze --json` prints them: the fields of ../shared/API.md,
    and the extras above (and the span of each event's messages, as ISO times)."""
    return {
        "events": [
            {
                "queue": s.queue,
                "event": s.event,
                "messages": s.messages,
                "deliveries": s.deliveries,
                "acked": s.acked,
                "dead": s.dead,
                "latency_ms": {"p50": s.latency_p50_ms, "p95": s.latency_p95_ms, "p99": s.latency_p99_ms},
                "attempts_mean": s.attempts_mean,
                **{f: getattr(s, f) for f in EVENT_EXTRAS},
                "first_published_at": _iso(s.first_published_at),
                "last_published_at": _iso(s.last_published_at),
            }
            for s in EventStats.objects.order_by("queue", "event")
        ],
        "subscribers": [
            {
                "subscriber": s.subscriber,
                "pending": s.pending,
                "oldest_pending_age_s": s.oldest_pending_age_s,
                "acked": s.acked,
                "dead": s.dead,
                "deliveries": s.deliveries,
                "inflight": s.inflight,
                # What it is still owed (pending and in flight), and how far behind it is: the
                # age of its oldest pending delivery at the run (oldest_pending_age_s again,
                # under the name the issue asks for).
                "backlog": s.pending + s.inflight,
                "lag_s": s.oldest_pending_age_s,
            }
            for s in SubscriberStats.objects.order_by("subscriber")
        ],
    }


def _iso(value):
    return value.isoformat() if value is not None else None
