"""Liveness of server and worker processes: what a dead process held is ready again in seconds.

Every Daphne and Celery worker process beats from a thread of its own (a ServerProcess row,
`last_beat` every BEAT_SECS) and names itself in every lease it takes (`holder()`): a socket's
channel name, a pull, a webhook job. A process that stops beating for DEAD_AFTER_SECS was
killed (a clean stop removes its row first): any other live process, at its next beat, hands
back what it held, ready at once with the attempt given back (the client was not
at fault), removes its connections and drops its webhook jobs' claims (on_dead), so that
the wake-up of the handing back enqueues their next job at once. So an ordered
subscription whose head a killed process held moves on within DEAD_AFTER_SECS + BEAT_SECS (a
worker's: WORKER_DEAD_AFTER_SECS), not at its ack deadline (30 s by default).

A process that never beat (a test, a manage.py command) is never taken for dead: what it
holds waits for its ack deadline, as before. A live process wrongly taken for dead (its beat
thread starved for DEAD_AFTER_SECS) costs duplicates with the same delivery ids, never a loss.
"""

import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from subscribers.models import Connection, ServerProcess

log = logging.getLogger(__name__)

BEAT_SECS = 0.25
# A web process is taken for dead after this long without a beat: its holdings are ready again
# within about 3.5 s of its death (the contract's bound is 5 s). Its beat thread shares the
# process with an event loop that may serve thousands of sockets, and the sync pool with every
# request, so it is given time.
DEAD_AFTER_SECS = 3.0
# A Celery worker's (kind "worker"): its subscriptions are taken over within about a second of
# its death (issue 28). Its posts wait on the network in threads of their own, never in the
# beat's: a post held up to the webhook deadline does not make it look dead.
WORKER_DEAD_AFTER_SECS = 1.0

# What else a dead process held, beside its leases and connections: fn(holder prefix, ids of
# the subscribers whose deliveries it held), called as they are handed back, before the commit
# (delivery.apps registers the webhook jobs' claims: delivery.tasks imports this module).
_on_dead = []


def on_dead(fn):
    if fn not in _on_dead:
        _on_dead.append(fn)


_name = None
_pid = None
_stop = threading.Event()
_thread = None
# Since when this process's beats have been going through (monotonic), or None. After the
# database was away (a PostgreSQL restart) every process's last beat is old: a process judges
# others only once it has itself beaten for longer than DEAD_AFTER_SECS again, so that the
# first one back does not take all the others for dead.
_beating_since = None


def name():
    """This process's name: host, pid and a random part (a pid is reused after a restart)."""
    global _name, _pid
    if _pid != os.getpid():  # a forked child is a process of its own
        _pid = os.getpid()
        _name = f"{socket.gethostname()[:40]}-{_pid}-{uuid.uuid4().hex[:6]}"
    return _name


def holder(what):
    """The lease holder for `what` ("ws.<id>", "pull", "webhook.<id>") in this process."""
    return f"{name()}/{what}"


def holders_of(process_name):
    """The prefix every lease holder of that process starts with."""
    return f"{process_name}/"


def start(kind):
    """Beat for this process from now on, from a daemon thread (idempotent)."""
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    _stop.clear()
    _thread = threading.Thread(target=_beat_until_stopped, args=(kind,), name="liveness", daemon=True)
    _thread.start()


def stop():
    """A clean stop: no more beats, and the row goes, so that nothing this process still holds
    (a pull answered a moment ago) is taken back as if it had died."""
    _stop.set()
    if _thread is not None and _thread is not threading.current_thread():
        _thread.join(timeout=2 * BEAT_SECS)
    try:
        ServerProcess.objects.filter(name=name()).delete()
    except Exception:
        log.warning("could not remove this process's liveness row", exc_info=True)


def _beat_until_stopped(kind):
    global _beating_since
    while not _stop.is_set():
        try:
            beat(kind)
            _beating_since = _beating_since or time.monotonic()
            release_dead_if_beating()
        except Exception:
            _beating_since = None
            log.warning("liveness beat failed; trying again in %s s", BEAT_SECS, exc_info=True)
        finally:
            if connection.vendor != "sqlite":
                connection.close()  # back to the pool between beats
        _stop.wait(BEAT_SECS)


def beat(kind, now=None):
    now = now or timezone.now()
    me = name()
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                # A beat need not wait for the disk (lost in a crash, the next one comes a beat
                # later), and a slow flush must not make a live process look dead.
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        # Absent when this process was taken for dead (or never beat): it simply comes back.
        if not ServerProcess.objects.filter(name=me).update(last_beat=now):
            ServerProcess.objects.create(name=me, kind=kind, started_at=now, last_beat=now)


def release_dead_if_beating():
    """release_dead(), from a process whose own beats have gone through for long enough to
    judge the others (see _beating_since); nothing otherwise."""
    if _beating_since is None or time.monotonic() - _beating_since <= DEAD_AFTER_SECS + BEAT_SECS:
        return []
    return release_dead()


def release_dead(now=None):
    """Hand back what every process that stopped beating held; returns their names."""
    from . import ledger  # the ledger imports the models this module's callers import first

    now = now or timezone.now()
    dead = Q(last_beat__lt=now - timedelta(seconds=DEAD_AFTER_SECS)) | Q(
        kind="worker", last_beat__lt=now - timedelta(seconds=WORKER_DEAD_AFTER_SECS)
    )
    released = []
    for process in ServerProcess.objects.filter(dead).values_list("name", flat=True):
        with transaction.atomic():
            # Compare-and-set: of the processes that find it dead at once, one releases; and
            # one that beat again meanwhile is left alone.
            if not ServerProcess.objects.filter(dead, name=process).delete()[0]:
                continue
            prefix = holders_of(process)
            held = ledger.release_held_by_prefix(prefix, reason=f"its server process {process} stopped")
            Connection.objects.filter(channel_name__startswith=prefix).delete()
            # Before the commit, whose wake-up enqueues the next jobs of these subscribers.
            for forget in _on_dead:
                forget(prefix, {subscriber_id for _, subscriber_id in held})
        log.warning("process %s stopped beating; handed back %d deliveries it held", process, len(held))
        released.append(process)
    return released
