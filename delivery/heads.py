"""Head of line: in an ordered queue, what holds each subscription back. Read-only.

An ordered subscription hands out only its head, the lowest-seq delivery not yet acked or
dead, and nothing while that head is in flight or waits for its retry. (A delivery in flight
is the head whatever its seq: a seek or a redelivery may reopen lower seqs behind it, and
they wait for it, as delivery.ledger._head says.) A head that is in
flight, that waits for a retry, or whose attempts pile up is what an operator looks at: it
can be retried now or skipped (delivery.ledger.retry_now / skip_deliveries).
"""

from dataclasses import dataclass
from datetime import datetime

from django.db.models import OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from subscribers.models import Subscription

from .models import Delivery, Status
from .owed import status_count

OPEN = (Status.PENDING, Status.INFLIGHT)
# A head handed out this many times that failed (it has an error) is piling up attempts.
PILING_UP_AFTER = 1
LIMIT = 200


@dataclass(frozen=True)
class Head:
    delivery: Delivery
    behind: int  # open deliveries of the same subscription waiting behind it
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
    elif delivery.next_attempt_at > now:
        reason = f"waiting for retry {delivery.attempt + 1}"
    elif delivery.attempt >= PILING_UP_AFTER and delivery.last_error:
        reason = f"ready again after {delivery.attempt} failed attempts"
    else:
        return ""
    if delivery.last_error:
        reason += f": {delivery.last_error}"
    return reason


def blocked_heads(subscriber=None, queue=None, now=None, limit=LIMIT):
    """The heads of ordered subscriptions that hold others back (or would if others came):
    in flight, waiting for a retry, or failed before. Oldest seq first per queue.

    Two queries, in work bounded by the ordered subscriptions, not by what they are owed: each
    one's head is found by probes (its lowest-seq delivery in flight, through
    delivery_by_subscriber, else its lowest-seq pending one, the first entry of
    delivery_ready), and how many wait behind it by status_count. (Looking for the heads
    among every open delivery took a second at two million of them, ordered or not.)
    """
    now = now or timezone.now()
    subscriptions = Subscription.objects.filter(queue__ordered=True)
    if subscriber is not None:
        subscriptions = subscriptions.filter(subscriber=subscriber)
    if queue is not None:
        subscriptions = subscriptions.filter(queue=queue)
    # By subscriber too: its few rows in flight, not the subscription's every row.
    in_flight = Delivery.objects.filter(
        subscriber=OuterRef("subscriber_id"), subscription=OuterRef("pk"), status=Status.INFLIGHT
    )
    pending = Delivery.objects.filter(subscription=OuterRef("pk"), status=Status.PENDING)
    first = Coalesce(
        Subquery(in_flight.order_by("seq").values("pk")[:1]),
        Subquery(pending.order_by("seq").values("pk")[:1]),
    )
    # Read first, then fetched by primary key: as a subquery the planner joined it to a scan
    # of the whole table.
    head_ids = [pk for pk in subscriptions.annotate(head=first).values_list("head", flat=True) if pk]
    if not head_ids:
        return []
    heads = list(
        Delivery.objects.filter(pk__in=head_ids)
        .filter(
            Q(status=Status.INFLIGHT)
            | Q(next_attempt_at__gt=now)
            | Q(attempt__gte=PILING_UP_AFTER, last_error__gt="")
        )
        .annotate(
            n_open=status_count("subscription", Status.PENDING, "subscription_id")
            + status_count("subscription", Status.INFLIGHT, "subscription_id")
        )
        .select_related("subscriber", "subscription__event", "queue", "event", "message")
        .order_by("queue__name", "subscriber__name", "seq")[:limit]
    )
    return [Head(h, h.n_open - 1, why_blocking(h, now)) for h in heads]


def head_of(subscription_id):
    """The current head of an ordered subscription (its delivery in flight, else its lowest-seq
    pending one), or None."""
    of_subscription = Delivery.objects.filter(subscription_id=subscription_id)
    firsts = [of_subscription.filter(status=status).order_by("seq").first() for status in OPEN]
    return min(
        (d for d in firsts if d is not None), key=lambda d: (d.status != Status.INFLIGHT, d.seq), default=None
    )
