"""Operational events: what operators want to hear of, published by the server to its own
queue mq.system (queues.models.SYSTEM_QUEUE) and sent as the Django signals of the same names
(delivery.signals), in the process that made the change, after its commit.

    webhook.disabled      a webhook failed for too long (delivery.webhook_health), or an
                          operator disabled it
    webhook.enabled       an operator enabled it again
    delivery.dead         deliveries died (every path of the ledger that kills one calls
                          died(), with the reason: max_attempts, killed, skipped, ...)
    subscription.lagging  a subscription's oldest pending delivery got older than its queue's
                          lag_alert_secs (check_lagging, on the sweep; once per crossing)

The events go through the normal publish (delivery.publishing), so subscribers of mq.system get
them by every transport. They are published after the commit of what they tell, in their own
transaction: lost if the process dies in between (at most once, as the signals are), never told
of a change that was rolled back. A publish is skipped when no subscription of mq.system owes
that event (subscribed(): a read kept for a couple of seconds, so that deaths with nobody
listening cost no query); the signals are sent all the same. Deliveries of mq.system itself
that die are never told of (an event about an event could loop).
"""

import logging
import time
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import OuterRef, Q
from django.db.models.signals import post_delete, post_save
from django.utils import timezone

from mqsite import adb
from queues.lookup import system_queue
from queues.models import SYSTEM_QUEUE, Event, Queue
from subscribers.models import Subscriber, Subscription

from . import signals
from .models import Delivery, Status
from .reports import first_pending_at

log = logging.getLogger(__name__)

WEBHOOK_DISABLED = "webhook.disabled"
WEBHOOK_ENABLED = "webhook.enabled"
DELIVERY_DEAD = "delivery.dead"
SUBSCRIPTION_LAGGING = "subscription.lagging"

# Why a delivery died, as delivery.dead's `reason` says it (its last error says it in words).
MAX_ATTEMPTS = "max_attempts"
KILLED = "killed"
SKIPPED = "skipped"
EXPIRED = "expired"  # its message's expiry passed before it was acked


# Which events of mq.system some subscription owes (ALL: every event), as this process last
# read them, and until when that read holds: a death with nobody listening costs no query. A
# subscription made or removed in this process is seen at once (the model's signals, below);
# one made in another process within SUBSCRIBED_KEPT_SECS.
SUBSCRIBED_KEPT_SECS = 2.0
ALL = object()
_subscribed = {"events": None, "until": 0.0}


def subscribed(event):
    """Whether a subscription of mq.system owes `event` (to that event, or to all of them)."""
    events = _kept_events()
    if events is None:
        events = _keep_events(adb.run_sync(_subscribed_events()))
    return ALL in events or event in events


@adb.twin(subscribed)
async def asubscribed(event):
    """subscribed() from the event loop, on the async connection: a socket's nack that kills
    asks it before it takes a thread to tell of the deaths."""
    events = _kept_events()
    if events is None:
        events = _keep_events(await adb.run(_subscribed_events()))
    return ALL in events or event in events


def _subscribed_events():
    rows = yield (
        f"""
        SELECT e.name FROM {Subscription._meta.db_table} s
        JOIN {Queue._meta.db_table} q ON q.id = s.queue_id
        LEFT JOIN {Event._meta.db_table} e ON e.id = s.event_id
        WHERE q.name = %s
        """,
        [SYSTEM_QUEUE],
    )
    return {ALL if name is None else name for (name,) in rows}


def _kept_events():
    if time.monotonic() >= _subscribed["until"]:
        return None
    return _subscribed["events"]


def _keep_events(events):
    _subscribed.update(events=events, until=time.monotonic() + SUBSCRIBED_KEPT_SECS)
    return events


def listened(event, signal):
    """Whether anyone hears of `event`: a receiver of its signal, or (maybe) a subscription."""
    return signal.has_listeners() or subscribed(event)


async def alistened(event, signal):
    return signal.has_listeners() or await asubscribed(event)


def forget_subscribed(**kwargs):
    _subscribed.update(events=None, until=0.0)


post_save.connect(forget_subscribed, sender=Subscription, dispatch_uid="operational-subscribed-save")
post_delete.connect(forget_subscribed, sender=Subscription, dispatch_uid="operational-subscribed-delete")


def _publish(event, payloads):
    if not payloads or not subscribed(event):
        return
    prepare, publish = _publishing["prepare"], _publishing["publish"]
    publish(system_queue(), [prepare(event, p) for p in payloads])


# delivery.publishing's prepare() and publish(), given at app start (delivery.apps): publishing
# imports the ledger, which calls here, so this module may not import it.
_publishing = {}


def publish_with(prepare, publish):
    _publishing.update(prepare=prepare, publish=publish)


def _tell(event, signal, sender, payloads):
    """Publish the events and send the signal: called after the commit of the change."""
    try:
        _publish(event, payloads)
    except Exception:
        # The change is made; an event that cannot be published must not fail its caller.
        log.exception("could not publish %d %s event(s) to %s", len(payloads), event, SYSTEM_QUEUE)
    signal.send(sender=sender, payloads=payloads)


def tell_after_commit(event, signal, sender, payloads):
    payloads = list(payloads)
    if payloads:
        transaction.on_commit(lambda: _tell(event, signal, sender, payloads), robust=True)


# --- delivery.dead ------------------------------------------------------------------------------


