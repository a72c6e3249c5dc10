"""Wake-ups: "subscriber N may have work". They carry no message, only a hint to lease now.

Three kinds of waiter hear them: long-polling requests of this process (a condition
variable), websocket consumers of any process (the channel layer group `subscriber.<id>`) and,
for subscribers with a webhook and no socket, a Celery job (unless one is already queued or
running for the subscriber: see delivery.tasks). A lost wake-up costs latency, never a message:
every waiter also looks at the ledger on a timer (the sweeper, for webhooks).
"""

import asyncio
import logging
import threading
from collections import defaultdict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)

_lock = threading.Condition()
_generation = defaultdict(int)  # subscriber id -> how many wake-ups it has had
_stopping = threading.Event()  # the server is shutting down: waiters stop waiting
WAKE = {"type": "mq.wake"}


def group_name(subscriber_id):
    return f"subscriber.{subscriber_id}"


def notify(subscriber_ids):
    ids = list(subscriber_ids)
    if not ids:
        return
    with _lock:
        for sid in ids:
            _generation[sid] += 1
        _lock.notify_all()
    layer = get_channel_layer()
    if layer is not None:
        try:
            async_to_sync(_send_all)(layer, ids)
        except Exception:  # a wake-up is a hint: losing one costs latency, not a message
            log.warning("could not send wake-ups to %s", ids, exc_info=True)
    from .tasks import enqueue_webhooks  # here: tasks import the ledger, which imports us

    try:
        enqueue_webhooks(ids)
    except Exception:
        log.warning("could not enqueue webhook jobs for %s; the sweeper will", ids, exc_info=True)


async def _send_all(layer, ids):
    await asyncio.gather(*(layer.group_send(group_name(sid), WAKE) for sid in ids))


def notify_after_commit(subscriber_ids):
    """Wake the subscribers once the current transaction commits (at once outside one)."""
    ids = list(subscriber_ids)
    if ids:
        transaction.on_commit(lambda: notify(ids))


def generation(subscriber_id):
    with _lock:
        return _generation[subscriber_id]


def wait(subscriber_id, since, timeout):
    """Block until the subscriber's wake-up count passes `since`, `timeout` seconds pass or the
    server stops."""
    with _lock:
        return _lock.wait_for(
            lambda: _generation[subscriber_id] != since or _stopping.is_set(), timeout=timeout
        )


def stop_waiting():
    """The server is stopping: every long poll answers now instead of holding up its exit."""
    _stopping.set()
    with _lock:
        _lock.notify_all()


def stopping():
    return _stopping.is_set()
