"""What is still owed: read-only views of the ledger for operators (the admin, reports).

Nothing here changes a delivery; every query is one grouped statement or a correlated
subquery, so a list page asks the same number of queries for ten rows as for a hundred.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, DateTimeField, IntegerField, Max, Min, OuterRef, Q, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from subscribers.models import Subscription

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
class Owed:
    """What one subscription is owed. `subscription` is None for deliveries left without one."""

    subscription: Subscription | None
    pending: int = 0
    inflight: int = 0
    dead: int = 0
    oldest_pending_at: datetime | None = None

    def oldest_pending_age(self, now=None) -> timedelta | None:
        if self.oldest_pending_at is None:
            return None
        return (now or timezone.now()) - self.oldest_pending_at


def owed_to_subscriber(subscriber):
    """Per subscription of the subscriber (every one, owed something or not): its pending,
    in-flight and dead deliveries and when the oldest pending one was published.

    One grouped query over the (subscriber, status) index, one for the subscriptions.
    """
    rows = (
        Delivery.objects.filter(subscriber=subscriber, status__in=UNSETTLED)
        .order_by()
        .values("subscription_id")
        .annotate(
            pending=Count("pk", filter=Q(status=Status.PENDING)),
            inflight=Count("pk", filter=Q(status=Status.INFLIGHT)),
            dead=Count("pk", filter=Q(status=Status.DEAD)),
            oldest_pending_at=Min("created_at", filter=Q(status=Status.PENDING)),
        )
    )
    counts = {r.pop("subscription_id"): r for r in rows}
    subscriptions = subscriber.subscriptions.select_related("queue", "event").order_by(
        "queue__name", "event__name", "id"
    )
    owed = [Owed(s, **counts.pop(s.pk, {})) for s in subscriptions]
    # Whatever is left belongs to no subscription of this subscriber any more.
    for leftover in counts.values():
        owed.append(Owed(None, **leftover))
    return owed


def not_acked(message, limit=200):
    """The deliveries of `message` not acknowledged yet, and how many there are in all.

    Returns (first `limit` of them, oldest subscription first, with subscriber, subscription and
    event loaded; total count).
    """
    unsettled = Delivery.objects.filter(message=message, status__in=UNSETTLED)
    rows = list(
        unsettled.select_related("subscriber", "subscription__event", "subscription__queue").order_by(
            "subscriber__name", "id"
        )[:limit]
    )
    total = len(rows) if len(rows) < limit else unsettled.count()
    return rows, total


def status_counts(deliveries):
    """{status: count} over a queryset of deliveries, every status present (zero if none)."""
    found = dict(deliveries.order_by().values_list("status").annotate(n=Count("pk")))
    return {s.value: found.get(s.value, 0) for s in Status}
