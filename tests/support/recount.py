"""The kept counts (delivery.tallies) recounted from the rows, to check them against."""

from collections import Counter

from django.db.models import Count

from delivery import tallies
from delivery.models import Delivery, DeliveryAttempt
from queues.models import Message


def recount():
    """What the tallies must say: the tables' own counts, by the tallies' full key."""
    out = Counter()
    rows = Delivery.objects.order_by().values_list(
        "queue_id", "event_id", "subscription_id", "subscriber_id", "status"
    )
    for queue_id, event_id, subscription_id, subscriber_id, status, n in rows.annotate(n=Count("id")):
        out[(queue_id, event_id, subscription_id or 0, subscriber_id, status)] += n
    for queue_id, event_id, n in (
        Message.objects.order_by().values_list("queue_id", "event_id").annotate(n=Count("id"))
    ):
        out[(queue_id, event_id, 0, 0, tallies.PUBLISHED)] += n
    for a in DeliveryAttempt.objects.select_related("delivery"):
        outcome = 0 if a.ok else 1 if a.status_code is not None else 2
        d = a.delivery
        out[(d.queue_id, d.event_id, 0, d.subscriber_id, tallies.ATTEMPT_OUTCOMES[outcome])] += 1
    return dict(out)
