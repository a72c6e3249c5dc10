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

from django.db.models import Count, Exists, OuterRef, Q
from django.utils import timezone

from .models import Delivery, Status

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

    Two queries: the heads (an open delivery with no open one before it: two NOT EXISTS, each
    on the partial index of its status) and how many wait behind each.
    """
    now = now or timezone.now()
    # One term per status, not IN: each term can use its status's partial index (delivery.models).
    open_ = Delivery.objects.filter(_open(), queue__ordered=True, subscription__isnull=False)
    if subscriber is not None:
        open_ = open_.filter(subscriber=subscriber)
    if queue is not None:
        open_ = open_.filter(queue=queue)
    before = Delivery.objects.filter(subscription_id=OuterRef("subscription_id"), seq__lt=OuterRef("seq"))
    in_flight = Delivery.objects.filter(subscription_id=OuterRef("subscription_id"), status=Status.INFLIGHT)
    first = ~Exists(before.filter(status=Status.PENDING)) & ~Exists(before.filter(status=Status.INFLIGHT))
    heads = list(
        open_.filter(first | (Q(status=Status.INFLIGHT) & ~Exists(in_flight.filter(seq__lt=OuterRef("seq")))))
        .exclude(Q(status=Status.PENDING) & Exists(in_flight))
        .filter(
            Q(status=Status.INFLIGHT)
            | Q(next_attempt_at__gt=now)
            | Q(attempt__gte=PILING_UP_AFTER, last_error__gt="")
        )
        .select_related("subscriber", "subscription__event", "queue", "event", "message")
        .order_by("queue__name", "subscriber__name", "seq")[:limit]
    )
    if not heads:
        return []
    counts = dict(
        Delivery.objects.filter(_open(), subscription_id__in={h.subscription_id for h in heads})
        .order_by()
        .values_list("subscription_id")
        .annotate(n=Count("id"))
    )
    return [Head(h, counts.get(h.subscription_id, 1) - 1, why_blocking(h, now)) for h in heads]


def head_of(subscription_id):
    """The current head of an ordered subscription (its delivery in flight, else its lowest-seq
    pending one), or None."""
    of_subscription = Delivery.objects.filter(subscription_id=subscription_id)
    firsts = [of_subscription.filter(status=status).order_by("seq").first() for status in OPEN]
    return min(
        (d for d in firsts if d is not None), key=lambda d: (d.status != Status.INFLIGHT, d.seq), default=None
    )


def _open():
    return Q(status=Status.PENDING) | Q(status=Status.INFLIGHT)
