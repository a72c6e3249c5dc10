"""Prometheus metrics at /metrics, from a snapshot of the database at most a few seconds old.

A custom Collector runs a few aggregate queries, so any process (every Daphne of a scaled-out
deployment) answers with the same numbers: nothing is counted in memory. Those queries group
the whole delivery table, so a scrape is served from a snapshot kept in Django's cache (Redis in
the services mode, shared by every process) and recomputed by one process at a time once it is
older than MQ_METRICS_MAX_AGE_SECS: however often it is scraped, the database does that work at
most once per that many seconds.

What is a counter and what is a gauge:
- `mq_messages_published_total{queue}` is a true counter: the queue's last seq, which only
  grows (archiving does not lower it). `rate()` of it is the publish rate.
- Everything else is a gauge of what the hot tables hold now. Acked deliveries and webhook
  attempts leave those tables when archived, so their totals may fall: for the ack rate use
  `mq_ack_rate_per_second` (acks over the last minute, from Delivery.acked_at), not `rate()`.
"""

import logging
import os
import time
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Min, Q
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from queues.models import Message, Queue
from subscribers.models import Connection

from .models import Delivery, DeliveryAttempt, Status

logger = logging.getLogger(__name__)

RATE_WINDOW_SECS = 60
SNAPSHOT_KEY = "mq:metrics:snapshot"
LOCK_KEY = "mq:metrics:computing"
LOCK_SECS = 60  # a process that died computing holds the others back at most this long
KEEP_SECS = 3600  # an older snapshot stays, to be served while the next one is computed
WAIT_SECS = 5.0  # with no snapshot at all, how long a scrape waits for another's computation


class QueueCollector(Collector):
    def collect(self):
        now = timezone.now()
        queues = list(Queue.objects.order_by("name").values_list("id", "name", "last_seq", "paused"))
        names = {qid: name for qid, name, _, _ in queues}

        published = CounterMetricFamily(
            "mq_messages_published", "Messages ever published to the queue (its last seq).", labels=["queue"]
        )
        paused = GaugeMetricFamily("mq_queue_paused", "1 when the queue is paused.", labels=["queue"])
        for _, name, last_seq, is_paused in queues:
            published.add_metric([name], last_seq)
            paused.add_metric([name], 1 if is_paused else 0)
        yield published
        yield paused

        by_status = GaugeMetricFamily(
            "mq_deliveries",
            "Deliveries in the hot tables by status (acked ones leave when archived).",
            labels=["queue", "event", "status"],
        )
        rows = (
            Delivery.objects.order_by()
            .values_list("queue__name", "event__name", "status")
            .annotate(n=Count("id"))
            .order_by("queue__name", "event__name", "status")
        )
        for queue, event, status, n in rows:
            by_status.add_metric([queue, event, status], n)
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
        rows = (
            Delivery.objects.filter(status=Status.PENDING)
            .order_by()
            .values_list("queue__name", "subscriber__name")
            .annotate(n=Count("id"), oldest=Min("created_at"))
            .order_by("queue__name", "subscriber__name")
        )
        for queue, subscriber, n, oldest_at in rows:
            pending.add_metric([queue, subscriber], n)
            oldest.add_metric([queue, subscriber], max((now - oldest_at).total_seconds(), 0.0))
        yield pending
        yield oldest

        since = now - timedelta(seconds=RATE_WINDOW_SECS)
        publish_rate = GaugeMetricFamily(
            "mq_publish_rate_per_second",
            "Messages published per second over the last minute.",
            labels=["queue"],
        )
        recent = dict(
            Message.objects.filter(created_at__gte=since)
            .order_by()
            .values_list("queue_id")
            .annotate(n=Count("id"))
        )
        for qid, name in names.items():
            publish_rate.add_metric([name], recent.get(qid, 0) / RATE_WINDOW_SECS)
        yield publish_rate

        ack_rate = GaugeMetricFamily(
            "mq_ack_rate_per_second", "Deliveries acked per second over the last minute.", labels=["queue"]
        )
        recent = dict(
            Delivery.objects.filter(acked_at__gte=since)
            .order_by()
            .values_list("queue_id")
            .annotate(n=Count("id"))
        )
        for qid, name in names.items():
            ack_rate.add_metric([name], recent.get(qid, 0) / RATE_WINDOW_SECS)
        yield ack_rate

        attempts = GaugeMetricFamily(
            "mq_webhook_attempts",
            "Webhook posts recorded in the hot tables, by outcome: ok (2xx), http_error (another "
            "status), error (no answer: timeout, refused, unsafe URL).",
            labels=["subscriber", "outcome"],
        )
        rows = (
            DeliveryAttempt.objects.order_by()
            .values("delivery__subscriber__name")
            .annotate(
                n_ok=Count("id", filter=Q(ok=True)),
                n_http_error=Count("id", filter=Q(ok=False, status_code__isnull=False)),
                n_error=Count("id", filter=Q(ok=False, status_code__isnull=True)),
            )
            .order_by("delivery__subscriber__name")
        )
        for row in rows:
            for outcome in ("ok", "http_error", "error"):
                attempts.add_metric([row["delivery__subscriber__name"], outcome], row[f"n_{outcome}"])
        yield attempts

        taken = GaugeMetricFamily(
            "mq_metrics_snapshot_timestamp_seconds",
            "When these numbers were read from the database (Unix time); scrapes within "
            "MQ_METRICS_MAX_AGE_SECS of it are served this same snapshot.",
        )
        taken.add_metric([], now.timestamp())
        yield taken

        connected = GaugeMetricFamily(
            "mq_connected_clients", "Open websocket connections by subscriber.", labels=["subscriber"]
        )
        for subscriber, n in (
            Connection.objects.order_by()
            .values_list("subscriber__name")
            .annotate(n=Count("id"))
            .order_by("subscriber__name")
        ):
            connected.add_metric([subscriber], n)
        yield connected