def died(ids, reason=MAX_ATTEMPTS):
    """Deliveries `ids` died (some of them, maybe: only those dead once the change commits are
    told of), of `reason`: delivery.dead for each, after the commit. Every path of the ledger
    where a delivery dies calls this with the ids its statement returned; a new path calls it
    too. Costs nothing when none died."""
    ids = list(ids)
    if ids:
        transaction.on_commit(lambda: tell_deaths(ids, reason), robust=True)


def tell_deaths(ids, reason):
    """delivery.dead for those of `ids` that are dead (from a path that committed already: the
    event loop's, or an on_commit callback). One read of them, and only when someone listens:
    a signal receiver, or a subscription of mq.system to delivery.dead."""
    if not listened(DELIVERY_DEAD, signals.delivery_dead):
        return
    rows = (
        Delivery.objects.filter(pk__in=ids, status=Status.DEAD)
        .exclude(queue__name=SYSTEM_QUEUE)
        .order_by("pk")
        .values_list(
            "pk",
            "message_id",
            "subscription_id",
            "queue__name",
            "event__name",
            "subscriber__name",
            "attempt",
            "last_error",
        )
    )
    payloads = [
        {
            "queue": queue,
            "event": event,
            "subscriber": subscriber,
            "subscription_id": subscription_id,
            "message_id": message_id,
            "delivery_id": delivery_id,
            # A message that expired while its delivery was in flight dies on any path that
            # ends the lease (a nack, a deadline): its last error says so, not the path.
            "reason": EXPIRED if last_error == EXPIRED else reason,
            "attempts": attempt,
            "error": last_error,
        }
        for delivery_id, message_id, subscription_id, queue, event, subscriber, attempt, last_error in rows
    ]
    if payloads:
        _tell(DELIVERY_DEAD, signals.delivery_dead, Delivery, payloads)


# --- webhook.disabled, webhook.enabled ----------------------------------------------------------


def webhook_payload(subscriber_name, health, by=None):
    return {
        "subscriber": subscriber_name,
        "disabled_since": _iso(health.disabled_since),
        "failures": health.disabled_after if health.disabled_after is not None else health.failures,
        "first_failure_at": _iso(health.first_failure_at),
        "last_error": health.last_error,
        "by": by,
    }


def webhook_disabled(subscriber_name, health, by=None):
    tell_after_commit(
        WEBHOOK_DISABLED, signals.webhook_disabled, Subscriber, [webhook_payload(subscriber_name, health, by)]
    )


def webhook_enabled(subscriber_name, health, by=None):
    tell_after_commit(
        WEBHOOK_ENABLED, signals.webhook_enabled, Subscriber, [webhook_payload(subscriber_name, health, by)]
    )


def _iso(at):
    return at.isoformat() if at is not None else None


# --- subscription.lagging -----------------------------------------------------------------------


def check_lagging(now=None):
    """On the sweep: mark the subscriptions whose oldest pending delivery is older than their
    queue's lag_alert_secs as lagging, publishing subscription.lagging for each that was not
    (once per crossing), and unmark those that recovered. One read of the subscriptions of the
    queues with an alert (and of those still marked), each with one probe of the index of its
    pending deliveries (the lowest seq pending is the oldest published): its cost grows with
    the subscriptions, never with their backlog. A write only when one crosses. Returns the
    ids of the subscriptions newly lagging."""
    now = now or timezone.now()
    found = (
        Subscription.objects.filter(Q(queue__lag_alert_secs__isnull=False) | Q(lagging_since__isnull=False))
        .order_by()
        .annotate(oldest=first_pending_at(OuterRef("pk")))
        .values_list("pk", "lagging_since", "queue__lag_alert_secs", "oldest")
    )
    crossing, recovered = [], []
    for pk, lagging_since, alert_secs, oldest in found:
        lagging = bool(alert_secs) and oldest is not None and oldest < now - timedelta(seconds=alert_secs)
        if lagging and lagging_since is None:
            crossing.append(pk)
        elif not lagging and lagging_since is not None:
            recovered.append(pk)
    if recovered:
        Subscription.objects.filter(pk__in=recovered).update(lagging_since=None)
    if not crossing:
        return []
    with transaction.atomic():
        # Compare-and-set: of two sweeps at once, one marks it, and only that one tells.
        marked = _mark_lagging(crossing, now)
        payloads = _lagging_payloads(marked, now)
        tell_after_commit(SUBSCRIPTION_LAGGING, signals.subscription_lagging, Subscription, payloads)
    return marked


def _mark_lagging(ids, now):
    table = Subscription._meta.db_table
    marks = ", ".join(["%s"] * len(ids))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET lagging_since = %s"
            f" WHERE id IN ({marks}) AND lagging_since IS NULL RETURNING id",
            [connection.ops.adapt_datetimefield_value(now), *ids],
        )
        return sorted(row[0] for row in cursor.fetchall())


def _lagging_payloads(ids, now):
    rows = (
        Subscription.objects.filter(pk__in=ids)
        .order_by("pk")
        .annotate(oldest=first_pending_at(OuterRef("pk")))
        .values_list(
            "pk", "queue__name", "event__name", "subscriber__name", "queue__lag_alert_secs", "oldest"
        )
    )
    return [
        {
            "queue": queue,
            "event": event,
            "subscriber": subscriber,
            "subscription_id": pk,
            "lag_alert_secs": alert_secs,
            "oldest_pending_at": _iso(oldest),
            "oldest_pending_age_s": round((now - oldest).total_seconds(), 1) if oldest else None,
        }
        for pk, queue, event, subscriber, alert_secs, oldest in rows
    ]
