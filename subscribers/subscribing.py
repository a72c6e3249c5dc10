"""Subscribe and unsubscribe: a subscriber's durable interest in a queue's events."""

from django.db import transaction

from delivery import ledger
from queues.models import Event

from .models import Subscription


def subscribe(subscriber, queue, event_name=None):
    """Make or reuse the subscription; returns (subscription, created).

    The event is made if nothing was published to it yet: subscribing first is normal.
    """
    event = None
    if event_name is not None:
        event, _ = Event.objects.get_or_create(queue=queue, name=event_name)
    return Subscription.objects.get_or_create(subscriber=subscriber, queue=queue, event=event)


def unsubscribe(subscription):
    """Delete the subscription; what it was still owed is dropped."""
    with transaction.atomic():
        ledger.drop_undelivered(subscription)
        subscription.delete()
