"""What is still owed: read-only views of the ledger for operators (the admin, reports).

Nothing here changes a delivery; every query is one grouped statement or a correlated
subquery, so a list page asks the same number of queries for ten rows as for a hundred.
"""

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django.db.models import Count, DateTimeField, F, IntegerField, Max, Min, OuterRef, Q, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from subscribers.models import Connection, Subscription

from .models import Delivery, DeliveryAttempt, Status

# Not acked yet: still to be handed out or acknowledged, or given up on (dead).
UNSETTLED = (Status.PENDING, Status.INFLIGHT, Status.DEAD)


def correlated_count(queryset, field, outer="pk"):
    """An annotation counting the rows of `queryset` whose `field` is the outer row's `outer`
    (its pk, or e.g. `subscriber_id` to count what belongs to a connection's subscriber).

    A correlated subquery rather than a JOIN and GROUP BY: the database evaluates it only for
    the rows of the page shown, and several of them on one row do not multiply each other.
    """
    counted = (
        queryset.filter(**{field: OuterRef(outer)})
        .order_by()
        .values(field)
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def status_count(field, status, outer="pk"):
    """How many deliveries of the outer row (by `field`: queue, subscriber, ...) are in `status`."""
    return correlated_count(Delivery.objects.filter(status=status), field, outer)


def oldest_pending_at(field, outer="pk"):
    """An annotation: when the oldest pending delivery of the outer row (by `field`) was
    published; None when nothing is pending. A correlated subquery, as correlated_count."""
    oldest = (
        Delivery.objects.filter(status=Status.PENDING, **{field: OuterRef(outer)})
        .order_by()
        .values(field)
        .annotate(at=Min("created_at"))
        .values("at")
    )
    return Subquery(oldest, output_field=DateTimeField())


def _first_pending_at():
    """A subquery: when the first pending delivery (lowest seq) of the outer subscription was
    published. One probe of delivery_ready (subscription, seq) WHERE pending; status is the
    literal 'pending', as that index's condition is (Delivery.Meta)."""
    return (
        Delivery.objects.filter(subscription=OuterRef("pk"), status=Status.PENDING)
        .order_by("seq")
        .values("created_at")[:1]
    )


def subscriber_oldest_pending_at(outer="pk"):
    """An annotation: when the oldest pending delivery of the subscriber named by the outer
    row's `outer` was published; None when nothing is pending. oldest_pending_at's answer, in
    work bounded by the subscriber's subscriptions rather than by its backlog.

    Within a queue seq grows with publish time, so a subscription's oldest pending delivery is
    its first entry in delivery_ready (subscription, seq) WHERE pending: one index probe per
    subscription, and the oldest of those. (A MIN(created_at) over the pending rows reads every
    one of them: 0.6 s for a subscriber owed 200,000.) Pending rows left without a
    subscription (deleted other than by subscribing.unsubscribe, which drops them) are not
    looked at: nothing hands them out. After a replay (subscribing.seek) owes earlier seqs
    again, the rows it made are stamped with the replay's time: the head of the line may then
    be younger than rows behind it, and this is its age, where the MIN says the oldest row's.
    """
    oldest = (
        Subscription.objects.filter(subscriber=OuterRef(outer))
        .annotate(first_pending_at=Subquery(_first_pending_at(), output_field=DateTimeField()))
        .order_by(F("first_pending_at").asc(nulls_last=True))
        .values("first_pending_at")[:1]
    )
    return Subquery(oldest, output_field=DateTimeField())


def subscriber_backlog(outer="pk"):
    """Annotations for the backlog of the subscriber named by the outer row's `outer` (its pk on
    a subscriber, `subscriber_id` on a connection): n_pending, n_inflight, oldest_pending_at."""
    return {
        "n_pending": status_count("subscriber", Status.PENDING, outer),
        "n_inflight": status_count("subscriber", Status.INFLIGHT, outer),
        "oldest_pending_at": subscriber_oldest_pending_at(outer),
    }


def with_attempt_history(deliveries):
    """Annotate deliveries (a queryset) with their webhook attempt history, for a list page:
    n_tries (attempt rows), last_try_at, and died_at: when the last try was made, or else
    when it was last handed out (a delivery that died of expired leases or nacks has no
    attempt rows). For a dead one that is about when it died: the ledger does not stamp it.

    Correlated subqueries, as correlated_count: evaluated only for the rows of the page.
    """
    last_try = (
        DeliveryAttempt.objects.filter(delivery=OuterRef("pk"))
        .order_by()
        .values("delivery")
        .annotate(at=Max("at"))
        .values("at")
    )
    return deliveries.annotate(
        n_tries=correlated_count(DeliveryAttempt.objects.all(), "delivery"),
        last_try_at=Subquery(last_try, output_field=DateTimeField()),
    ).annotate(died_at=Coalesce("last_try_at", "delivered_at"))


def dead_letters(deliveries=None):
    """The dead deliveries among `deliveries` (default: all), with their attempt history."""
    deliveries = Delivery.objects.all() if deliveries is None else deliveries
    return with_attempt_history(deliveries.filter(status=Status.DEAD))


@dataclass(frozen=True)
class Reason:
    """Why some of what a subscription is owed waits, in an operator's words. `code` names the
    kind (REASONS); `until` is when that wait ends, if it has an end; `error` the last one."""

    code: str
    words: str
    until: datetime | None = None
    error: str = ""


# The kinds of Reason, most telling first.
REASONS = (
    "inactive",  # the subscriber's token is refused, its webhook not called: it takes nothing
    "orphaned",  # pending without a subscription (left by an unsubscribe): never handed out
    "paused",  # the queue hands out nothing
    "blocked",  # an ordered subscription waits for its head (in flight or waiting for a retry)
    "retrying",  # pending, but not before next_attempt_at (a nack, a failed push, a lost lease)
    "inflight",  # handed out, until acked or the ack deadline
    "pulled",  # ready, and nothing pushes it: no open websocket, no webhook
    "pushed",  # ready, and an open websocket or the webhook worker takes it next
    "dead",  # given up on after the queue's max_attempts
)


@dataclass(frozen=True)
class Owed:
    """What one subscription is owed. `subscription` is None for deliveries left without one.

    Of the pending ones, `ready` may be handed out now and `retrying` wait until their
    next_attempt_at (the earliest: `next_retry_at`, with that one's `retry_error`).
    `reasons` say why each part waits (Reason, in REASONS order)."""

    subscription: Subscription | None
    pending: int = 0
    inflight: int = 0
    dead: int = 0
    oldest_pending_at: datetime | None = None
    ready: int = 0
    retrying: int = 0
    next_retry_at: datetime | None = None
    retry_error: str = ""
    inflight_until: datetime | None = None
    reasons: tuple[Reason, ...] = ()

    def oldest_pending_age(self, now=None) -> timedelta | None:
        if self.oldest_pending_at is None:
            return None
        return (now or timezone.now()) - self.oldest_pending_at


def owed_to_subscriber(subscriber, now=None):
    """Per subscription of the subscriber (every one, owed something or not): its pending,
    in-flight and dead deliveries, when the oldest pending one was published, and why they
    wait (why_owed).

    Three queries, and none reads the pending backlog row by row: one grouped over the rows
    that are few however much is owed (in flight, dead, waiting for a retry, and pending ones
    left without a subscription), each found by an index; one for the subscriptions, with
    each one's pending count (status_count), oldest pending (an index probe) and the error of
    its next retry; one for whether the subscriber has a websocket open.
    """
    now = now or timezone.now()
    waiting = Q(status=Status.PENDING, next_attempt_at__gt=now)
    orphaned = Q(status=Status.PENDING, subscription__isnull=True)
    rows = (
        # The three arms use delivery_by_subscriber, delivery_due and delivery_ready.
        Delivery.objects.filter(subscriber=subscriber)
        .filter(Q(status__in=[Status.INFLIGHT, Status.DEAD]) | waiting | orphaned)
        .order_by()
        .values("subscription_id")
        .annotate(
            pending=Count("pk", filter=orphaned),
            inflight=Count("pk", filter=Q(status=Status.INFLIGHT)),
            dead=Count("pk", filter=Q(status=Status.DEAD)),
            oldest_pending_at=Min("created_at", filter=orphaned),
            retrying=Count("pk", filter=waiting),
            next_retry_at=Min("next_attempt_at", filter=waiting),
            inflight_until=Max("ack_deadline", filter=Q(status=Status.INFLIGHT)),
        )
    )
    counts = {r.pop("subscription_id"): r for r in rows}
    next_retry_error = (
        # By subscriber too, so that delivery_due finds it among the waiting ones only.
        Delivery.objects.filter(
            subscriber=subscriber, subscription=OuterRef("pk"), status=Status.PENDING, next_attempt_at__gt=now
        )
        .order_by("next_attempt_at", "id")
        .values("last_error")[:1]
    )
    subscriptions = (
        subscriber.subscriptions.select_related("queue", "event")
        .annotate(
            retry_error=Subquery(next_retry_error),
            n_pending=status_count("subscription", Status.PENDING),
            first_pending_at=Subquery(_first_pending_at(), output_field=DateTimeField()),
        )
        .order_by("queue__name", "event__name", "id")
    )
    connected = Connection.objects.filter(subscriber=subscriber).exists()
    owed = []
    for s in subscriptions:
        found = counts.pop(s.pk, {})
        found.update(pending=s.n_pending, oldest_pending_at=s.first_pending_at)
        if found.get("retrying"):
            found["retry_error"] = s.retry_error or ""
        owed.append(_with_reasons(Owed(s, **found), subscriber, connected))
    # Whatever is left belongs to no subscription of this subscriber any more.
    for leftover in counts.values():
        owed.append(_with_reasons(Owed(None, **leftover), subscriber, connected))
    return owed


def _with_reasons(owed, subscriber, connected):
    ready = owed.pending - owed.retrying
    return replace(owed, ready=ready, reasons=tuple(why_owed(owed, ready, subscriber, connected)))


def why_owed(owed, ready, subscriber, connected):
    """The Reasons what `owed` counts waits, in REASONS order; none when it is owed nothing.
    `ready`: its pending deliveries that may be handed out now; `connected`: whether the
    subscriber has a websocket open."""
    subscription = owed.subscription
    queue = subscription.queue if subscription is not None else None
    if not (owed.pending or owed.inflight or owed.dead):
        return
    stopped = False  # nothing is handed out, whatever the transport
    if not subscriber.is_active:
        stopped = True
        yield Reason(
            "inactive",
            "the subscriber is inactive: its token is refused and its webhook not called, so it gets nothing",
        )
    if subscription is None and owed.pending:
        stopped = True
        yield Reason("orphaned", f"{owed.pending} left without a subscription: never handed out")
    if queue is not None and queue.paused and owed.pending:
        stopped = True
        yield Reason("paused", f"the queue {queue.name} is paused: it hands out nothing until resumed")
    if queue is not None and queue.ordered and (owed.inflight or owed.retrying) and ready:
        yield Reason("blocked", f"{ready} blocked behind the head of line (ordered: one at a time)")
        ready = 0
    if owed.retrying:
        yield Reason(
            "retrying",
            f"{owed.retrying} waiting for a retry",
            until=owed.next_retry_at,
            error=owed.retry_error,
        )
    if owed.inflight:
        yield Reason("inflight", f"{owed.inflight} in flight, to be acked", until=owed.inflight_until)
    if ready and not stopped:
        if connected:
            yield Reason("pushed", f"{ready} ready: its open websocket takes them as its window frees")
        elif subscriber.webhook_url:
            yield Reason(
                "pushed", f"{ready} ready: the webhook worker posts them to {subscriber.webhook_url}"
            )
        else:
            yield Reason("pulled", f"{ready} waiting to be pulled: no open websocket and no webhook")
    if owed.dead:
        yield Reason("dead", f"{owed.dead} dead after the queue's last attempt: redeliver them to try again")


def not_acked(message, limit=200):
    """The deliveries of `message` not acknowledged yet, and how many there are in all.

    Returns (first `limit` of them, oldest subscription first, with subscriber, subscription and
    event loaded; total count).
    """
    unsettled = Delivery.objects.filter(message=message, status__in=UNSETTLED)
    rows = list(
        unsettled.select_related(
            "subscriber", "subscription__subscriber", "subscription__event", "subscription__queue"
        ).order_by("subscriber__name", "id")[:limit]
    )
    total = len(rows) if len(rows) < limit else unsettled.count()
    return rows, total


def status_counts(deliveries):
    """{status: count} over a queryset of deliveries, every status present (zero if none)."""
    found = dict(deliveries.order_by().values_list("status").annotate(n=Count("pk")))
    return {s.value: found.get(s.value, 0) for s in Status}
