"""Personas made outside pytest's fixtures (tests/conftest.py has the logger, the peer, the
outsider and the operator): for tests whose servers or sockets need a token of their own."""

from channels.db import database_sync_to_async

from delivery import subscribing
from queues.models import Queue
from subscribers.provisioning import create_subscriber


def subscribed_owner(ordered=False):
    """The `db` queue and `owner`, a service that may publish to and subscribe to it, subscribed
    to every event of it: (queue, owner, its token, its subscription). owner.token is its token,
    as tests.conftest.client_for wants it."""
    queue = Queue.objects.create(name="db", ordered=ordered)
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscription, _ = subscribing.subscribe(owner, queue)
    owner.token = token
    return queue, owner, token, subscription


asubscribed_owner = database_sync_to_async(subscribed_owner)
