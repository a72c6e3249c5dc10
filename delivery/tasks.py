"""Celery tasks: webhook posts and the sweeper.

Tasks take ids, re-read the database and are harmless when run twice: a webhook job leases
before it posts (SKIP LOCKED), so two jobs for one subscriber share the work instead of
doubling it; a job lost with a killed worker or a restarted Redis leaves its deliveries in
flight until their ack deadline, and the sweeper finds them again. Retries are scheduled by
`next_attempt_at` in the database, never by Celery countdowns.
"""

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from celery import shared_task
from celery.signals import worker_shutting_down
from django.core.cache import cache
from django.utils import timezone

from subscribers import presence
from subscribers.models import Subscriber

from . import ledger, webhooks
from .models import Delivery, DeliveryAttempt, Status

log = logging.getLogger(__name__)

WEBHOOK_BATCH = 20
# Posts in flight at once within a job (the subscriber's endpoint sees at most this many).
WEBHOOK_PARALLEL_POSTS = 8
# A job posts for at most this long, then leaves the rest to the next job: one slow
# subscriber must not hold a worker for ever.
WEBHOOK_JOB_BUDGET_SECS = 60
# The sweeper enqueues at most one job per subscriber per this many seconds.
ENQUEUE_DEBOUNCE_SECS = 5
FRAME_FIELDS = ("id", "message_id", "queue", "event", "seq", "payload", "attempt", "published_at")
# Set when the worker is told to stop (SIGTERM, a warm shutdown): a job finishes and acks the
# batch it is posting, then stops leasing, so the worker exits within its grace and holds
# nothing; the next job (after a restart) takes what is left.
stopping = threading.Event()


@worker_shutting_down.connect
def _stop_leasing(**kwargs):
    stopping.set()


def webhook_subscribers(subscriber_ids):
    """Of these subscribers, those whose deliveries go by webhook now: a URL, and no socket."""
    return list(
        Subscriber.objects.filter(pk__in=subscriber_ids, is_active=True, connections__isnull=True)
        .exclude(webhook_url="")
        .values_list("pk", flat=True)
    )


def enqueue_webhooks(subscriber_ids):
    for sid in webhook_subscribers(subscriber_ids):
        deliver_webhooks.delay(sid)


@shared_task(acks_late=True)
def deliver_webhooks(subscriber_id):
    """Post the subscriber's ready deliveries to its webhook until none is ready."""
    subscriber = Subscriber.objects.filter(pk=subscriber_id, is_active=True).exclude(webhook_url="").first()
    if subscriber is None or subscriber.connections.exists():
        return 0
    holder = f"webhook:{uuid.uuid4().hex[:12]}"
    posted = 0
    deadline = time.monotonic() + WEBHOOK_JOB_BUDGET_SECS
    with (
        httpx.Client(timeout=webhooks.TIMEOUT_SECS, follow_redirects=False, trust_env=False) as client,
        ThreadPoolExecutor(max_workers=WEBHOOK_PARALLEL_POSTS) as pool,
    ):
        while time.monotonic() < deadline and not stopping.is_set():
            leased = ledger.lease_deliveries(subscriber, limit=WEBHOOK_BATCH, holder=holder)
            if not leased:
                break
            # The first goes alone, as a probe: an endpoint that is down gets one request a
            # batch, and the rest go back untried (their attempts not spent).
            probe = post_one(subscriber, leased[0], client)
            if not probe.ok:
                record_attempts(leased[:1], [probe])
                ledger.fail_delivery(leased[0]["id"], holder, probe.error)
                ledger.release_held([holder])
                log.info("webhook of %s failed (%s); the rest waits", subscriber, probe.error)
                break
            # The rest at once; safe for ordered queues too, since the ledger leases at most one
            # delivery of an ordered subscription at a time.
            outcomes = [probe, *pool.map(lambda d: post_one(subscriber, d, client), leased[1:])]
            record_attempts(leased, outcomes)
            ok = [d["id"] for d, o in zip(leased, outcomes, strict=True) if o.ok]
            if ok:
                ledger.ack_deliveries(subscriber, ok)  # one commit for the batch's successes
                posted += len(ok)
            failed = [(d, o) for d, o in zip(leased, outcomes, strict=True) if not o.ok]
            for d, o in failed:
                ledger.fail_delivery(d["id"], holder, o.error)
            if failed:
                # The endpoint is failing: leave the rest to their own schedule (the sweeper).
                log.info("webhook of %s failed %d times (%s)", subscriber, len(failed), failed[0][1].error)
                break
    return posted


def post_one(subscriber, delivery, client):
    frame = {"type": "message", **{k: delivery[k] for k in FRAME_FIELDS}}
    return webhooks.post(subscriber.webhook_url, subscriber.webhook_secret, frame, client)


def record_attempts(deliveries, outcomes):
    now = timezone.now()
    DeliveryAttempt.objects.bulk_create(
        DeliveryAttempt(
            delivery_id=d["id"],
            number=d["attempt"],
            at=now,
            ok=o.ok,
            status_code=o.status,
            error=o.error,
            duration_ms=o.duration_ms,
        )
        for d, o in zip(deliveries, outcomes, strict=True)
    )


@shared_task
def sweep():
    """On beat, every second: expire overdue leases (back to pending with backoff, or dead
    after the last attempt), remove connections whose server died, and enqueue webhook jobs
    for subscribers that have due work."""
    expired = ledger.expire_overdue_leases()
    stale = presence.sweep_stale_connections()
    now = timezone.now()
    due = set(
        Delivery.objects.filter(status=Status.PENDING, next_attempt_at__lte=now, queue__paused=False)
        .exclude(subscriber__webhook_url="")
        .order_by()
        .values_list("subscriber_id", flat=True)
        .distinct()
    )
    enqueued = 0
    for sid in webhook_subscribers(due):
        # cache.add is atomic: only one sweep in ENQUEUE_DEBOUNCE_SECS enqueues for a subscriber.
        if cache.add(f"webhook-enqueued:{sid}", 1, timeout=ENQUEUE_DEBOUNCE_SECS):
            deliver_webhooks.delay(sid)
            enqueued += 1
    return {"expired": expired, "stale_connections": stale, "webhook_jobs": enqueued}
