"""Wake-ups: "subscriber N may have work". They carry no message, only a hint to lease now.
The same way carries announcements of revocation (announce(), below): "subscriber N changed",
and of changed queues, so that every process forgets the rows it keeps (mqsite.rows.Cached).

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
import queue
import threading
import time
import uuid
from collections import defaultdict

from django.conf import settings
from django.db import transaction

from mqsite import adb

log = logging.getLogger(__name__)

_lock = threading.Condition()
_generation = defaultdict(int)  # subscriber id -> how many wake-ups it has had
_stopping = threading.Event()  # the server is shutting down: waiters stop waiting
# subscriber id -> its sockets in this process, in turn order: a wake-up goes to the first that
# has room, which then goes to the back of the line (competing consumers share round-robin)
_sockets = defaultdict(list)
_wake_listeners = []  # called with the subscriber ids of every wake-up (on_wake)
# Tells this process's own PUBLISHes from the others' (its sockets were woken directly).
_PROCESS = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
LISTEN_RETRY_SECS = 1.0


def notify(subscriber_ids):
    ids = list(subscriber_ids)
    if not ids:
        return
    _wake_here(ids, sockets=_not_shared(ids))
    if _hints is not None:
        _hints.put(ids)  # the word to the others goes from a thread of its own (below)
    else:
        _send_hints(ids)


def notify_from_loop(subscriber_ids):
    """notify() after a commit made on the event loop (mqsite/adb.py): this process's sockets
    and long polls at once; the other processes (a Redis PUBLISH) and the webhook jobs (a
    query) from a thread, since both block, and nobody waits for them."""
    ids = list(subscriber_ids)
    if not ids:
        return
    _wake_here(ids, sockets=_not_shared(ids))
    if _hints is not None:
        _hints.put(ids)
        return
    task = asyncio.ensure_future(adb.thread(_send_hints)(ids))
    _telling.add(task)  # a reference, or the task could be collected before it ran
    task.add_done_callback(_telling.discard)


_telling = set()


def _not_shared(ids):
    """Of these subscribers, those whose sockets here are woken at once (the others' by the
    echo of the PUBLISH, below)."""
    return ids if _redis() is None else [i for i in ids if i not in _shared]


def _send_hints(ids):
    """Tell the other processes (one PUBLISH) and the wake-up listeners (the webhook jobs)."""
    client = _redis()
    if client is not None:
        try:
            client.publish(channel(), f"{_PROCESS} {' '.join(map(str, ids))}")
        except Exception:  # a wake-up is a hint: losing one costs latency, not a message
            log.warning("could not publish wake-ups for %s", ids, exc_info=True)
            wake_sockets([i for i in ids if i in _shared])  # no echo will come
    for listener in _wake_listeners:
        try:
            listener(ids)
        except Exception:  # e.g. the webhook jobs: the sweeper enqueues them a moment later
            log.warning("wake-up listener %r failed for %s", listener, ids, exc_info=True)


# In a server process, what notify() need not wait for goes from one thread: a publish is
# answered after its commit and the wake-ups of its own process, not after a Redis round trip
# and the webhook listener's query too (bench/PROFILE.md). Hints that arrive while one batch is
# sent go together in the next. A hint lost with the process costs latency, never a message.
_hints = None


def send_hints_from_a_thread():
    """From now on, this process (a server) sends the hints of its commits from a thread."""
    global _hints
    if _hints is None:
        _hints = queue.SimpleQueue()
        threading.Thread(
            target=_send_hints_forever, args=(_hints,), name="wake-up hints", daemon=True
        ).start()


def _send_hints_forever(hints):
    from django.db import connection

    while True:
        ids = dict.fromkeys(hints.get())
        while True:
            try:
                ids.update(dict.fromkeys(hints.get_nowait()))
            except queue.Empty:
                break
        connection.close_if_unusable_or_obsolete()  # a listener's query after a database restart
        try:
            _send_hints(list(ids))
        except Exception:
            log.exception("sending wake-up hints failed")


def on_wake(listener):
    """Call `listener(subscriber_ids)` at every wake-up of this process's commits, after its
    own sockets and long polls were woken (delivery.apps registers the webhook jobs' enqueue:
    so this module imports nothing of the ledger's users)."""
    if listener not in _wake_listeners:
        _wake_listeners.append(listener)


def _wake_here(ids, sockets=None):
    """Wake this process's long polls of these subscribers, and one socket of each (of those
    in `sockets`, if given)."""
    wake_long_polls(ids)
    wake_sockets(ids if sockets is None else sockets)


# Subscribers whose sockets are spread over several server processes: learned when a socket
# opens (joined_elsewhere) and corrected by the recheck loop (delivery.socket_loops). Their
# wake-ups reach this process's sockets by the echo of its own PUBLISH, at the moment the other
# processes hear it: a direct wake-up would let this process's sockets lease first every time,
# and a worker on another process would starve.
_shared = frozenset()
JOINED = "+"  # a wake-up word "<process> +<id>": a socket of subscriber <id> opened there


def share_with_other_processes(subscriber_ids):
    global _shared
    _shared = frozenset(subscriber_ids)


def joined_elsewhere(subscriber_id):
    """A socket of the subscriber opened here, and it has sockets in other processes too:
    share its stream with them from now on, and tell them to (they may not know yet)."""
    _share(subscriber_id)
    client = _redis()
    if client is not None:
        try:
            client.publish(channel(), f"{_PROCESS} {JOINED}{subscriber_id}")
        except Exception:  # their recheck loop learns it within RECHECK_SECS
            log.warning("could not tell other processes of a socket of %s", subscriber_id, exc_info=True)


def _share(subscriber_id):
    global _shared
    _shared = _shared | {subscriber_id}


def shared_with_other_processes(subscriber_id):
    return subscriber_id in _shared


class _Socket:
    __slots__ = ("loop", "event", "has_room")

    def __init__(self, loop, event, has_room):
        self.loop, self.event, self.has_room = loop, event, has_room

    def wake(self, running):
        if self.loop is running:
            self.event.set()
        else:
            try:
                self.loop.call_soon_threadsafe(self.event.set)
            except RuntimeError:  # that loop is closed: its socket is gone
                pass


def wake_sockets(subscriber_ids):
    """For each subscriber, wake the next of its sockets in this process whose window has room
    (its turn), not all of them: the first to lease would take everything ready, and several
    workers of one subscriber would not share a stream. The socket woken passes the turn on
    when it leaves work behind (pass_turn); a full socket leases again when an ack frees room."""
    with _lock:
        chosen = [s for sid in subscriber_ids if (s := _take_turn(sid)) is not None]
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:  # a sync thread (a request, a Celery task)
        running = None
    for socket in chosen:
        socket.wake(running)


def pass_turn(subscriber_id):
    """The socket that had the turn left work ready: the next one with room takes it."""
    wake_sockets([subscriber_id])


def _take_turn(subscriber_id):
    line = _sockets.get(subscriber_id)
    for i, socket in enumerate(line or ()):
        if socket.has_room():
            line.append(line.pop(i))
            return socket
    return None


def sockets_of(subscriber_id):
    """How many sockets of the subscriber this process holds."""
    with _lock:
        return len(_sockets.get(subscriber_id, ()))


def notify_after_commit(subscriber_ids):
    """Wake the subscribers once the current transaction commits (at once outside one)."""
    ids = list(subscriber_ids)
    if ids:
        transaction.on_commit(lambda: notify(ids))


def watch(subscriber_id, event, has_room=lambda: True):
    """Set `event` (an asyncio.Event of the running loop) when it is this socket's turn at a
    wake-up of the subscriber (`has_room()`: whether its window could take a delivery, read
    from any thread), until unwatch() with what this returns."""
    socket = _Socket(asyncio.get_running_loop(), event, has_room)
    with _lock:
        _sockets[subscriber_id].append(socket)
    return socket


def unwatch(subscriber_id, socket):
    with _lock:
        line = _sockets.get(subscriber_id)
        if line is not None and socket in line:
            line.remove(socket)
            if not line:
                del _sockets[subscriber_id]


# --- receipts: "message M is settled" (delivery.receipts) ----------------------------------------

SETTLED = "!"  # a word "<process> !<message id> <message id> ...": every delivery of them settled
_settled_listeners = []  # called in this process with the message ids the others announce


def on_settled(listener):
    """Call `listener(message_ids)` when another process announces messages settled."""
    if listener not in _settled_listeners:
        _settled_listeners.append(listener)


def tell_settled(message_ids):
    """Tell the other processes these messages are settled (one PUBLISH; nothing without
    Redis, where the sockets' recheck finds them). From the event loop it goes from a thread."""
    if _redis() is None or not message_ids:
        return
    word = f"{_PROCESS} {SETTLED}{' '.join(map(str, message_ids))}"
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _publish_word(word)
        return
    task = asyncio.ensure_future(adb.thread(_publish_word)(word))
    _telling.add(task)
    task.add_done_callback(_telling.discard)


def _publish_word(word):
    try:
        _redis().publish(channel(), word)
    except Exception:  # a hint: the sockets' recheck finds what it said a moment later
        log.warning("could not publish %r", word, exc_info=True)


def _heard_settled(sender, word):
    if sender == _PROCESS:  # this process handed them to its sockets before it told
        return
    ids = [int(i) for i in word[len(SETTLED) :].split()]
    for listener in _settled_listeners:
        try:
            listener(ids)
        except Exception:
            log.exception("a receipt listener failed")


# --- revocation: "subscriber N changed", "connection C was closed by an operator" ------------


_change_handlers = []  # called in this process with (subscriber ids, channel names, queue ids)


def on_change(handler):
    """Call `handler(subscriber_ids, channel_names, queue_ids)` at every announcement, from any
    thread (the websocket consumers register one, delivery.revocation another)."""
    _change_handlers.append(handler)


def announce(subscriber_ids=(), channel_names=(), queue_ids=()):
    """Tell every process: these subscribers' token, activity or rights changed (or they are
    gone), these connections were closed by an operator, these queues changed. Their sockets
    look again and close, or end the subscriptions they may no longer have; the rows kept
    for requests are looked up again. Redis carries the word to the other processes, and this
    returns once each that heard it has acted on it: from then on no process answers a request
    with what changed (a rotated token is refused by all of them). A lost word is caught by each
    process's own periodic check and by the kept rows' age (MQ_REVOCATION_CHECK_SECS), which is
    also the longest this waits for a process that does not answer."""
    ids, names, queues = sorted(set(subscriber_ids)), sorted(set(channel_names)), sorted(set(queue_ids))
    if not ids and not names and not queues:
        return
    _changed_here(ids, names, queues)
    client = _redis()
    if client is not None:
        try:
            acks = f"mq.acks.{uuid.uuid4().hex}"
            word = {
                "from": _PROCESS,
                "subscribers": ids,
                "connections": names,
                "queues": queues,
                "acks": acks,
            }
            _wait_for_acks(client, acks, client.publish(changes_channel(), json.dumps(word)))
        except Exception:  # the periodic check closes revoked sockets anyway, a moment later
            log.warning("could not announce changes of %s %s %s", ids, names, queues, exc_info=True)


def _wait_for_acks(client, key, count):
    """Wait until `count` listeners (every process that heard a word, this one's too) have
    pushed to `key` that they acted on it, or until MQ_REVOCATION_CHECK_SECS pass: by then the
    rows a silent process kept have aged out anyway."""
    deadline = time.monotonic() + settings.MQ_REVOCATION_CHECK_SECS
    while count > 0:
        left = deadline - time.monotonic()
        if left <= 0 or client.blpop([key], timeout=max(left, 0.01)) is None:
            log.warning("%s processes did not confirm an announcement in time", count)
            break
        count -= 1
    client.delete(key)


def announce_after_commit(subscriber_ids=(), channel_names=(), queue_ids=()):
    ids, names, queues = list(subscriber_ids), list(channel_names), list(queue_ids)
    if ids or names or queues:
        transaction.on_commit(lambda: announce(ids, names, queues))


def _changed_here(ids, names, queues=()):
    for handler in _change_handlers:
        try:
            handler(ids, names, queues)
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
    """Hear the other processes' wake-ups and announcements, for as long as the process runs
    (one task per process: ensure_listening()). Reconnects after Redis goes away; what was
    announced meanwhile is lost, so the rows kept here are forgotten on every (re)connect."""
    import redis.asyncio

    while True:
        # No read timeout: the subscription is quiet for as long as nothing is published.
        client = redis.asyncio.Redis.from_url(
            settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=None, health_check_interval=30
        )
        try:
            async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                await pubsub.subscribe(channel(), changes_channel())
                _changed_here([], [], [])  # words may have been lost: the kept rows go
                changes = changes_channel().encode()
                async for message in pubsub.listen():
                    if message["channel"] == changes:
                        word = json.loads(message["data"])
                        if word["from"] != _PROCESS:  # this process acted before it announced
                            _changed_here(word["subscribers"], word["connections"], word.get("queues", ()))
                        if word.get("acks"):  # the announcer waits for every listener's word
                            async with client.pipeline(transaction=False) as pipe:
                                await pipe.rpush(word["acks"], 1).expire(word["acks"], 60).execute()
                        continue
                    sender, _, ids = message["data"].decode().partition(" ")
                    if ids.startswith(SETTLED):
                        _heard_settled(sender, ids)
                        continue
                    if ids.startswith(JOINED):
                        joined = int(ids[len(JOINED) :])
                        if sender != _PROCESS and sockets_of(joined):
                            _share(joined)
                        continue
                    ids = [int(i) for i in ids.split()]
                    if sender != _PROCESS:
                        _wake_here(ids)
                    else:  # our own: its long polls and other sockets were woken at the commit
                        wake_sockets([i for i in ids if i in _shared])
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


def wake_long_polls(subscriber_ids):
    """Wake this process's long polls of these subscribers only (not their sockets): an
    announcement that they changed, so that a poll of a revoked token ends now."""
    with _lock:
        for sid in subscriber_ids:
            _generation[sid] += 1
        _lock.notify_all()


def stop_waiting():
    """The server is stopping: every long poll answers now instead of holding up its exit."""
    _stopping.set()
    with _lock:
        _lock.notify_all()


def stopping():
    return _stopping.is_set()
