"""Revocation: a change to a subscriber reaches its open sockets and its REST calls, in every
process.

A subscriber saved (token rotated, deactivated, anything), deleted, or given or refused a
queue in its rights is announced after commit (announce(): the bus's `changed` word): each socket of it
looks at the row again, closes with 4401 if its token no longer holds, and ends the
subscriptions it may no longer have. Changes that bypass the signals (a queryset update) are
caught by each process's periodic check of its sockets' tokens (socket_loops.check_tokens).

Every process keeps the subscribers (by token hash), queues (by name), event schemas
(queues.schemas) and publish grants its requests look up, and the subscribers its wake-ups
found without a webhook (mqsite.rows.Kept).
Any announcement makes it forget them all, and so does a change made in this process, at once
(before its commit: a test's transaction never commits); what no announcement told of is
forgotten by age (MQ_REVOCATION_CHECK_SECS).
"""

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save

from mqsite import bus
from queues import lookup, schemas
from queues.models import Event, Queue
from subscribers import auth
from subscribers.models import Subscriber, forget_publish_grants, forget_webhookless

from . import wakeups


def announce(subscriber_ids=(), channel_names=(), queue_ids=()):
    """Tell every process: these subscribers' token, activity or rights changed (or they are
    gone), these connections were closed by an operator, these queues changed. Their sockets
    look again and close, or end the subscriptions they may no longer have; the rows kept
    for requests are looked up again. This returns once each process that heard it has acted
    on it (mqsite.bus): from then on no process answers a request with what changed (a rotated
    token is refused by all of them). A lost word is caught by each process's own periodic
    check and by the kept rows' age (MQ_REVOCATION_CHECK_SECS), which is also the longest this
    waits for a process that does not answer."""
    change = {
        "subscribers": sorted(set(subscriber_ids)),
        "connections": sorted(set(channel_names)),
        "queues": sorted(set(queue_ids)),
    }
    if any(change.values()):
        bus.send(bus.CHANGED, change)


def announce_after_commit(subscriber_ids=(), channel_names=(), queue_ids=()):
    ids, names, queues = list(subscriber_ids), list(channel_names), list(queue_ids)
    if ids or names or queues:
        transaction.on_commit(lambda: announce(ids, names, queues))


def on_change(handler):
    """Call `handler(subscriber_ids, channel_names, queue_ids)` at every announcement, this
    process's own at once and the others' when heard, from any thread; and with nothing named
    when announcements may have been lost (the bus reconnected): the websocket consumers
    register one, this module another."""

    def heard(change, source):
        if source == bus.ECHO:  # this process acted before it announced
            return
        change = change or {}  # LOST
        handler(change.get("subscribers", []), change.get("connections", []), change.get("queues", []))

    bus.on(bus.CHANGED, heard)


def forget_kept_rows(subscriber_ids=(), *_announced):
    """An on_change() handler: whatever changed, the rows kept for requests go (changes
    are rare, lookups are not), and the long polls of the subscribers named wake up to ask
    their token again (delivery.long_polls): forgotten first, so that they look it up anew."""
    auth.forget_subscribers()
    lookup.forget_queues()
    schemas.forget()
    forget_publish_grants()
    forget_webhookless()
    wakeups.wake_long_polls(subscriber_ids)


def _announce(subscriber_ids=(), queue_ids=()):
    forget_kept_rows()
    announce_after_commit(subscriber_ids, queue_ids=queue_ids)


def _saved(sender, instance, created, raw=False, **kwargs):
    if not created and not raw:
        _announce([instance.pk])


def _deleted(sender, instance, **kwargs):
    _announce([instance.pk])  # still set here: it is unset after the signal


def _queue_changed(sender, instance, raw=False, **kwargs):
    # A new queue too: its name may be one a process still keeps from a queue deleted by a
    # path without signals.
    if not raw:
        _announce(queue_ids=[instance.pk])


def _event_saved(sender, instance, created, raw=False, **kwargs):
    # Only what may change a schema kept for publishes (queues.schemas): events made without
    # one (by a first publish or subscribe) change nothing kept, and are many.
    if not raw and (instance.schema is not None or not created):
        _announce(queue_ids=[instance.queue_id])


def _event_deleted(sender, instance, **kwargs):
    # One without a schema leaves a kept "none" true (a queue's delete cascades to many).
    if instance.schema is not None:
        _announce(queue_ids=[instance.queue_id])


def _rights_changed(sender, instance, action, reverse, pk_set, **kwargs):
    if reverse:  # a queue's subscribers (or publishers) changed: pk_set names them
        if action == "pre_clear":
            subscribing = sender is Subscriber.subscribe_queues.through
            relation = instance.subscribers if subscribing else instance.publishers
            instance._mq_clearing = list(relation.values_list("pk", flat=True))
        elif action == "post_clear":
            _announce(getattr(instance, "_mq_clearing", []))
        elif action in ("post_add", "post_remove"):
            _announce(pk_set or [])
    elif action in ("post_add", "post_remove", "post_clear"):
        _announce([instance.pk])


def connect_signals():
    post_save.connect(_saved, sender=Subscriber, dispatch_uid="mq-revocation-saved")
    post_delete.connect(_deleted, sender=Subscriber, dispatch_uid="mq-revocation-deleted")
    post_save.connect(_queue_changed, sender=Queue, dispatch_uid="mq-revocation-queue-saved")
    post_delete.connect(_queue_changed, sender=Queue, dispatch_uid="mq-revocation-queue-deleted")
    post_save.connect(_event_saved, sender=Event, dispatch_uid="mq-revocation-event-saved")
    post_delete.connect(_event_deleted, sender=Event, dispatch_uid="mq-revocation-event-deleted")
    on_change(forget_kept_rows)
    for through in (Subscriber.subscribe_queues.through, Subscriber.publish_queues.through):
        m2m_changed.connect(_rights_changed, sender=through, dispatch_uid=f"mq-revocation-{through.__name__}")
