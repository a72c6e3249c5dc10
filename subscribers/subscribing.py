"""Subscribe and unsubscribe: a subscriber's durable interest in a queue's events."""

from django.db import transaction

from delivery import ledger
from mqsite import limits
from queues.models import Event

from .models import Subscription
from .presence import lock_subscriber


def subscribe(subscriber, queue, event_name=None, limited=False):
    """Make or reuse the subscription; returns (subscription, created).

    The event is made if nothing was published to it yet: subscribing first is normal.
    `limited`: the subscriber itself asks (REST, its socket), so mqsite.limits applies: a new
    subscription past MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER, or a new event name past its hourly
    cap, is refused (LimitExceeded) and nothing is made. Reusing a subscription is always fine.
    """
    if not limited:
        event = None
        if event_name is not None:
            event, _ = Event.objects.get_or_create(queue=queue, name=event_name)
        return Subscription.objects.get_or_create(subscriber=subscriber, queue=queue, event=event)
    with transaction.atomic():
        lock_subscriber(subscriber)  # two subscribes at once must not both see the last free slot
        event = Event.objects.filter(queue=queue, name=event_name).first() if event_name is not None else None
        if event_name is None or event is not None:
            existing = Subscription.objects.filter(subscriber=subscriber, queue=queue, event=event).first()
            if existing is not None:
                return existing, False
        limits.check_subscriptions(subscriber.subscriptions.count())
        if event is None and event_name is not None:
            limits.charge_new_events({subscriber.pk: 1})
            event, _ = Event.objects.get_or_create(queue=queue, name=event_name)
        return Subscription.objects.get_or_create(subscriber=subscriber, queue=queue, event=event)


def subscribe_from(subscriber, queue, event_name, point, limited=False):
    """subscribe(), and a new subscription also owes what its queue still holds from `point`
    (a subscribers.replay.Point), made in the same transaction: it is never seen without its
    replay (in an ordered queue a lease between the two would hand out a live message before
    the history). The same subscription again is answered as it is, nothing replayed: a client
    sends its subscribe again at each reconnect, and must not be handed its history again each
    time (seek() is the way to replay an existing one). Returns (subscription, created,
    ledger.Replayed or None)."""
    with transaction.atomic():
        subscription, created = subscribe(subscriber, queue, event_name, limited=limited)
        replayed = ledger.replay(subscription, point) if created else None
    return subscription, created, replayed


def seek(subscription, point, event_ids=None):
    """The subscription owes again every message of its queue (and event) from `point` that is
    still in the hot tables: ledger.replay(), acked and dead ones handed out again."""
    return ledger.replay(subscription, point, reopen=True, event_ids=event_ids)


def unsubscribe(subscription):
    """Delete the subscription; what it was still owed is dropped."""
    with transaction.atomic():
        ledger.drop_undelivered(subscription)
        subscription.delete()
