"""Prometheus metrics at /metrics, from the deployment's shared snapshot (dashboard.shared),
then what the processes count themselves (mqsite.prometheus).

The snapshot's figures are the dashboard's, from the same reads (dashboard.snapshot): any
process (every Daphne of a scaled-out deployment) answers with the same numbers, and a scrape
costs the database nothing while the snapshot is at most MQ_METRICS_MAX_AGE_SECS old; an open
dashboard keeps it about a second old anyway. Rendering the exposition from it is a few loops
over queues, events and subscribers. The latency histograms (delivery.observe) and the
process_* figures are read at every scrape, from the processes' files, not the database.

What is a counter and what is a gauge:
- `mq_messages_published_total{queue}` is a true counter: the queue's last seq, which only
  grows (archiving does not lower it). `rate()` of it is the publish rate.
- Everything else is a gauge of what the hot tables hold now. Acked deliveries and webhook
  attempts leave those tables when archived, so their totals may fall: for the ack rate use
  `mq_ack_rate_per_second` (acks over the last minute, from Delivery.acked_at), not `rate()`.
- `mq_analytics_*` are the last loaded analytics run's (from the tables analytics.load fills,
  in the same snapshot): when it finished and how old its figures are, how long it took, its
  partitions recomputed and reused, and its figures per queue and event over the whole
  history; `mq_analytics_window_*` and `mq_analytics_subscriber_latency_seconds`, the last
  hour's and 24 hours' (and the whole history's) with a `window` label; and the runs on beat
  that failed since it, and when the last did (a failed run stores nothing: the figures stay
  that run's). None before a first run, loaded or failed.
"""

import time

from django.conf import settings
from django.http import HttpResponse
from django.utils.crypto import constant_time_compare
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mqsite import prometheus
from mqsite.errors import error_json
from subscribers.auth import operator_may

from . import shared


def families(taken_at, data):
    """The metric families of one snapshot (dashboard.snapshot.overview)."""
    part = data["metrics"]
    published = CounterMetricFamily(
        "mq_messages_published", "Messages ever published to the queue (its last seq).", labels=["queue"]
    )
    paused = GaugeMetricFamily("mq_queue_paused", "1 when the queue is paused.", labels=["queue"])
    for q in part["queues"]:
        published.add_metric([q["name"]], q["last_seq"])
        paused.add_metric([q["name"]], 1 if q["paused"] else 0)
    yield published
    yield paused

    by_status = GaugeMetricFamily(
        "mq_deliveries",
        "Deliveries in the hot tables by status (acked ones leave when archived).",
        labels=["queue", "event", "status"],
    )
    publish_rate = GaugeMetricFamily(
        "mq_publish_rate_per_second", "Messages published per second over the last minute.", labels=["queue"]
    )
    ack_rate = GaugeMetricFamily(
        "mq_ack_rate_per_second", "Deliveries acked per second over the last minute.", labels=["queue"]
    )
    for row in data["queues"]:
        if row["event"] is not None:
            for status in ("acked", "dead", "inflight", "pending"):
                if row[status]:
                    by_status.add_metric([row["queue"], row["event"], status], row[status])
    for q in part["queues"]:
        publish_rate.add_metric([q["name"]], q["publish_rate"])
        ack_rate.add_metric([q["name"]], q["ack_rate"])
    yield by_status

    pending = GaugeMetricFamily(
        "mq_pending_deliveries",
        "Deliveries waiting to be handed out (ready or waiting for their retry).",
        labels=["queue", "subscriber"],
    )
    oldest = GaugeMetricFamily(
        "mq_oldest_pending_age_seconds",
        "Age of the oldest pending delivery (since its message was published).",
        labels=["queue", "subscriber"],
    )
    for row in part["pending"]:
        pending.add_metric([row["queue"], row["subscriber"]], row["n"])
        if row["oldest_age_s"] is not None:
            oldest.add_metric([row["queue"], row["subscriber"]], row["oldest_age_s"])
    yield pending
    yield oldest
    yield publish_rate
    yield ack_rate

    attempts = GaugeMetricFamily(
        "mq_webhook_attempts",
        "Webhook posts recorded in the hot tables, by outcome: ok (2xx), http_error (another "
        "status), error (no answer: timeout, refused, unsafe URL).",
        labels=["subscriber", "outcome"],
    )
    for subscriber, *counts in part["webhook_attempts"]:
        for outcome, n in zip(("ok", "http_error", "error"), counts, strict=True):
            attempts.add_metric([subscriber, outcome], n)
    yield attempts

    taken = GaugeMetricFamily(
        "mq_metrics_snapshot_timestamp_seconds",
        "When these numbers were read from the database (Unix time); scrapes within "
        "MQ_METRICS_MAX_AGE_SECS of it are served this same snapshot.",
    )
    taken.add_metric([], taken_at)
    yield taken

    connected = GaugeMetricFamily(
        "mq_connected_clients", "Open websocket connections by subscriber.", labels=["subscriber"]
    )
    for subscriber, n in part["connections"]:
        connected.add_metric([subscriber], n)
    yield connected

    yield from webhook_families(part.get("webhooks", ()))  # .get: as analytics, below
    if part.get("processes"):
        yield from process_families(part["processes"])

    if part.get("analytics"):  # .get: a snapshot cached by a server before this one has none
        yield from analytics_families(taken_at, part["analytics"])


