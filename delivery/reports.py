"""Reports for operators: read-only views of the ledger (the admin, the dashboard's pages,
commands). Nothing here changes a delivery.

Queue statistics: per queue and event, published and deliveries by status, and subscribers
connected (queue_stats, for `queuestats` and the dashboard), from the kept counts
(delivery.tallies): exact, and in proportion to queues, events and subscriptions, not rows.

What is still owed: to a subscriber, per subscription and why it waits (owed_to_subscriber,
why_owed); of a message, by whom (not_acked); the dead letters with their attempt history.
Every query is one grouped statement or a correlated subquery, so a list page asks the same
number of queries for ten rows as for a hundred.

Head of line: in an ordered queue, what holds each subscription back. An ordered subscription
hands out only its head (DeliveryQuerySet.heads: the delivery in flight, else the lowest-seq
pending one), and nothing while that head is in flight or waits for its retry. A head that is
in flight, that waits for a retry, or whose attempts pile up is what an operator looks at: it
can be retried now or skipped (delivery.ledger.retry_now / skip_deliveries).

The predicates (ready, retrying, open, unsettled, heads, the backlog) are delivery.querysets'.
"""

from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django.db.models import Count, DateTimeField, IntegerField, Max, Min, OuterRef, Q, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from queues.models import Event, Queue
from subscribers.models import Connection, Subscription

from . import tallies
from .models import Delivery, DeliveryAttempt, Status
from .querysets import OPEN, line_position, retrying_q


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
    """How many deliveries of the outer row (by `field`: queue, event, subscription,
    subscriber) are in `status` (or, with tallies.PUBLISHED, how many messages of a queue or
    event the hot tables hold): from the kept counts (delivery.tallies), exact, and one lookup
    in a small table per row shown however many rows there are."""
    return tallies.count_of(f"{field}_id", status, outer)


def oldest_pending_at(field, outer="pk"):
    """An annotation: when the oldest pending delivery of the outer row (by `field`: queue,
    subscription or subscriber) was published; None when nothing is pending.

    The lowest seq pending of a subscription is its oldest published, and the index of
    pending deliveries (delivery_ready: subscription, seq) finds it in one probe; a queue's or
    a subscriber's is the oldest of its subscriptions' (pending deliveries an unsubscribe left
    without one are not handed out, and not counted here). Work in proportion to
    subscriptions, whatever the backlog: a MIN(created_at) over the pending rows read every one
    of them, 0.6 s for a subscriber owed 200,000.

    After a seek owes earlier seqs again, the rows it made are stamped with the replay's time:
    the head of the line may then be younger than rows behind it, and this is its age, where a
    MIN would say the oldest row's."""
    if field == "subscription":
        return first_pending_at(OuterRef(outer))
    oldest = (
        Subscription.objects.filter(**{field: OuterRef(outer)})
        .annotate(first=first_pending_at(OuterRef("pk")))
        .filter(first__isnull=False)
        .order_by("first")
        .values("first")[:1]
    )
    return Subquery(oldest, output_field=DateTimeField())


def first_pending_at(subscription):
    """An expression: when the oldest pending delivery of `subscription` (an id, or an
    OuterRef to one) fell due, None when none is pending: its lowest seq pending, one probe of
    the index delivery_ready; due at its publish, or a delayed message at its deliver_at (a
    message delayed by a day is not a day late)."""
    first = (
        Delivery.objects.filter(subscription_id=subscription, status=Status.PENDING)
        .order_by("seq")
        .annotate(due=Coalesce("message__deliver_at", "created_at"))
        .values("due")[:1]
    )
    return Subquery(first, output_field=DateTimeField())


