"""Prometheus metrics at /metrics, read from the database at each scrape.

A custom Collector runs a few aggregate queries per scrape, so any process (every Daphne of
a scaled-out deployment) answers with the same numbers: nothing is counted in memory.

What is a counter and what is a gauge:
- `mq_messages_published_total{queue}` is a true counter: the queue's last seq, which only
  grows (archiving does not lower it). `rate()` of it is the publish rate.
- Everything else is a gauge of what the hot tables hold now. Acked deliveries and webhook
  attempts leave those tables when archived, so their totals may fall: for the ack rate use
  `mq_ack_rate_per_second` (acks over the last minute, from Delivery.acked_at), not `rate()`.
"""

from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Min, Q
from django.http import HttpResponse
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from queues.models import Message, Queue
from subscribers.models import Connection

from .models import Delivery, DeliveryAttempt, Status

RATE_WINDOW_SECS = 60


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


def may_scrape(request):
    """Public unless MQ_METRICS_TOKEN is set; then the scraper sends it as a bearer token (a
    logged-in operator may look too)."""
    token = settings.MQ_METRICS_TOKEN
    if not token:
        return True
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_active and user.is_staff:
        return True
    given = request.headers.get("Authorization", "")
    scheme, _, value = given.partition(" ")
    return scheme.lower() == "bearer" and constant_time_compare(value.strip(), token)


def metrics(request):
    if not may_scrape(request):
        response = HttpResponse("metrics need the bearer token of MQ_METRICS_TOKEN\n", status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
