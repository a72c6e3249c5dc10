"""Counts per queue and event for operators: read-only, from the kept counts (delivery.tallies),
so they cost in proportion to queues, events and subscriptions, not to rows, and are exact."""

from collections import defaultdict

from queues.models import Event, Queue
from subscribers.models import Subscription

from . import tallies
from .models import Status

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