def lines_with_work(subscription):
    """An expression: how many lines of an ordered `subscription` (an id, or an OuterRef) have
    work, one per message group with an open delivery: its open heads (delivery.lines), read
    from delivery_one_head_per_line, never from the backlog behind them."""
    heads = (
        Delivery.objects.filter(subscription_id=subscription)
        .heads()
        .order_by()
        .values("subscription_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Subquery(heads, output_field=IntegerField())


def group_stats(oldest=3):
    """Per ordered queue with work: `lines` (subscription and message group pairs with an open
    delivery), `groups` (distinct groups among them; the default group counts as one) and its
    `oldest` heads [{seq, group, status, subscriber}], oldest first. Read from the heads only."""
    heads = Delivery.objects.heads()
    rows = list(
        heads.order_by()
        .values("queue_id", "queue__name")
        .annotate(lines=Count("pk"), groups=Count("grp", distinct=True))
        .order_by("queue__name")
    )
    for row in rows:
        firsts = heads.filter(queue_id=row["queue_id"]).order_by("seq")[:oldest]
        row["oldest_heads"] = [
            {"seq": seq, "group": grp or None, "status": status, "subscriber": name}
            for seq, grp, status, name in firsts.values_list("seq", "grp", "status", "subscriber__name")
        ]
    return [
        {
            "queue": r["queue__name"],
            "lines": r["lines"],
            "groups": r["groups"],
            "oldest_heads": r["oldest_heads"],
        }
        for r in rows
    ]


def subscriber_backlog(outer="pk"):
    """Annotations for the backlog of the subscriber named by the outer row's `outer` (its pk on
    a subscriber, `subscriber_id` on a connection): n_pending, n_inflight, oldest_pending_at."""
    return {
        "n_pending": status_count("subscriber", Status.PENDING, outer),
        "n_inflight": status_count("subscriber", Status.INFLIGHT, outer),
        "oldest_pending_at": oldest_pending_at("subscriber", outer),
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
    "paused",  # the queue or the subscription hands out nothing
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
    # Of an ordered queue: its lines with work (message groups with an open delivery; the
    # default group is one), each with one head (delivery.lines).
    groups: int = 0
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
    waiting = retrying_q(now)
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
        Delivery.objects.retrying(now)
        .filter(subscriber=subscriber, subscription=OuterRef("pk"))
        .order_by("next_attempt_at", "id")
        .values("last_error")[:1]
    )
    subscriptions = (
        subscriber.subscriptions.select_related("queue", "event")
        .annotate(
            retry_error=Subquery(next_retry_error),
            n_pending=status_count("subscription", Status.PENDING),
            first_pending_at=first_pending_at(OuterRef("pk")),
            n_groups=lines_with_work(OuterRef("pk")),
        )
        .order_by("queue__name", "event__name", "id")
    )
    connected = Connection.objects.filter(subscriber=subscriber).exists()
    owed = []
    for s in subscriptions:
        found = counts.pop(s.pk, {})
        found.update(pending=s.n_pending, oldest_pending_at=s.first_pending_at, groups=s.n_groups or 0)
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
    elif subscription is not None and subscription.paused and owed.pending:
        stopped = True
        yield Reason("paused", "the subscription is paused: it hands out nothing until resumed")
    if queue is not None and queue.ordered and (owed.inflight or owed.retrying) and ready:
        # Each line (message group) hands out its head only; the heads neither in flight nor
        # waiting for a retry are ready, the rest wait behind theirs. One line: all of them.
        blocked = ready - max(owed.groups - owed.inflight - owed.retrying, 0)
        if blocked > 0:
            lines = f"; {owed.groups} groups with work" if owed.groups > 1 else ""
            yield Reason(
                "blocked", f"{blocked} blocked behind the head of line (ordered: one at a time{lines})"
            )
            ready -= blocked
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
    unsettled = Delivery.objects.filter(message=message).unsettled()
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


# --- head of line --------------------------------------------------------------------------------

# A head handed out this many times that failed (it has an error) is piling up attempts.
PILING_UP_AFTER = 1
LIMIT = 200


@dataclass(frozen=True)
class Head:
    delivery: Delivery
    # open deliveries of the same subscription waiting behind it (with message groups: in all
    # its lines, from the kept counts; a line's own count would read its backlog)
    behind: int
    reason: str

    @property
    def waiting_until(self) -> datetime | None:
        d = self.delivery
        return d.ack_deadline if d.status == Status.INFLIGHT else d.next_attempt_at


def why_blocking(delivery, now):
    """Why this head holds its subscription back, in words; "" when it does not (it is
    pending, ready, and on its first try: the next lease takes it)."""
    if delivery.status == Status.INFLIGHT:
        reason = f"in flight (attempt {delivery.attempt}) until its ack deadline"
    elif delivery.is_retrying(now) and delivery.attempt == 0:
        reason = "delayed: not handed out before its deliver_at"  # never tried yet (queues.timing)
    elif delivery.is_retrying(now):
        reason = f"waiting for retry {delivery.attempt + 1}"
    elif delivery.attempt >= PILING_UP_AFTER and delivery.last_error:
        reason = f"ready again after {delivery.attempt} failed attempts"
    else:
        return ""
    if delivery.last_error:
        reason += f": {delivery.last_error}"
    return reason


def blocked_heads(subscriber=None, queue=None, now=None, limit=LIMIT):
    """The heads of ordered subscriptions' lines (one per message group) that hold others back
    (or would if others came): in flight, waiting for a retry, or failed before. Oldest seq
    first per queue.

    Three queries: the heads (DeliveryQuerySet.heads: two index probes per ordered
    subscription), those of them that block, and how many wait behind each (the kept counts).
    """
    now = now or timezone.now()
    deliveries = Delivery.objects.all()
    if subscriber is not None:
        deliveries = deliveries.filter(subscriber=subscriber)
    if queue is not None:
        deliveries = deliveries.filter(queue=queue)
    # What why_blocking has words for: in flight, waiting for a retry, or failed before.
    blocking = (
        Q(status=Status.INFLIGHT) | retrying_q(now) | Q(attempt__gte=PILING_UP_AFTER, last_error__gt="")
    )
    # The heads' ids first: joined with the filters below, the planner would scan the table.
    head_ids = list(deliveries.heads().values_list("id", flat=True))
    heads = list(
        Delivery.objects.filter(id__in=head_ids)
        .filter(blocking)
        .select_related("subscriber", "subscription__event", "queue", "event", "message")
        .order_by("queue__name", "subscriber__name", "seq")[:limit]
    )
    if not heads:
        return []
    kept = tallies.counts(
        ["subscription_id", "status"], subscription_id__in={h.subscription_id for h in heads}, status__in=OPEN
    )
    counts = {}
    for (subscription_id, _), n in kept.items():
        counts[subscription_id] = counts.get(subscription_id, 0) + n
    return [Head(h, counts.get(h.subscription_id, 1) - 1, why_blocking(h, now)) for h in heads]


def head_of(subscription_id):
    """The first head of an ordered subscription's lines (delivery.lines): of its heads, the
    one in flight with the lowest seq, else the lowest-seq pending one; or None. Its default
    line's head when its messages name no group."""
    heads = Delivery.objects.filter(subscription_id=subscription_id).heads()
    firsts = [heads.filter(status=status).order_by("seq").first() for status in OPEN]
    return min(
        (d for d in firsts if d is not None), key=lambda d: line_position(d.status, d.seq), default=None
    )


# --- queue statistics: counts per queue and event, from the kept counts -------------------------

FIELDS = ("queue", "event", "published", "pending", "inflight", "acked", "dead", "connected")


def queue_stats(kept=None):
    """One dict per (queue, event), every event included, sorted by queue and event name:
    {queue, event, published, pending, inflight, acked, dead, connected}.

    `kept`: the kept counts by their full key (tallies.counts(tallies.KEY)), when the caller
    read them already; else they are read here. A queue with no event yet (nothing published
    or subscribed to) gets one row with event None, so a fresh queue shows up. `published`
    counts the messages still in the hot tables (archived history is counted by `analyze`).
    """
    if kept is None:
        by_status = tallies.counts(("queue_id", "event_id", "status"))
    else:
        by_status = tallies.regroup(kept, ("queue_id", "event_id", "status"))
    connected = connected_counts()

    rows = []
    events = Event.objects.select_related("queue").order_by("queue__name", "name")
    keys = [(e.queue, e) for e in events]
    keys += [(q, None) for q in Queue.objects.filter(events__isnull=True).order_by("name")]
    for queue, event in sorted(keys, key=lambda k: (k[0].name, k[1].name if k[1] else "")):
        key = (queue.pk, event.pk if event else None)
        rows.append(
            {
                "queue": queue.name,
                "event": event.name if event else None,
                "published": by_status.get((*key, tallies.PUBLISHED), 0),
                "pending": by_status.get((*key, Status.PENDING), 0),
                "inflight": by_status.get((*key, Status.INFLIGHT), 0),
                "acked": by_status.get((*key, Status.ACKED), 0),
                "dead": by_status.get((*key, Status.DEAD), 0),
                "connected": connected.get(key, 0),
            }
        )
    return rows


def connected_counts():
    """{(queue id, event id): subscribers connected now whose subscriptions cover it}."""
    live = (
        Subscription.objects.filter(subscriber__connections__isnull=False)
        .order_by()
        .values_list("subscriber_id", "queue_id", "event_id")
        .distinct()
    )
    events_of = defaultdict(list)
    for queue_id, event_id in Event.objects.order_by().values_list("queue_id", "id"):
        events_of[queue_id].append(event_id)
    covered = defaultdict(set)
    for subscriber_id, queue_id, event_id in live:
        for e in [event_id] if event_id else events_of[queue_id]:
            covered[(queue_id, e)].add(subscriber_id)
    return {key: len(subscribers) for key, subscribers in covered.items()}
