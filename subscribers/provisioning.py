"""Making subscribers: the one place a token is issued and permissions are set."""

from django.db import transaction

from queues.models import Queue

from .models import Subscriber

ALL = "*"


class UnknownQueues(LookupError):
    pass


def _queues(names):
    names = {n.lower() for n in names if n != ALL}
    found = list(Queue.objects.filter(name__in=names))
    missing = names - {q.name for q in found}
    if missing:
        raise UnknownQueues(", ".join(sorted(missing)))
    return found


def create_subscriber(name, *, publish=(), subscribe=(), webhook_url=""):
    """Make a subscriber; `publish` and `subscribe` are queue names, `*` meaning every queue.

    Returns (subscriber, token): the token is shown this once and only its hash is kept.
    """
    subscriber, token, _ = provision_subscriber(
        name, publish=publish, subscribe=subscribe, webhook_url=webhook_url
    )
    return subscriber, token


def provision_subscriber(name, *, publish=(), subscribe=(), webhook_url="", update=False):
    """As create_subscriber; with `update`, a subscriber of that name is made as asked instead
    (its permissions and webhook URL those given, its webhook secret and subscriptions kept) and
    given a new token, the old one no longer working: only the hash is kept, so a token cannot
    be shown twice. Returns (subscriber, token, created)."""
    with transaction.atomic():
        subscriber = Subscriber.objects.select_for_update().filter(name=name).first() if update else None
        created = subscriber is None
        if created:
            subscriber = Subscriber(name=name)
        subscriber.webhook_url = webhook_url
        subscriber.publish_all = ALL in publish
        subscriber.subscribe_all = ALL in subscribe
        token = subscriber.issue_token()
        subscriber.full_clean()
        subscriber.save()
        subscriber.publish_queues.set(_queues(publish))
        subscriber.subscribe_queues.set(_queues(subscribe))
    return subscriber, token, created
