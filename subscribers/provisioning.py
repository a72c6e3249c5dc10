"""Making subscribers: the one place a token is issued, a webhook secret rotated and permissions
are set."""

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from queues.lookup import system_queue
from queues.models import SYSTEM_QUEUE, Queue

from .models import Subscriber

ALL = "*"


class UnknownQueues(LookupError):
    pass


def _queues(names):
    names = {n.lower() for n in names if n != ALL}
    if SYSTEM_QUEUE in names:
        system_queue()  # made by the server on first use, a right to it included
    found = list(Queue.objects.filter(name__in=names))
    missing = names - {q.name for q in found}
    if missing:
        raise UnknownQueues(", ".join(sorted(missing)))
    return found


def create_subscriber(name, *, publish=(), subscribe=(), webhook_url=""):
    """Make a subscriber; `publish` and `subscribe` are queue names, `*` meaning every queue.

    Returns (subscriber, token): the token is shown this once and only its hash is kept.
    """
    subscriber, token, _, _ = provision_subscriber(
        name, publish=publish, subscribe=subscribe, webhook_url=webhook_url
    )
    return subscriber, token


def provision_subscriber(name, *, publish=(), subscribe=(), webhook_url="", update=False):
    """As create_subscriber; with `update`, a subscriber of that name is made as asked instead
    (its permissions and webhook URL those given, its webhook secret and subscriptions kept) and
    given a new token, the old one no longer working: only the hash is kept, so a token cannot
    be shown twice. Returns (subscriber, token, created, webhook secret): the secret only when
    it is new and has a webhook to sign for (so never shown before), else None; a subscriber
    that gets its first webhook URL gets a new secret then."""
    with transaction.atomic():
        subscriber = Subscriber.objects.select_for_update().filter(name=name).first() if update else None
        created = subscriber is None
        if created:
            subscriber = Subscriber(name=name)
        old_url, subscriber.webhook_url = subscriber.webhook_url, webhook_url
        new_secret = subscriber.secret_for_first_webhook(old_url, timezone.now())
        subscriber.publish_all = ALL in publish
        subscriber.subscribe_all = ALL in subscribe
        token = subscriber.issue_token()
        subscriber.full_clean()
        subscriber.save()
        subscriber.publish_queues.set(_queues(publish))
        subscriber.subscribe_queues.set(_queues(subscribe))
    return subscriber, token, created, new_secret


def rotate_webhook_secret(subscriber_id, grace_secs=None):
    """Give the subscriber a new webhook secret; the old one still signs posts for `grace_secs`
    (MQ_WEBHOOK_SECRET_GRACE_SECS by default). Returns (subscriber, new secret): the secret is
    shown this once. None when no such subscriber exists."""
    if grace_secs is None:
        grace_secs = settings.MQ_WEBHOOK_SECRET_GRACE_SECS
    with transaction.atomic():
        # Locked: two rotations at once must not both take the same "previous" secret.
        subscriber = Subscriber.objects.select_for_update().filter(pk=subscriber_id).first()
        if subscriber is None:
            return None, None
        secret = subscriber.rotate_webhook_secret(timezone.now(), grace_secs)
        subscriber.save(
            update_fields=[
                "webhook_secret",
                "previous_webhook_secret",
                "previous_webhook_secret_until",
                "webhook_secret_set_at",
            ]
        )
    return subscriber, secret
