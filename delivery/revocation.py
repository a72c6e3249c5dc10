"""Revocation: a change to a subscriber reaches its open sockets, in every process.

A subscriber saved (token rotated, deactivated, anything), deleted, or given or refused a
queue in its rights is announced after commit (delivery.wakeups.announce): each socket of it
looks at the row again, closes with 4401 if its token no longer holds, and ends the
subscriptions it may no longer have. Changes that bypass the signals (a queryset update) are
caught by each process's periodic check of its sockets' tokens (socket_loops.check_tokens).
"""

from django.db.models.signals import m2m_changed, post_delete, post_save

from subscribers.models import Subscriber

from . import wakeups


def _saved(sender, instance, created, raw=False, **kwargs):
    if not created and not raw:
        wakeups.announce_after_commit([instance.pk])


def _deleted(sender, instance, **kwargs):
    wakeups.announce_after_commit([instance.pk])  # still set here: it is unset after the signal


def _rights_changed(sender, instance, action, reverse, pk_set, **kwargs):
    if reverse:  # a queue's subscribers (or publishers) changed: pk_set names them
        if action == "pre_clear":
            subscribing = sender is Subscriber.subscribe_queues.through
            relation = instance.subscribers if subscribing else instance.publishers
            instance._mq_clearing = list(relation.values_list("pk", flat=True))
        elif action == "post_clear":
            wakeups.announce_after_commit(getattr(instance, "_mq_clearing", []))
        elif action in ("post_add", "post_remove"):
            wakeups.announce_after_commit(pk_set or [])
    elif action in ("post_add", "post_remove", "post_clear"):
        wakeups.announce_after_commit([instance.pk])


def connect_signals():
    post_save.connect(_saved, sender=Subscriber, dispatch_uid="mq-revocation-saved")
    post_delete.connect(_deleted, sender=Subscriber, dispatch_uid="mq-revocation-deleted")
    for through in (Subscriber.subscribe_queues.through, Subscriber.publish_queues.through):
        m2m_changed.connect(_rights_changed, sender=through, dispatch_uid=f"mq-revocation-{through.__name__}")
