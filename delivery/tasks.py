"""Celery tasks: webhook posts and the sweeper.

Tasks take ids, re-read the database and are harmless when run twice: a webhook job leases
before it posts (SKIP LOCKED), so two jobs for one subscriber share the work instead of
doubling it; a job lost with a killed worker or a restarted Redis leaves its deliveries in
flight until their ack deadline, and the sweeper finds them again. Retries are scheduled by
`next_attempt_at` in the database, never by Celery countdowns: the sweeper (every second)
enqueues a job for work due before its next run, and a job waits, reading the ledger, for work
due that soon, so a retry goes out when the ledger says and not up to a sweep later.

One job per subscriber at a time: a claim in the cache, taken when a job is enqueued (wake-up
or sweeper) and held while it runs, keeps wake-ups from piling jobs up in the broker. The claim
is only a limit: a job run twice still shares the work. A running job's claim lives a second
and a thread of the worker renews it four times a second, so it is held for as long as the job
runs and lapses within a second of a killed worker's death; the worker's leases are handed back
about then (delivery.liveness), dropping its claims, and their wake-up enqueues the next job.

Queues (CELERY_TASK_ROUTES): the posts go on `webhooks`, the sweeper and the archive on
`maintenance`, each served by a worker of its own (mqsite/supervisord.conf), so that no post can
hold the sweeper up. A job per subscriber, each post ending by the webhook deadline and each job
by its budget: one slow endpoint holds one worker thread, never another subscriber's posts.
"""

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down
from django.core.cache import cache
from django.db import connection
from django.utils import timezone

from delivery import presence, spans
from mqsite import adb, log_context
from queues import lookup
from subscribers.models import Connection, Subscriber, keep_webhookless, maybe_webhook

from . import frames, health, ledger, liveness, operational, receipts, tallies, webhook_health, webhooks
from .models import Delivery, WebhookHealth

log = logging.getLogger(__name__)

WEBHOOK_BATCH = 20
# After a batch of an ordered line's heads, the next heads are leased at once (one statement
# each, _heads_next) for at most this many rounds in a row; then a whole lease, which also
# serves the subscriber's other subscriptions.
WEBHOOK_HEAD_ROUNDS = 10
# Posts in flight at once within a job (the subscriber's endpoint sees at most this many).
WEBHOOK_PARALLEL_POSTS = 8
# A job posts for at most this long, then leaves the rest to the next job: one slow
# subscriber must not hold a worker for ever.
WEBHOOK_JOB_BUDGET_SECS = 60
# How far ahead the sweeper looks for due work, and how long a job waits for it: a little
# more than the sweeper's period (CELERY_BEAT_SCHEDULE, 1 s; measured 1.00-1.05 s apart), so
# that a retry due between two sweeps is waited for by a job, not left to the next sweep.
RETRY_LOOKAHEAD_SECS = 1.5
# A claim of a job still in the broker lasts this long: a free worker takes a job in
# milliseconds; when every worker is busy, the sweeper may add one more per this many seconds
# (the two share the work). In the embedded mode the cache is per process, so a claim taken by
# the web server is never released by the worker's job and only rate-limits its wake-ups.
CLAIM_QUEUED_SECS = 2
# A running job's claim lives this long (whole seconds: the Redis cache counts no less) and is
# renewed every CLAIM_RENEW_SECS while the job runs (ClaimRenewer): a killed worker's claim
# lapses within this, and a sweep (every second) enqueues the next job. Its claims go sooner
# when its leases are handed back (drop_claims_of), whose wake-up enqueues the next job.
CLAIM_RUNNING_SECS = 1
CLAIM_RENEW_SECS = 0.25
# Why a delivery of a job's batch went back untried (operators read it as its last error).
NOT_POSTED = "not posted: the webhook failed on an earlier delivery of the batch"
# Set when the worker is told to stop (SIGTERM, a warm shutdown): a job finishes and acks the
# batch it is posting, then stops leasing, so the worker exits within its grace and holds
# nothing; the next job (after a restart) takes what is left.
stopping = threading.Event()


@worker_shutting_down.connect
def _stop_leasing(**kwargs):
    stopping.set()


@worker_ready.connect
def _beat(**kwargs):
    liveness.start("worker")


@worker_shutdown.connect
def _stop_beating(**kwargs):
    liveness.stop()


