"""The bus: the words that parts of the server say to each other, in this process and across
processes. A word is a kind and its ids; send(kind, ids) says it, on(kind, fn) hears it.

    wake     subscriber ids that may have work: lease now (delivery.wakeups)
    joined   a subscriber id that opened a socket in the sending process (delivery.wakeups)
    settled  message ids whose deliveries are all settled (delivery.receipts)
    changed  {"subscribers", "connections", "queues": ids}: look them up again
             (delivery.revocation); its sender waits until every process acted on it

A listener `fn(ids, source)` hears every word of its kind once, and `source` says how:

    SENT   this process sent it: at once, in the sender's thread or on its event loop
    HEARD  another process sent it (the services mode), on this process's listening loop
    ECHO   this process's own word, back from Redis (or the echo that will not come: its
           PUBLISH failed), for what must happen when the other processes hear it
    LOST   the listener (re)connected to Redis: words may have been lost meanwhile (ids empty)

A listener registered with `blocking=True` hears only this process's own words, after their
PUBLISH and off the event loop: it may query (the webhook jobs' enqueue).

Across processes, one Redis channel carries every kind, one JSON word per PUBLISH, heard by one
listening task per process (listen()); without Redis (the embedded mode) a word stays in its
process. A word is a hint: a lost one costs latency, never a message; every waiter also looks on
a timer. Why not the channel layer's groups: a group_send costs several Redis round trips per
subscriber, run through async_to_sync from the publisher's thread; one PUBLISH names every
subscriber of a commit (bench/PROFILE.md, section 8).

This module imports no app: any layer may send, and the apps register their listeners.
"""

import asyncio
import functools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import defaultdict

from django.conf import settings
from django.db import transaction

from mqsite import adb

log = logging.getLogger(__name__)

WAKE, JOINED, SETTLED, CHANGED = "wake", "joined", "settled", "changed"
SENT, HEARD, ECHO, LOST = "sent", "heard", "echo", "lost"
# Kinds whose sender waits for every process that heard the word to have acted on it.
_WAITED = frozenset({CHANGED})

# Tells this process's own words from the others', when Redis hands them back.
PROCESS = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
LISTEN_RETRY_SECS = 1.0

_listeners = defaultdict(list)  # kind -> [(fn, blocking)]


def on(kind, fn, *, blocking=False):
    """Call `fn(ids, source)` for every word of `kind` (see the module's docstring)."""
    if (fn, blocking) not in _listeners[kind]:
        _listeners[kind].append((fn, blocking))


def send(kind, ids):
    """Say a word: this process's listeners hear it at once; the other processes (a PUBLISH)
    and the blocking listeners after that, from a thread when there is one to use or when
    called on the event loop (both block, and nobody need wait for them). A `changed` word is
    published here, and returns once every process that heard it acted on it."""
    ids = ids if isinstance(ids, dict) else list(ids)
    if not ids:
        return
    _hear(kind, ids, SENT)
    if kind in _WAITED:
        _deliver([(kind, ids)])
    elif client() is not None or any(blocking for _, blocking in _listeners[kind]):
        _off_the_loop(kind, ids)


def send_after_commit(kind, ids):
    """send() once the current transaction commits (at once outside one)."""
    ids = ids if isinstance(ids, dict) else list(ids)
    if ids:
        transaction.on_commit(lambda: send(kind, ids))


def _hear(kind, ids, source):
    for fn, blocking in list(_listeners[kind]):
        if blocking:
            continue
        try:
            fn(ids, source)
        except Exception:
            log.exception("a %s listener %r failed", kind, fn)


# --- the sending thread ---------------------------------------------------------------------------

# In a server process the words' PUBLISH and blocking listeners go from one thread: a publish is
# answered after its commit and its own process's wake-ups, not after a Redis round trip and the
# webhook listener's query too (bench/PROFILE.md). Words that arrive while one batch is sent go
# together in the next. A word lost with the process costs latency, never a message.
_outbox = None
_tasks = set()  # a reference to each sending task, or it could be collected before it ran


def send_from_a_thread():
    """From now on, this process (a server) sends its words' PUBLISHes from a thread."""
    global _outbox
    if _outbox is None:
        _outbox = queue.SimpleQueue()
        threading.Thread(target=_send_forever, args=(_outbox,), name="bus words", daemon=True).start()


def _off_the_loop(kind, ids):
    if _outbox is not None:
        _outbox.put((kind, ids))
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a sync thread (a request, a Celery task): it may block
        _deliver([(kind, ids)])
        return
    task = asyncio.ensure_future(adb.thread(_deliver)([(kind, ids)]))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def _send_forever(outbox):
    from django.db import connection

    while True:
        words = [outbox.get()]
        while True:
            try:
                words.append(outbox.get_nowait())
            except queue.Empty:
                break
        connection.close_if_unusable_or_obsolete()  # a listener's query after a database restart
        try:
            _deliver(_merged(words))
        except Exception:
            log.exception("sending words failed")


