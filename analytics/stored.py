"""The stored figures (what analytics.load put in the tables) as JSON: `analyze --json`,
GET /api/analytics, the run and the recent windows.

No pyarrow here, unlike analytics.load: the web processes answer from these, and should not
import a columnar engine (a third of a second and tens of MB a process) to read a few rows.
"""

from . import windows
from .models import AnalyticsRun, EventStats, EventWindowStats, SubscriberStats, SubscriberWindowStats

EVENT_FIELDS = [f.name for f in EventStats._meta.concrete_fields if f.name not in ("id", "computed_at")]
SUBSCRIBER_FIELDS = [
    f.name for f in SubscriberStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]


def run_json(run):
    """An AnalyticsRun as its manifest's fields (and when it was loaded)."""
    if run is None:
        return None
    return {
        "run_id": run.run_id,
        "started_at": _iso(run.started_at),
        "finished_at": _iso(run.finished_at),
        "duration_s": run.duration_s,
        "now": _iso(run.now),
        "window": {"since": _iso(run.window_since), "until": _iso(run.window_until)},
        "spark": run.spark,
        "partitions": {
            "total": run.partitions_total,
            "recomputed": run.partitions_recomputed,
            "reused": run.partitions_reused,
        },
        "rows": {
            "archive_messages": run.rows_archive_messages,
            "archive_deliveries": run.rows_archive_deliveries,
            "hot_messages": run.rows_hot_messages,
            "hot_deliveries": run.rows_hot_deliveries,
        },
        "loaded_at": _iso(run.loaded_at),
    }


def last_run():
    """The newest loaded run, or None."""
    return AnalyticsRun.objects.order_by("-loaded_at", "-id").first()


# Beyond the fields the API lists (docs/analytics.md, "What `analyze --json` prints"; they keep
# their names and meaning), `--json` adds the job's other figures: a reader of the contract's
# fields sees no change.
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
SUBSCRIBER_EXTRAS = ("deliveries", "inflight", "backlog", "lag_s", "latency_ms")


def results_json():
    """The stored statistics as `analyze --json` prints them (as_json)."""
    return as_json(
        [{f: getattr(s, f) for f in EVENT_FIELDS} for s in EventStats.objects.order_by("queue", "event")],
        [
            {f: getattr(s, f) for f in SUBSCRIBER_FIELDS}
            for s in SubscriberStats.objects.order_by("subscriber")
        ],
    )


def as_json(events, subscribers):
    """Event and subscriber statistics (dicts of EventStats' and SubscriberStats' fields) as
    `analyze --json` prints them: the fields the API lists, and the extras above (and
    the span of each event's messages, as ISO times)."""
    return {
        "events": [
            {
                "queue": s["queue"],
                "event": s["event"],
                "messages": s["messages"],
                "deliveries": s["deliveries"],
                "acked": s["acked"],
                "dead": s["dead"],
                "latency_ms": {
                    "p50": s["latency_p50_ms"],
                    "p95": s["latency_p95_ms"],
                    "p99": s["latency_p99_ms"],
                },
                "attempts_mean": s["attempts_mean"],
                **{f: s[f] for f in EVENT_EXTRAS},
                "first_published_at": _iso(s["first_published_at"]),
                "last_published_at": _iso(s["last_published_at"]),
            }
            for s in sorted(events, key=lambda s: (s["queue"], s["event"]))
        ],
        "subscribers": [
            {
                "subscriber": s["subscriber"],
                "pending": s["pending"],
                "oldest_pending_age_s": s["oldest_pending_age_s"],
                "acked": s["acked"],
                "dead": s["dead"],
                "deliveries": s["deliveries"],
                "inflight": s["inflight"],
                # What it is still owed (pending and in flight), and how far behind it is: the
                # age of its oldest pending delivery at the run (oldest_pending_age_s again,
                # under the name the issue asks for).
                "backlog": s["pending"] + s["inflight"],
                "lag_s": s["oldest_pending_age_s"],
                # Publish to ack of its acked deliveries (which consumer is slow); None before
                # a run that computed it, or with nothing acked.
                "latency_ms": {q: s.get(f"latency_{q}_ms") for q in ("p50", "p95", "p99")},
            }
            for s in sorted(subscribers, key=lambda s: s["subscriber"])
        ],
    }


def windows_json():
    """The stored figures of the last hour and the last 24 hours before the last loaded run
    (analytics.windows): {window: {"since", "until", "events": [...], "subscribers": [...]}},
    each entry with the fields of `analyze --json`'s it has (a window with no traffic has empty
    lists); {} before the first run. Two queries, rows per queue, event and subscriber."""
    run = last_run()
    if run is None:
        return {}
    out = {
        name: {
            "since": _iso(windows.start_of(run.now, span)),
            "until": _iso(run.now),
            "events": [],
            "subscribers": [],
        }
        for name, span in windows.WINDOWS.items()
    }
    for s in EventWindowStats.objects.order_by("window", "queue", "event"):
        out[s.window]["events"].append(
            {
                "queue": s.queue,
                "event": s.event,
                "messages": s.messages,
                "deliveries": s.deliveries,
                "acked": s.acked,
                "dead": s.dead,
                "dead_letter_rate": s.dead_letter_rate,
                "latency_ms": _latency(s),
            }
        )
    for s in SubscriberWindowStats.objects.order_by("window", "subscriber"):
        out[s.window]["subscribers"].append(
            {
                "subscriber": s.subscriber,
                "deliveries": s.deliveries,
                "acked": s.acked,
                "dead": s.dead,
                "latency_ms": _latency(s),
            }
        )
    return out


def _latency(row):
    return {"p50": row.latency_p50_ms, "p95": row.latency_p95_ms, "p99": row.latency_p99_ms}


def _iso(value):
    return value.isoformat() if value is not None else None
