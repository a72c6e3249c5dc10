"""Wake-ups: "subscriber N may have work". They carry no message, only a hint to lease now.
The same way carries announcements of revocation (announce(), below): "subscriber N changed".

Four kinds of waiter hear them: long-polling requests of this process (a condition variable),
websocket consumers of this process (their asyncio.Event, set directly), websocket consumers
and long polls of the other server processes (one Redis PUBLISH per commit, heard by one
listener per process, in the services mode) and, for subscribers with a webhook and no socket,
a Celery job (unless one is already queued or running for the subscriber: see delivery.tasks).
A lost wake-up costs latency, never a message: every waiter also looks at the ledger on a
timer (the sweeper, for webhooks).

Why not the channel layer's groups (`subscriber.<id>`), as the design sketch has it: a
group_send costs several Redis round trips per subscriber, run through async_to_sync from the
publisher's thread onto the event loop, and every socket kept a group membership to refresh.
That was most of a publish's cost once the publish itself was one statement (bench/PROFILE.md,
section 8). A PUBLISH names every subscriber of a commit in one round trip, and a process's
own sockets are woken without Redis at all.
"""

import asyncio
import functools
import json
import logging
import os
import threading
import uuid
from collections import defaultdict

from django.conf import settings
from django.db import transaction

from mqsite import adb

log = logging.getLogger(__name__)

_lock = threading.Condition()
_generation = defaultdict(int)  # subscriber id -> how many wake-ups it has had
_stopping = threading.Event()  # the server is shutting down: waiters stop waiting
_sockets = defaultdict(set)  # subscriber id -> {(event loop, asyncio.Event)} of this process
# Tells this process's own PUBLISHes from the others' (its sockets were woken directly).
_PROCESS = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
LISTEN_RETRY_SECS = 1.0


def notify(subscriber_ids):
    ids = list(subscriber_ids)
    if not ids:
        return
    _wake_here(ids)
    _tell_others(ids)


def notify_from_loop(subscriber_ids):
    """notify() after a commit made on the event loop (mqsite/adb.py): this process's sockets
    and long polls at once; the other processes (a Redis PUBLISH) and the webhook jobs (a
    query) from a thread, since both block, and nobody waits for them."""
    ids = list(subscriber_ids)
    if not ids:
        return
    _wake_here(ids)
    task = asyncio.ensure_future(adb.thread(_tell_others)(ids))
    _telling.add(task)  # a reference, or the task could be collected before it ran
    task.add_done_callback(_telling.discard)


_telling = set()


def _tell_others(ids):
    client = _redis()
    if client is not None:
        try:
            client.publish(channel(), f"{_PROCESS} {' '.join(map(str, ids))}")
        except Exception:  # a wake-up is a hint: losing one costs latency, not a message
            log.warning("could not publish wake-ups for %s", ids, exc_info=True)
    from .tasks import enqueue_webhooks  # here: tasks import the ledger, which imports us

    try:
        enqueue_webhooks(ids)
    except Exception:
        log.warning("could not enqueue webhook jobs for %s; the sweeper will", ids, exc_info=True)


def _wake_here(ids):
    """Wake this process's long polls and sockets of these subscribers."""
    with _lock:
        for sid in ids:
            _generation[sid] += 1
        _lock.notify_all()
        waiters = [w for sid in ids for w in _sockets.get(sid, ())]
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:  # a sync thread (a request, a Celery task)
        running = None
    for loop, event in waiters:
        if loop is running:
            event.set()
        else:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: its socket is gone
                pass


def notify_after_commit(subscriber_ids):
    """Wake the subscribers once the current transaction commits (at once outside one)."""
    ids = list(subscriber_ids)
    if ids:
        transaction.on_commit(lambda: notify(ids))


def watch(subscriber_id, event):
    """Set `event` (an asyncio.Event of the running loop) at every wake-up of the subscriber,
    until unwatch() with what this returns."""
    waiter = (asyncio.get_running_loop(), event)
    with _lock:
        _sockets[subscriber_id].add(waiter)
    return waiter


def unwatch(subscriber_id, waiter):
    with _lock:
        waiters = _sockets.get(subscriber_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del _sockets[subscriber_id]


# --- revocation: "subscriber N changed", "connection C was closed by an operator" ------------


_change_handlers = []  # called in this process with (subscriber ids, channel names)


def on_change(handler):
    """Call `handler(subscriber_ids, channel_names)` at every announcement, from any thread
    (the websocket consumers register one)."""
    _change_handlers.append(handler)


def announce(subscriber_ids=(), channel_names=()):
    """Tell every process: these subscribers' token, activity or rights changed (or they are
    gone), and these connections were closed by an operator. Their sockets look again and
    close, or end the subscriptions they may no longer have. Redis carries the word to the
    other processes; a lost word is caught by each process's own periodic check."""
    ids, names = sorted(set(subscriber_ids)), sorted(set(channel_names))
    if not ids and not names:
        return
    _changed_here(ids, names)
    client = _redis()
    if client is not None:
        try:
            word = json.dumps({"from": _PROCESS, "subscribers": ids, "connections": names})
            client.publish(changes_channel(), word)
        except Exception:  # the periodic check closes revoked sockets anyway, a moment later
            log.warning("could not announce changes of %s %s", ids, names, exc_info=True)


def announce_after_commit(subscriber_ids=(), channel_names=()):
    ids, names = list(subscriber_ids), list(channel_names)
    if ids or names:
        transaction.on_commit(lambda: announce(ids, names))


def _changed_here(ids, names):
    for handler in _change_handlers:
        try:
            handler(ids, names)
        except Exception:
            log.exception("a revocation handler failed")


# --- across processes (the services mode) ----------------------------------------------------


@functools.cache
def _redis():
    """One client for the process, or None without Redis (the embedded mode: one process)."""
    if not settings.REDIS_URL:
        return None
    import redis

    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)


def channel():
    """The PUBLISH channel. Pub/sub ignores Redis's database numbers, so the channel names the
    database: two deployments on one Redis (or the tests beside a server) do not wake each
    other's subscribers."""
    return _channel_of(settings.REDIS_URL)


def changes_channel():
    """Where announce() publishes: beside the wake-ups, heard by the same listener."""
    return _channel_of(settings.REDIS_URL).replace("mq.wake.", "mq.changes.", 1)


@functools.cache
def _channel_of(url):  # parsed once, not at every commit
    from redis.connection import parse_url

    return f"mq.wake.{parse_url(url).get('db', 0)}"


async def listen():
    """Hear the other processes' wake-ups, for as long as the process runs (one task per
    process; see consumers.ensure_maintenance). Reconnects after Redis goes away."""
    import redis.asyncio

    while True:
        # No read timeout: the subscription is quiet for as long as nothing is published.
        client = redis.asyncio.Redis.from_url(
            settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=None, health_check_interval=30
        )
        try:
            async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                await pubsub.subscribe(channel(), changes_channel())
                changes = changes_channel().encode()
                async for message in pubsub.listen():
                    if message["channel"] == changes:
                        word = json.loads(message["data"])
                        if word["from"] != _PROCESS:
                            _changed_here(word["subscribers"], word["connections"])
                        continue
                    sender, _, ids = message["data"].decode().partition(" ")
                    if sender != _PROCESS:
                        _wake_here([int(i) for i in ids.split()])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("lost the wake-ups of other processes; listening again", exc_info=True)
        finally:
            await client.aclose()
        await asyncio.sleep(LISTEN_RETRY_SECS)


# --- long polls ---------------------------------------------------------------------------------


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