def _merged(words):
    """One word per kind, its ids in the order they came."""
    by_kind = defaultdict(dict)
    for kind, ids in words:
        by_kind[kind].update(dict.fromkeys(ids))
    return [(kind, list(ids)) for kind, ids in by_kind.items()]


def _deliver(words):
    """PUBLISH each word, then hand it to the blocking listeners."""
    for kind, ids in words:
        _publish(kind, ids)
        for fn, blocking in list(_listeners[kind]):
            if not blocking:
                continue
            try:
                fn(ids, SENT)
            except Exception:  # e.g. the webhook jobs: the sweeper enqueues them a moment later
                log.warning("a %s listener %r failed for %s", kind, fn, ids, exc_info=True)


def _publish(kind, ids):
    redis = client()
    if redis is None:
        return
    word = {"from": PROCESS, "kind": kind, "ids": ids}
    try:
        if kind in _WAITED:
            word["acks"] = f"mq.acks.{uuid.uuid4().hex}"
            _wait_for_acks(redis, word["acks"], redis.publish(channel(), json.dumps(word)))
        else:
            redis.publish(channel(), json.dumps(word))
    except Exception:  # a hint: each waiter's own timer finds what it said a moment later
        log.warning("could not publish the %s word %s", kind, ids, exc_info=True)
        _hear(kind, ids, ECHO)  # the echo that will not come


def _wait_for_acks(redis, key, count):
    """Wait until `count` listeners (every process that heard a word, this one's too) have
    pushed to `key` that they acted on it, or until MQ_REVOCATION_CHECK_SECS pass: by then the
    rows a silent process kept have aged out anyway."""
    deadline = time.monotonic() + settings.MQ_REVOCATION_CHECK_SECS
    while count > 0:
        left = deadline - time.monotonic()
        if left <= 0 or redis.blpop([key], timeout=max(left, 0.01)) is None:
            log.warning("%s processes did not confirm a word in time", count)
            break
        count -= 1
    redis.delete(key)


# --- across processes (the services mode) ---------------------------------------------------------


@functools.cache
def client():
    """One Redis client for the process, or None without Redis (the embedded mode: one process)."""
    if not settings.REDIS_URL:
        return None
    import redis

    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)


def channel():
    """The PUBLISH channel. Pub/sub ignores Redis's database numbers, so the channel names the
    database: two deployments on one Redis (or the tests beside a server) do not hear each other."""
    return _channel_of(settings.REDIS_URL)


@functools.cache
def _channel_of(url):  # parsed once, not at every word
    from redis.connection import parse_url

    return f"mq.bus.{parse_url(url).get('db', 0)}"


_listener = None


def ensure_listening():
    """Run listen() on the running event loop, unless it runs there already (without Redis,
    nothing: one process hears itself). A server process starts it as soon as its loop runs
    (mqsite/asgi.py), so that its long polls and the rows it keeps hear the other processes
    even while it has no socket open; the sockets start it too (the tests' servers)."""
    global _listener
    if not settings.REDIS_URL:
        return
    loop = asyncio.get_running_loop()
    # A task of another event loop (closed: one per test) never runs again, though not done.
    if _listener is None or _listener.done() or _listener.get_loop() is not loop:
        _listener = asyncio.ensure_future(listen())


async def listen():
    """Hear the other processes' words (and this one's echoes), for as long as the process runs
    (one task per process: ensure_listening()). Reconnects after Redis goes away; what was said
    meanwhile is lost, and the listeners hear LOST on every (re)connect."""
    import redis.asyncio

    while True:
        # No read timeout: the subscription is quiet for as long as nothing is published.
        redis_client = redis.asyncio.Redis.from_url(
            settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=None, health_check_interval=30
        )
        try:
            async with redis_client.pubsub(ignore_subscribe_messages=True) as pubsub:
                await pubsub.subscribe(channel())
                for kind in list(_listeners):
                    _hear(kind, [], LOST)
                async for message in pubsub.listen():
                    word = json.loads(message["data"])
                    _hear(word["kind"], word["ids"], ECHO if word["from"] == PROCESS else HEARD)
                    if word.get("acks"):  # the sender waits for every listener's word
                        async with redis_client.pipeline(transaction=False) as pipe:
                            await pipe.rpush(word["acks"], 1).expire(word["acks"], 60).execute()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("lost the words of other processes; listening again", exc_info=True)
        finally:
            await redis_client.aclose()
        await asyncio.sleep(LISTEN_RETRY_SECS)