def webhook_families(webhooks):
    """Each webhook that ever failed: its failures in a row, and whether it is disabled."""
    in_a_row = GaugeMetricFamily(
        "mq_webhook_consecutive_failures",
        "Webhook attempts failed in a row since its last success (0 once one succeeds).",
        labels=["subscriber"],
    )
    disabled = GaugeMetricFamily(
        "mq_webhook_disabled",
        "1 while the subscriber's webhook is disabled for failing (MQ_WEBHOOK_DISABLE_AFTER_SECS).",
        labels=["subscriber"],
    )
    for subscriber, failures, is_disabled in webhooks:
        in_a_row.add_metric([subscriber], failures)
        disabled.add_metric([subscriber], 1 if is_disabled else 0)
    yield in_a_row
    yield disabled


def process_families(processes):
    """The processes that do the work, from their beats in the database (all machines'), as
    /healthz counts them, and how long ago the sweep ran."""
    alive = GaugeMetricFamily(
        "mq_processes_alive",
        "Processes whose beats are current, by kind: web (Daphne) and worker (Celery), every machine's.",
        labels=["kind"],
    )
    for kind in ("web", "worker"):
        alive.add_metric([kind], processes[kind]["alive"])
    yield alive
    age = processes["sweep"]["last_run_s"]
    if age is not None:  # never swept: no figure (an alert on its absence says so)
        swept = GaugeMetricFamily(
            "mq_sweep_last_run_age_seconds", "Seconds since the sweeper last ran (every second on beat)."
        )
        swept.add_metric([], age)
        yield swept


QUANTILES = ("0.5", "0.95", "0.99")


def analytics_families(taken_at, analytics):
    """The last analytics run's families (analytics.summaries.metrics), and its failed runs'."""
    yield from _failure_families(analytics.get("failures"))  # .get: as in families(), above
    run = analytics["run"]
    if run is None:  # runs failed, none loaded yet
        return
    finished = GaugeMetricFamily(
        "mq_analytics_last_run_timestamp_seconds", "When the last loaded analytics run finished (Unix time)."
    )
    finished.add_metric([], run["finished_at"].timestamp())
    # Its figures' age, beside the failures: a run that failed left them as they were.
    age = GaugeMetricFamily(
        "mq_analytics_last_run_age_seconds",
        "How long ago the last loaded analytics run finished: the age of the mq_analytics figures.",
    )
    age.add_metric([], max(taken_at - run["finished_at"].timestamp(), 0.0))
    duration = GaugeMetricFamily(
        "mq_analytics_last_run_duration_seconds", "How long the last loaded analytics run took."
    )
    duration.add_metric([], run["duration_s"])
    partitions = GaugeMetricFamily(
        "mq_analytics_last_run_partitions",
        "Partitions of the history the last analytics run computed again (recomputed) or took "
        "from the run before (reused).",
        labels=["state"],
    )
    partitions.add_metric(["recomputed"], run["partitions_recomputed"])
    partitions.add_metric(["reused"], run["partitions_reused"])
    yield finished
    yield age
    yield duration
    yield partitions

    messages = GaugeMetricFamily(
        "mq_analytics_messages",
        "Messages of the queue and event over the whole history (archive and hot tables), as of "
        "the last analytics run.",
        labels=["queue", "event"],
    )
    dead_rate = GaugeMetricFamily(
        "mq_analytics_dead_letter_rate",
        "Dead deliveries over deliveries of the queue and event, whole history, last analytics run.",
        labels=["queue", "event"],
    )
    latency = GaugeMetricFamily(
        "mq_analytics_latency_ms",
        "Publish-to-ack latency of the queue and event, whole history, last analytics run.",
        labels=["queue", "event", "quantile"],
    )
    for queue, event, n, rate, *quantiles in analytics["events"]:
        messages.add_metric([queue, event], n)
        if rate is not None:  # no deliveries: no rate
            dead_rate.add_metric([queue, event], rate)
        for quantile, ms in zip(QUANTILES, quantiles, strict=True):
            if ms is not None:  # nothing acked: no latency
                latency.add_metric([queue, event, quantile], ms)
    yield messages
    yield dead_rate
    yield latency
    if "windows" in analytics:  # a snapshot cached by a server before windows has none
        yield from window_families(analytics["windows"])


