"""Subscribe and unsubscribe: a subscriber's durable interest in a queue's events."""

import json

from django.db import transaction

from mqsite import bus, limits
from queues.models import Event
from subscribers import filters
from subscribers.models import Subscription

from . import ledger
from .presence import lock_subscriber

# A subscribe that says nothing of a filter leaves the one the subscription has (a client
# that knows no filters, sending its subscribe again at each reconnect, clears nothing).
KEEP = object()


def subscribe(subscriber, queue, event_name=None, limited=False, replaying=False, filter=KEEP):  # noqa: A002
    """Make or reuse the subscription, with `filter` (unchecked, as sent: BadFilter before
    anything is made; KEEP: a new one has none, an existing one keeps its own) set on it, a
    reused one's changed; returns (subscription, created).

    The event is made if nothing was published to it yet: subscribing first is normal.
    `limited`: the subscriber itself asks (REST, its socket), so mqsite.limits applies: a new
    subscription past MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER, or (`replaying`, subscribe_from)
    past MQ_MAX_REPLAYS_PER_SUBSCRIBER replays under way, or a new event name past its hourly
    cap, is refused (LimitExceeded) and nothing is made or counted. Reusing a subscription is
    always fine, but for one being unsubscribed (ledger.unsubscribe: it is owed nothing and
    goes soon), refused until that is done.
    """
    checked = KEEP if filter is KEEP else filters.check_filter(filter)
    with transaction.atomic():
        subscription, created = _subscribe(subscriber, queue, event_name, limited, replaying)
        if checked is not KEEP:
            set_filter(subscription, checked)
    return subscription, created


def set_filter(subscription, checked):
    """Set a checked filter (subscribers.filters.check_filter) on the subscription: publishes
    after it are owed by it; what the subscription was owed before stays. Setting the filter
    it has already writes nothing."""
    if _as_stored(checked) != _as_stored(subscription.filter):
        filters.set_filter(subscription, checked)


def _as_stored(checked):
    # As JSON, not as Python values: in Python True == 1 == 1.0, to a filter they differ.
    return json.dumps(checked)


def _subscribe(subscriber, queue, event_name, limited, replaying):
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
                if existing.leaving:
                    limits.check_not_busy(existing.busy_since)
                return existing, False
        limits.check_subscriptions(subscriber.subscriptions.count())
        if replaying:  # before the event's count is charged: a refusal counts nothing
            limits.check_replays(_replays_under_way(subscriber))
        if event is None and event_name is not None:
            limits.charge_new_events({subscriber.pk: 1})
            event, _ = Event.objects.get_or_create(queue=queue, name=event_name)
        return Subscription.objects.get_or_create(subscriber=subscriber, queue=queue, event=event)


def subscribe_from(subscriber, queue, event_name, point, limited=False, filter=KEEP):  # noqa: A002
    """subscribe(), and a new subscription also owes what its queue still holds from `point`
    (a subscribers.replay.Point). The replay is marked in the same transaction as the
    subscription (ledger.begin_replay): it is never seen without it, and is leased nothing
    until the replay's chunks are all done (in an ordered queue a lease between the two would
    hand out a live message before the history). The same subscription again is answered as
    it is, nothing replayed: a client sends its subscribe again at each reconnect, and must not
    be handed its history again each time (seek() is the way to replay an existing one).
    `limited`: past MQ_MAX_REPLAYS_PER_SUBSCRIBER replays under way, nothing is made
    (LimitExceeded, 429). `filter`: as subscribe(), set before the replay, which applies it.
    Returns (subscription, created, ledger.Replayed or None)."""
    with transaction.atomic():
        subscription, created = subscribe(
            subscriber, queue, event_name, limited=limited, replaying=True, filter=filter
        )
        if not created:
            return subscription, False, None
        from_seq = ledger.begin_replay(subscription, point)
    return subscription, True, ledger.Replayed(from_seq, ledger.finish_replay(subscription.pk))


def seek(subscription, point, event_ids=None, limited=False):
    """The subscription owes again every message of its queue (and event) from `point` that is
    still in the hot tables: ledger.replay(), acked and dead ones handed out again. `limited`:
    as subscribe_from()."""
    with transaction.atomic():
        if limited:
            lock_subscriber(subscription.subscriber)
            limits.check_replays(_replays_under_way(subscription.subscriber))
        from_seq = ledger.begin_replay(subscription, point, reopen=True, event_ids=event_ids)
    return ledger.Replayed(from_seq, ledger.finish_replay(subscription.pk))


def _replays_under_way(subscriber):
    return subscriber.subscriptions.filter(replay_next__isnull=False).count()


def unsubscribe(subscription):
    """Delete the subscription; what it was still owed is dropped (ledger.unsubscribe, in
    chunks when it is much)."""
    ledger.unsubscribe(subscription.pk)


def pause(subscriptions):
    """Pause these subscriptions (a queryset): each stays owed everything published to it and
    is handed nothing, by any transport, until resumed (the lease's rule, ledger._may_lease);
    what is in flight finishes as usual. Pausing a paused one changes nothing. Returns the
    ids of those it paused."""
    return _set_paused(subscriptions, True)


def resume(subscriptions):
    """Resume these subscriptions (a queryset): their subscribers are woken at once (sockets,
    long polls, the webhook job), so that what they were owed meanwhile goes out without
    waiting for a recheck; an ordered one goes on from its head, in order. Returns the ids of
    those it resumed."""
    return _set_paused(subscriptions, False)


def _set_paused(subscriptions, paused):
    with transaction.atomic():
        changed = subscriptions.filter(paused=not paused).select_for_update().order_by("pk")
        changed = list(changed.values_list("pk", "subscriber_id"))
        if changed:
            Subscription.objects.filter(pk__in=[pk for pk, _ in changed]).update(paused=paused)
            if not paused:
                bus.send_after_commit(bus.WAKE, {subscriber_id for _, subscriber_id in changed})
    return [pk for pk, _ in changed]