registry = CollectorRegistry(auto_describe=False)
registry.register(QueueCollector())


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
        if user.is_active and user.is_staff:
            return None
        return JsonResponse(
            {"detail": "The metrics are for staff users and the scraper with MQ_METRICS_TOKEN."}, status=403
        )
    if token:
        detail = (
            "The metrics need the bearer token of MQ_METRICS_TOKEN (Authorization: Bearer <token>) "
            "or a staff login."
        )
    else:
        detail = "The metrics need a staff login, or MQ_METRICS_TOKEN set and sent as a bearer token."
    response = JsonResponse({"detail": detail}, status=401)
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def compute():
    return time.time(), generate_latest(registry)


def _cached(method, *args):
    """A cache call; None when the cache (Redis) is down: then every scrape computes its own,
    as before there was a snapshot, rather than fail."""
    try:
        return method(*args)
    except Exception:
        logger.warning("metrics: the cache did not answer; computing this scrape directly", exc_info=True)
        return None


def snapshot():
    """(when it was computed, the exposition): the cached one while it is at most
    MQ_METRICS_MAX_AGE_SECS old, else a new one, computed by one process at a time (a
    cache.add lock). Meanwhile the others serve the older one, or, when there is none yet, wait
    for it; never an error."""
    max_age = settings.MQ_METRICS_MAX_AGE_SECS
    if max_age <= 0:
        return compute()
    held = _cached(cache.get, SNAPSHOT_KEY)
    if held is not None and time.time() - held[0] <= max_age:
        return held
    if _cached(cache.add, LOCK_KEY, os.getpid(), LOCK_SECS) is not False:
        try:
            fresh = compute()
            _cached(cache.set, SNAPSHOT_KEY, fresh, KEEP_SECS)
            return fresh
        finally:
            _cached(cache.delete, LOCK_KEY)
    if held is not None:
        return held
    deadline = time.monotonic() + WAIT_SECS
    while time.monotonic() < deadline:
        time.sleep(0.05)
        held = _cached(cache.get, SNAPSHOT_KEY)
        if held is not None:
            return held
    return compute()


def metrics(request):
    refused = refusal(request)
    if refused is not None:
        return refused
    taken_at, body = snapshot()
    response = HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
    response["Age"] = str(max(int(time.time() - taken_at), 0))
    return response