def window_families(windows):
    """The last hour's, the last 24 hours' and the whole history's figures of the last run
    (window="1h", "24h", "all"), per queue and event and per subscriber: what an incident moves,
    which the whole history's gauges above never show. Prometheus's base unit for latency."""
    since = GaugeMetricFamily(
        "mq_analytics_window_start_timestamp_seconds",
        "The first hour (Unix time) the window's figures cover, up to the last analytics run.",
        labels=["window"],
    )
    for window, start in sorted(windows["since"].items()):
        since.add_metric([window], start.timestamp())
    yield since
    families = {
        name: GaugeMetricFamily(name, help, labels=["window", "queue", "event"])
        for name, help in (
            ("mq_analytics_window_messages", "Messages published in the window, per queue and event."),
            ("mq_analytics_window_deliveries", "Deliveries of the messages published in the window."),
            ("mq_analytics_window_dead_letters", "Dead deliveries of the messages published in the window."),
        )
    }
    latency = GaugeMetricFamily(
        "mq_analytics_window_latency_seconds",
        "Publish-to-ack latency of the deliveries published in the window and acked, per queue and event.",
        labels=["window", "queue", "event", "quantile"],
    )
    for window, queue, event, messages, deliveries, dead, *quantiles in windows["events"]:
        for name, value in zip(families, (messages, deliveries, dead), strict=True):
            families[name].add_metric([window, queue, event], value)
        _add_quantiles(latency, [window, queue, event], quantiles)
    yield from families.values()
    yield latency
    by_subscriber = GaugeMetricFamily(
        "mq_analytics_subscriber_latency_seconds",
        "Publish-to-ack latency of the subscriber's deliveries published in the window and acked: "
        "which consumer is slow.",
        labels=["window", "subscriber", "quantile"],
    )
    for window, subscriber, *quantiles in windows["subscribers"]:
        _add_quantiles(by_subscriber, [window, subscriber], quantiles)
    yield by_subscriber


def _add_quantiles(family, labels, quantiles_ms):
    for quantile, ms in zip(QUANTILES, quantiles_ms, strict=True):
        if ms is not None:  # nothing acked: no latency
            family.add_metric([*labels, quantile], ms / 1000)


def _failure_families(failures):
    if failures is None:
        return
    since = GaugeMetricFamily(
        "mq_analytics_failed_runs",
        "Analytics runs on beat that failed since the last loaded run (0: its figures are the newest).",
    )
    since.add_metric([], failures["since_run"])
    yield since
    if failures["last_failed_at"] is not None:
        last = GaugeMetricFamily(
            "mq_analytics_last_failure_timestamp_seconds",
            "When an analytics run on beat last failed (Unix time).",
        )
        last.add_metric([], failures["last_failed_at"].timestamp())
        yield last


class _Snapshot:
    """A collector over one snapshot, for prometheus_client's text exposition."""

    def __init__(self, taken_at, data):
        self.taken_at, self.data = taken_at, data

    def collect(self):
        return families(self.taken_at, self.data)


def exposition(taken_at, data):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(taken_at, data))
    return generate_latest(registry)


def refusal(request):
    """None when the request may read the metrics, else the answer that says why not. The
    bearer token is looked at first: a scraper sends no session, so costs no query."""
    if settings.MQ_METRICS_PUBLIC:
        return None
    token = settings.MQ_METRICS_TOKEN
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and constant_time_compare(value.strip(), token):
        return None
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        if operator_may(user):
            return None
        detail = "The metrics are for staff users and the scraper with MQ_METRICS_TOKEN."
        return error_json(detail, "forbidden", 403)
    if token:
        detail = (
            "The metrics need the bearer token of MQ_METRICS_TOKEN (Authorization: Bearer <token>) "
            "or a staff login."
        )
    else:
        detail = "The metrics need a staff login, or MQ_METRICS_TOKEN set and sent as a bearer token."
    response = error_json(detail, "unauthenticated", 401)
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def metrics(request):
    refused = refusal(request)
    if refused is not None:
        return refused
    taken_at, data = shared.current(max_age=settings.MQ_METRICS_MAX_AGE_SECS)
    # The snapshot's families, then what the processes count (read at every scrape: the
    # histograms are counted in memory, unlike everything above).
    body = exposition(taken_at, data) + prometheus.exposition()
    response = HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
    response["Age"] = str(max(int(time.time() - taken_at), 0))
    return response