def webhook_subscribers(subscriber_ids, kept=False):
    """Of these subscribers, those whose deliveries go by webhook now: a URL not disabled
    (delivery.webhook_health), and no socket.

    Asked after every publish: plain SQL, since building the ORM's query cost more than
    running it. `kept` (a web process's wake-ups, which hear every announcement): the
    subscribers found without a webhook are kept, and not asked about again until a change
    is announced (subscribers.models.maybe_webhook); a commit to subscribers that all have
    none (most: they pull or hold a socket) costs no query. The sweeper asks every time."""
    ids = list(subscriber_ids)
    if kept:
        ids, forgotten = maybe_webhook(ids)
    if not ids:
        return []
    of_ids, params = adb.one_of("s.id", ids)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT s.id, s.is_active AND s.webhook_url <> '',
              EXISTS (SELECT 1 FROM {Connection._meta.db_table} c WHERE c.subscriber_id = s.id),
              EXISTS (SELECT 1 FROM {WebhookHealth._meta.db_table} h
                      WHERE h.subscriber_id = s.id AND h.disabled_since IS NOT NULL)
            FROM {Subscriber._meta.db_table} s WHERE {of_ids}
            """,
            params,
        )
        found = cursor.fetchall()
    if kept:
        # A disabled webhook is not kept as none: enabling it is no announced change.
        keep_webhookless([sid for sid, hooked, _, _ in found if not hooked], forgotten)
    return [sid for sid, hooked, socket, disabled in found if hooked and not socket and not disabled]


def claim_key(subscriber_id):
    return f"webhook-job:{subscriber_id}"


def enqueue_webhooks(subscriber_ids, kept=False):
    """Enqueue a webhook job for each of these subscribers that has none queued or running
    (`kept`: see webhook_subscribers)."""
    enqueued = 0
    for sid in webhook_subscribers(subscriber_ids, kept):
        # cache.add is atomic: of the wake-ups and sweeps that race here, one enqueues.
        if cache.add(claim_key(sid), "queued", timeout=CLAIM_QUEUED_SECS):
            deliver_webhooks.delay(sid)
            enqueued += 1
    return enqueued


class ClaimRenewer:
    """One thread per worker process renews the claims of the jobs running in it, every
    CLAIM_RENEW_SECS: a claim lives as long as its job, and a few seconds past a killed one."""

    def __init__(self):
        self.held = {}  # cache key -> our value
        self.lock = threading.Lock()
        self.thread = None

    def hold(self, key, value):
        _cache_call(cache.set, key, value, timeout=CLAIM_RUNNING_SECS)
        with self.lock:
            self.held[key] = value
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="webhook-claims", daemon=True)
                self.thread.start()

    # The lock also spans the cache calls, so that a renewal never brings back a claim that
    # its job has just released.
    def release(self, key, value):
        with self.lock:
            if self.held.get(key) == value:
                del self.held[key]
            # Only our own claim: a job that outlived its claim must not drop its successor's.
            if _cache_call(cache.get, key) == value:
                _cache_call(cache.delete, key)

    def renew_all(self):
        with self.lock:
            for key, value in self.held.items():
                # Extend ours (touch keeps the value: never another job's taken over), or take
                # it again if it lapsed meanwhile (add: only if nobody else has).
                if _cache_call(cache.get, key) == value:
                    _cache_call(cache.touch, key, CLAIM_RUNNING_SECS)
                else:
                    _cache_call(cache.add, key, value, timeout=CLAIM_RUNNING_SECS)

    def _run(self):
        while True:
            time.sleep(CLAIM_RENEW_SECS)
            self.renew_all()


claims = ClaimRenewer()


@shared_task(acks_late=True)
def deliver_webhooks(subscriber_id):
    """Post the subscriber's ready deliveries to its webhook until none is ready or due within
    RETRY_LOOKAHEAD_SECS; stop at the first failure (the rest waits for the sweeper)."""
    log_context.bind(subscriber=subscriber_id)
    holder = liveness.holder(f"webhook.{uuid.uuid4().hex[:12]}")
    key = claim_key(subscriber_id)
    if str(_cache_call(cache.get, key) or "").startswith("running:"):
        return 0  # another job serves this subscriber (it leases until nothing is ready)
    claims.hold(key, f"running:{holder}")
    try:
        return _post_ready(subscriber_id, holder)
    finally:
        claims.release(key, f"running:{holder}")


def drop_claims_of(holder_prefix, subscriber_ids):
    """The claims of these subscribers' running jobs whose holder starts with `holder_prefix`
    (a dead process's, delivery.liveness): gone, so that the wake-up of its handed back
    deliveries enqueues the next job at once, rather than a sweep after the claim lapsed."""
    for subscriber_id in subscriber_ids:
        key = claim_key(subscriber_id)
        if str(_cache_call(cache.get, key) or "").startswith(f"running:{holder_prefix}"):
            _cache_call(cache.delete, key)


def _cache_call(method, *args, **kwargs):
    """A claim is a limit, not a lock: with the cache down (Redis restarting) the job goes on."""
    try:
        return method(*args, **kwargs)
    except Exception:
        log.warning("webhook job claim: the cache failed", exc_info=True)
        return None


def _post_ready(subscriber_id, holder):
    subscriber = (
        Subscriber.objects.filter(pk=subscriber_id, is_active=True)
        .exclude(webhook_url="")
        .select_related("webhook_health")
        .first()
    )
    if subscriber is None or subscriber.connections.exists():
        return 0
    health = getattr(subscriber, "webhook_health", None)
    if health is not None and health.disabled:
        return 0  # its deliveries stay pending, no attempt spent, until it is enabled again
    # Failures counted since its last success: a success resets them (one statement then).
    failing = health is not None and health.failures > 0
    posted = 0
    deadline = time.monotonic() + WEBHOOK_JOB_BUDGET_SECS
    # The next batch, when the last round leased it already (an ordered line's next heads), and
    # how many rounds in a row were leased that way.
    leased, head_rounds = [], 0
    with webhooks.make_client() as client, ThreadPoolExecutor(max_workers=WEBHOOK_PARALLEL_POSTS) as pool:
        while True:
            if not leased:
                if time.monotonic() >= deadline or stopping.is_set():
                    break
                leased = ledger.lease_deliveries(subscriber, limit=WEBHOOK_BATCH, holder=holder)
                head_rounds = 0
            if not leased:
                due_at = next_due_at(subscriber_id)
                if due_at is None:
                    break
                # A retry due in a moment: wait for it here (the ledger's time, re-read when
                # leasing), rather than end and leave it to a sweep up to a second later.
                stopping.wait(max((due_at - timezone.now()).total_seconds(), 0))
                continue
            batch, leased = leased, []
            # The first goes alone, as a probe: an endpoint that is down gets one request a
            # batch, and the rest go back untried (their attempts not spent).
            probe = post_one(subscriber, batch[0], client)
            if not probe.ok:
                ledger.settle_posts(subscriber, [_posted(batch[0], probe)])
                disabled = webhook_health.record_failures(subscriber, 1, probe.error)
                failing = True
                ledger.fail_delivery(batch[0]["id"], holder, probe.error)
                # Ready at once but no wake-up, and not posted now: one request a batch to an
                # endpoint that is failing.
                ledger.release_held([holder], reason=NOT_POSTED, wake=False)
                log.info(
                    "webhook of %s failed (%s); the rest waits",
                    subscriber,
                    webhooks.loggable(probe.error),
                    extra={"delivery_id": batch[0]["id"], "message_id": batch[0]["message_id"]},
                )
                if disabled:
                    log.warning("webhook of %s disabled: it kept failing", subscriber)
                    break
                if _wait_for_retry(subscriber_id, batch[:1]):
                    continue
                break
            # The rest at once; safe for ordered queues too, since the ledger leases at most one
            # delivery of an ordered subscription at a time.
            outcomes = [probe, *pool.map(lambda d: post_one(subscriber, d, client), batch[1:])]
            # The attempts and the acks: committed before the next lease of an ordered line.
            ledger.settle_posts(subscriber, [_posted(d, o) for d, o in zip(batch, outcomes, strict=True)])
            ok = [d["id"] for d, o in zip(batch, outcomes, strict=True) if o.ok]
            posted += len(ok)
            if failing:  # the probe succeeded: a success resets the count
                webhook_health.record_success(subscriber, reset=True)
                failing = False
            failed = [(d, o) for d, o in zip(batch, outcomes, strict=True) if not o.ok]
            for d, o in failed:
                ledger.fail_delivery(d["id"], holder, o.error)
            if failed:
                log.info(
                    "webhook of %s failed %d times (%s)",
                    subscriber,
                    len(failed),
                    webhooks.loggable(failed[0][1].error),
                )
                if not _wait_for_retry(subscriber_id, [d for d, _ in failed]):
                    break
            elif _heads_next(batch, head_rounds) and time.monotonic() < deadline and not stopping.is_set():
                leased = ledger.lease_heads_after(subscriber, ok, limit=WEBHOOK_BATCH, holder=holder)
                head_rounds += 1
    if posted and not failing and _success_is_old(health):
        webhook_health.record_success(subscriber, reset=False)
    return posted


# A healthy webhook's last success is written at the end of a job at most this often: the
# admin shows it to the minute, and a job a message must not cost a statement more each.
SUCCESS_NOTED_EVERY_SECS = 60


def _success_is_old(health):
    noted = health.last_success_at if health is not None else None
    return noted is None or timezone.now() - noted > timedelta(seconds=SUCCESS_NOTED_EVERY_SECS)


def _heads_next(batch, head_rounds):
    """Whether the next batch is the next heads of this batch's ordered subscriptions alone
    (ledger.lease_heads_after: one statement each, no read of the subscriptions first), rather
    than the whole lease of everything ready. Only after a batch of ordered heads alone: a
    batch with other deliveries in it says that other subscriptions of the subscriber have
    work, and the whole lease serves those too. And never more than WEBHOOK_HEAD_ROUNDS rounds
    in a row, so that work that came meanwhile for its other subscriptions (or a line whose
    retry fell due) waits that many posts at most, not for the end of a long line."""
    return head_rounds < WEBHOOK_HEAD_ROUNDS and all(_ordered(d) for d in batch)


def _ordered(delivery):
    return getattr(lookup.find_queue(delivery["queue"]), "ordered", False)


def _posted(delivery, outcome):
    return ledger.Posted(
        delivery["id"],
        delivery["attempt"],
        outcome.ok,
        outcome.status,
        outcome.error,
        outcome.duration_ms,
        outcome.permanent,
    )


def _wait_for_retry(subscriber_id, failed):
    """After failed posts of `failed` deliveries: whether to go on, having waited for the first
    retry. Only an ordered queue's line waits here, for a retry due within
    RETRY_LOOKAHEAD_SECS (a first failure's backoff): nothing else of its subscription may
    go before it, and a job ending now would leave it to a sweep and a Celery round trip
    after its backoff. Otherwise (and for a longer backoff: an endpoint down for a while) the
    job ends, and the sweeper takes the rest when due."""
    if not any(_ordered(d) for d in failed):
        return False
    due_at = next_due_at(subscriber_id)
    if due_at is None:
        return False
    stopping.wait(max((due_at - timezone.now()).total_seconds(), 0))
    return not stopping.is_set()


def next_due_at(subscriber_id, now=None):
    """When the subscriber's next pending delivery falls due, if within RETRY_LOOKAHEAD_SECS."""
    now = now or timezone.now()
    return (
        Delivery.objects.retrying(now)
        .filter(
            ledger.may_lease_q(),
            subscriber_id=subscriber_id,
            next_attempt_at__lte=now + timedelta(seconds=RETRY_LOOKAHEAD_SECS),
        )
        .order_by("next_attempt_at")
        .values_list("next_attempt_at", flat=True)
        .first()
    )


@spans.posted
def post_one(subscriber, delivery, client):
    return webhooks.post(
        subscriber.webhook_url,
        subscriber.webhook_secrets(timezone.now()),
        frames.message_frame(delivery),
        client,
    )


# A sweep not started within this long is dropped by the worker: beat is a process of its own
# and sends one every second whether or not the maintenance worker is up, and a worker back
# after a minute away would otherwise run the sixty it missed, one after the other (the next
# sweep does what they would have done).
SWEEP_EXPIRES_SECS = 5


@shared_task(expires=SWEEP_EXPIRES_SECS)
def sweep():
    """On beat, every second: expire overdue leases (back to pending with backoff, or dead
    after the last attempt), remove connections whose server died, finish the replays and
    unsubscribes it left halfway, fold the kept counts, prune the receipts' log, tell of the
    subscriptions that started lagging (delivery.operational), and enqueue webhook jobs for
    subscribers with work due before the next sweep."""
    expired = ledger.expire_overdue_leases()
    stale = presence.sweep_stale_connections()
    stalled = ledger.finish_stalled()  # replays and unsubscribes whose server died halfway
    tallies.fold()  # the kept counts' changes of the last second (delivery.tallies)
    receipts.prune_moves()  # what the sockets' recheck has read (delivery.receipts)
    health.swept()  # /healthz: the sweep runs
    lagging = operational.check_lagging()  # subscription.lagging, once per crossing
    soon = timezone.now() + timedelta(seconds=RETRY_LOOKAHEAD_SECS)
    due = set(
        Delivery.objects.ready(soon)
        .filter(ledger.may_lease_q())
        .exclude(subscriber__webhook_url="")
        .order_by()
        .values_list("subscriber_id", flat=True)
        .distinct()
    )
    return {
        "expired": expired,
        "stale_connections": stale,
        "stalled_replays": stalled,
        "lagging": len(lagging),
        "webhook_jobs": enqueue_webhooks(due),
    }
