"""Counts per queue and event for operators: read-only, a few aggregate queries in all."""

from collections import defaultdict

from django.db.models import Count

from queues.models import Event, Message, Queue
from subscribers.models import Subscription

from .models import Delivery, Status

FIELDS = ("queue", "event", "published", "pending", "inflight", "acked", "dead", "connected")


def queue_stats():
    """One dict per (queue, event), every event included, sorted by queue and event name:
    {queue, event, published, pending, inflight, acked, dead, connected}.

    A queue with no event yet (nothing published or subscribed to) gets one row with event
    None, so a fresh queue shows up. `published` counts the messages still in the hot tables
    (archived history is counted by `analyze`).
    """
    # order_by(): the models' default orderings would otherwise split the groups.
    published = {
        (r["queue_id"], r["event_id"]): r["n"]
        for r in Message.objects.order_by().values("queue_id", "event_id").annotate(n=Count("id"))
    }
    by_status = {}
    for r in Delivery.objects.order_by().values("queue_id", "event_id", "status").annotate(n=Count("id")):
        by_status[(r["queue_id"], r["event_id"], r["status"])] = r["n"]
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
                "published": published.get(key, 0),
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
