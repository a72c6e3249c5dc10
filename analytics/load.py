"""Load: the job's Parquet results into the Django tables the admin shows, and the JSON of
`analyze --json` from them.

Reads the results with pyarrow (they are small), so it works the same whether the job ran in
this process or was spark-submitted to a cluster that wrote them to shared storage.
"""

import math
from datetime import date, datetime

from django.db import connection, transaction
from django.utils import timezone
from pyarrow import fs as pafs

from . import layout, runs, windows
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

EVENT_FIELDS = [f.name for f in EventStats._meta.concrete_fields if f.name not in ("id", "computed_at")]
SUBSCRIBER_FIELDS = [
    f.name for f in SubscriberStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]
EVENT_TREND_FIELDS = [f.name for f in EventTrend._meta.concrete_fields if f.name != "id"]
SUBSCRIBER_TREND_FIELDS = [f.name for f in SubscriberTrend._meta.concrete_fields if f.name != "id"]
EVENT_WINDOW_FIELDS = [
    f.name for f in EventWindowStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]
SUBSCRIBER_WINDOW_FIELDS = [
    f.name for f in SubscriberWindowStats._meta.concrete_fields if f.name not in ("id", "computed_at")
]
RESULTS = ("event_stats", "subscriber_stats", "event_trends", "subscriber_trends")
# Results a run of an older release did not write: loaded as none.
LATER_RESULTS = ("event_windows", "subscriber_windows")


def read_result(out, name):
    """One result of the job as a list of dicts."""
    fs, base = layout.filesystem(out)
    return layout.read_file(fs, f"{base}/{name}").to_pylist()


def load_run(out, run_id):
    """Replace the stored statistics with those of the run folder `run_id` under `out`
    (analytics.runs), and record the run (AnalyticsRun); returns how many rows of each.

    The files are read before the transaction (slow I/O holds no lock); the replacement is
    one transaction, so a reader sees the previous run's figures or this one's, never a mix.
    Loading the same run again gives the same rows."""
    manifest = run_fields(runs.read_manifest(out, run_id))
    folder = runs.run_path(out, run_id)
    rows = {name: read_result(folder, f"{name}.parquet") for name in RESULTS}
    rows |= {name: _read_if_there(folder, f"{name}.parquet") for name in LATER_RESULTS}
    computed_at = manifest["now"]
    events = [_clean(r, EVENT_FIELDS) for r in rows["event_stats"]]
    subscribers = [_clean(r, SUBSCRIBER_FIELDS) for r in rows["subscriber_stats"]]
    event_trends = [_clean(r, EVENT_TREND_FIELDS) for r in rows["event_trends"]]
    subscriber_trends = [_clean(r, SUBSCRIBER_TREND_FIELDS) for r in rows["subscriber_trends"]]
    event_windows = [_clean(r, EVENT_WINDOW_FIELDS) for r in rows["event_windows"]]
    subscriber_windows = [_clean(r, SUBSCRIBER_WINDOW_FIELDS) for r in rows["subscriber_windows"]]
    for trend in event_trends + subscriber_trends:
        if trend["period"] not in Period.values:
            raise runs.BadRun(f"run {run_id}: a trend's period is {trend['period']!r}, not hour or day")
    for window in event_windows + subscriber_windows:
        if window["window"] not in Window.values:
            raise runs.BadRun(f"run {run_id}: a window is {window['window']!r}, not 1h or 24h")
    with transaction.atomic():
        _replace_stats(events, subscribers, computed_at)
        EventWindowStats.objects.all().delete()
        SubscriberWindowStats.objects.all().delete()
        EventWindowStats.objects.bulk_create(
            [EventWindowStats(**r, computed_at=computed_at) for r in event_windows], batch_size=500
        )
        SubscriberWindowStats.objects.bulk_create(
            [SubscriberWindowStats(**r, computed_at=computed_at) for r in subscriber_windows], batch_size=500
        )
        EventTrend.objects.all().delete()
        SubscriberTrend.objects.all().delete()
        _insert(EventTrend, EVENT_TREND_FIELDS, event_trends)
        _insert(SubscriberTrend, SUBSCRIBER_TREND_FIELDS, subscriber_trends)
        AnalyticsRun.objects.update_or_create(
            run_id=manifest["run_id"], defaults={**manifest, "loaded_at": timezone.now()}
        )
    return {
        "events": len(events),
        "subscribers": len(subscribers),
        "event_trends": len(event_trends),
        "subscriber_trends": len(subscriber_trends),
        "event_windows": len(event_windows),
        "subscriber_windows": len(subscriber_windows),
    }


def _read_if_there(folder, name):
    fs, base = layout.filesystem(folder)
    if fs.get_file_info(f"{base}/{name}").type == pafs.FileType.NotFound:
        return []
    return read_result(folder, name)


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


def _insert(model, fields, rows):
    """Insert these rows (dicts of `fields`) into the model's table. On PostgreSQL by COPY: the
    trends are an hour's row per queue and event and per subscriber, tens of thousands over a
    few weeks, which bulk_create's SQL took 2 s to build (a rerun's largest cost); COPY takes
    a tenth of that."""
    if connection.vendor != "postgresql":
        model.objects.bulk_create([model(**r) for r in rows], batch_size=1000)
        return
    quote = connection.ops.quote_name
    columns = ", ".join(quote(model._meta.get_field(f).column) for f in fields)
    with connection.cursor() as cursor:
        with cursor.cursor.copy(f"COPY {quote(model._meta.db_table)} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([row[f] for f in fields])


def _clean(row, fields):
    # NaN (0/0 in Spark) is not a number a database or JSON should hold: store null.
    return {f: None if isinstance(row.get(f), float) and math.isnan(row[f]) else row.get(f) for f in fields}


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
