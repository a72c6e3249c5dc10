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
    with transaction.atomic():
        subscriber = Subscriber(
            name=name,
            webhook_url=webhook_url,
            publish_all=ALL in publish,
            subscribe_all=ALL in subscribe,
        )
        token = subscriber.issue_token()
        subscriber.full_clean()
        subscriber.save()
        subscriber.publish_queues.set(_queues(publish))
        subscriber.subscribe_queues.set(_queues(subscribe))
    return subscriber, token
