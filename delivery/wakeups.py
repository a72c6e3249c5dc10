"""The waiters of wake-ups in this process: its websocket consumers (their asyncio.Event, one
socket of a subscriber at a time, in turns) and its long polls (a condition variable). A wake-up
is the bus's `wake` word (mqsite.bus): "subscriber N may have work", a hint to lease now. It
comes from this process's own commits (at once) and from the other processes' (through Redis, in
the services mode); for subscribers with a webhook and no socket it also starts a Celery job
(delivery.apps). A lost wake-up costs latency, never a message: every waiter also looks at the
ledger on a timer (the sweeper, for webhooks).
"""

import asyncio
import threading
import time
from collections import defaultdict

from mqsite import bus

_lock = threading.Condition()
_generation = defaultdict(int)  # subscriber id -> how many wake-ups it has had
_stopping = threading.Event()  # the server is shutting down: waiters stop waiting
# subscriber id -> its sockets in this process, in turn order: a wake-up goes to the first that
# has room, which then goes to the back of the line (competing consumers share round-robin)
_sockets = defaultdict(list)


def _heard(ids, source):
    """The bus's `wake` word. This process's own wakes its long polls and sockets at once,
    except the sockets of subscribers shared with other processes, which wake at its echo (when
    the others hear it too); another process's wakes them all."""
    if source == bus.SENT:
        wake_long_polls(ids)
        wake_sockets(ids if bus.client() is None else [i for i in ids if i not in _shared])
    elif source == bus.HEARD:
        wake_long_polls(ids)
        wake_sockets(ids)
    elif source == bus.ECHO:
        wake_sockets([i for i in ids if i in _shared])


# Subscribers whose sockets are spread over several server processes: learned when a socket
# opens (joined_elsewhere) and corrected by the recheck loop (delivery.socket_loops). Their
# wake-ups reach this process's sockets by the echo of its own PUBLISH, at the moment the other
# processes hear it: a direct wake-up would let this process's sockets lease first every time,
# and a worker on another process would starve.
_shared = frozenset()


def share_with_other_processes(subscriber_ids):
    global _shared
    _shared = frozenset(subscriber_ids)


def joined_elsewhere(subscriber_id):
    """A socket of the subscriber opened here, and it has sockets in other processes too:
    share its stream with them from now on, and tell them to (they may not know yet; if the
    word is lost, their recheck loop learns it within RECHECK_SECS)."""
    _share(subscriber_id)
    bus.send(bus.JOINED, [subscriber_id])


def _heard_joined(ids, source):
    """Another process opened a socket of these subscribers: if they have sockets here too,
    their stream is shared from now on."""
    if source == bus.HEARD:
        for subscriber_id in ids:
            if sockets_of(subscriber_id):
                _share(subscriber_id)


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
    """The socket that had the turn left work ready: the next one with room takes it. Of a
    subscriber shared with other processes, the next one in any of them: the turn goes out as a
    wake-up word, which this process's sockets hear at its echo, when the others hear it. Passed
    here directly, this process's socket took every turn again within a lease's round trip
    (a millisecond, once leases were prepared), before another process's socket woke at all:
    a burst went to one worker."""
    if subscriber_id in _shared and bus.client() is not None:
        bus.send(bus.WAKE, [subscriber_id])
    else:
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


def lease_when_woken(subscriber_id, lease, deadline, between_leases=lambda: None, recheck_secs=0.5):
    """The loop of a waiter without a socket (a long poll, the listen command): `lease()` until
    it gives something, time.monotonic() passes `deadline` or the server stops, waiting between
    tries for the subscriber's next wake-up (`between_leases()` first), or `recheck_secs` at most:
    a wake-up from another process, or a lost one, costs no more latency than that. Returns
    what the last lease gave. The wake-up count is read before each lease, so that one that
    comes while it runs is not missed."""
    while True:
        seen = generation(subscriber_id)
        leased = lease()
        left = deadline - time.monotonic()
        if leased or left <= 0 or stopping():
            return leased
        between_leases()
        wait(subscriber_id, seen, min(left, recheck_secs))


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


bus.on(bus.WAKE, _heard)
bus.on(bus.JOINED, _heard_joined)
