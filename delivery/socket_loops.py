"""The loops every server process runs for its open sockets, beside the frames each socket
handles (delivery.consumers): one refreshes the heartbeat of every socket of the process (one
UPDATE), sweeps connections whose server died and expires overdue leases, so that nothing
waits on a socket that is gone even where no other sweeper runs (the embedded mode); one
wakes the sockets whose subscribers have work, in one query for all of them, in case a wake-up
was lost (an idle socket costs no query of its own), and finds the receipts its sockets wait
for that are settled (only while some are waited for, and only those the ledger logged as
moved since the last pass: delivery.receipts.recheck); one
checks the sockets' tokens and rights (the safety net of revocation); and, in the services
mode, one hears the other processes' wake-ups and announcements (mqsite.bus.listen)."""

import asyncio
import contextlib
import logging
import weakref
from collections import defaultdict

from channels.db import DatabaseSyncToAsync
from django.conf import settings

from delivery import presence
from mqsite import bus
from subscribers.models import Subscriber

from . import ledger, liveness, receipts, revocation, wakeups
from .frames import CLOSE_BY_OPERATOR

log = logging.getLogger(__name__)

# How often an idle connection looks at the ledger without a wake-up: the most a lost
# wake-up (or one from a process that could not reach Redis) can delay a delivery.
RECHECK_SECS = 2.0


def db(fn):
    """Run a database call off the event loop, in a pool thread (not channels' single shared
    thread: one slow call there would hold up every socket of the process)."""
    return DatabaseSyncToAsync(fn, thread_sensitive=False)


_maintenance = _recheck = _token_check = _loop = None
_open = weakref.WeakSet()  # the consumers of this process with a socket open


def opened(consumer):
    _open.add(consumer)
    ensure_running()


def closed(consumer):
    _open.discard(consumer)


def open_sockets():
    return len(_open)


async def release_open_sockets():
    """The server is stopping (delivery/stopping.py): every socket of this process hands back
    what it holds now, rather than at its ack deadline."""
    consumers = list(_open)
    for c in consumers:
        c.give_back = True  # the client is not at fault: its attempts are not spent
    await asyncio.gather(*(c.disconnect(None) for c in consumers), return_exceptions=True)


def ensure_running():
    """Start the loops of this process (once per event loop)."""
    global _maintenance, _recheck, _token_check, _loop
    _loop = asyncio.get_running_loop()
    if not _running(_token_check):
        _token_check = asyncio.ensure_future(_check_tokens())
    if not _running(_maintenance):
        _maintenance = asyncio.ensure_future(_maintain())
    if not _running(_recheck):
        _recheck = asyncio.ensure_future(_wake_those_with_work())
    bus.ensure_listening()


def _running(task):
    # A task of another event loop (closed: one per test) never runs again, though not done.
    return task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()


async def _maintain():
    while True:
        await asyncio.sleep(presence.HEARTBEAT_SECS)
        try:
            gone = await db(presence.heartbeat)([c.channel_name for c in list(_open)])
            # Their rows were deleted (an operator closed them, the announcement was lost).
            for c in [c for c in list(_open) if c.channel_name in gone]:
                asyncio.ensure_future(c.revoke(CLOSE_BY_OPERATOR, "closed by an operator"))
            await db(presence.sweep_stale_connections)()
            await db(ledger.expire_overdue_leases)()
        except Exception:
            log.exception("maintenance sweep failed; trying again in %s s", presence.HEARTBEAT_SECS)


async def _wake_those_with_work():
    """Also learns which subscribers have sockets in other processes too (wakeups.share_...)."""
    while True:
        await asyncio.sleep(RECHECK_SECS)
        consumers = [c for c in list(_open) if not c.closing]
        if not consumers:
            continue
        ids = {c.subscriber.pk for c in consumers}
        try:
            due = await db(ledger.subscribers_with_work)(ids)
            if settings.REDIS_URL:
                wakeups.share_with_other_processes(await db(presence.held_elsewhere)(ids, liveness.name()))
        except Exception:
            log.exception("looking for work failed; trying again in %s s", RECHECK_SECS)
            continue
        wakeups.wake_sockets(due)
        try:
            await receipts.recheck()  # the receipts' safety net, when any is waited for
        except Exception:
            log.exception("looking for settled receipts failed; trying again in %s s", RECHECK_SECS)


async def _check_tokens():
    """The safety net of revocation: every MQ_REVOCATION_CHECK_SECS, whatever Redis lost."""
    while True:
        await asyncio.sleep(settings.MQ_REVOCATION_CHECK_SECS)
        consumers = [c for c in list(_open) if not c.closing]
        if not consumers:
            continue
        try:
            await check_tokens(consumers)
        except Exception:
            log.exception("checking tokens failed; trying again in %s s", settings.MQ_REVOCATION_CHECK_SECS)


async def check_tokens(consumers):
    """Close the sockets whose subscriber is gone, inactive or has another token now, and make
    those whose rights changed look again (an announcement lost with Redis): two queries for
    all of them."""

    def current():
        ids = {c.subscriber.pk for c in consumers}
        granted = defaultdict(set)
        through = Subscriber.subscribe_queues.through.objects.filter(subscriber_id__in=ids)
        for subscriber_id, queue_id in through.values_list("subscriber_id", "queue_id"):
            granted[subscriber_id].add(queue_id)
        rows = Subscriber.objects.filter(pk__in=ids).values_list(
            "pk", "token_hash", "is_active", "subscribe_all", "publish_all"
        )
        return {
            pk: (token_hash, active, (subscribe_all, publish_all, frozenset(granted[pk])))
            for pk, token_hash, active, subscribe_all, publish_all in rows
        }

    now = await db(current)()
    for c in consumers:
        token_hash, active, rights = now.get(c.subscriber.pk, (None, False, None))
        if (token_hash, active) != (c.subscriber.token_hash, True):
            asyncio.ensure_future(c.revoke())
        elif c.rights != rights:
            if c.rights is not None:  # the first look only learns them
                c.look_again()
            c.rights = rights


def _changed(subscriber_ids, channel_names, queue_ids=()):
    """An announcement (delivery.revocation.announce), from any thread: the sockets it names
    look again, on their event loop."""
    loop = _loop
    if loop is None or loop.is_closed():
        return
    ids, names = set(subscriber_ids), set(channel_names)

    def look_again():
        for c in list(_open):
            if c.channel_name in names:
                asyncio.ensure_future(c.revoke(CLOSE_BY_OPERATOR, "closed by an operator"))
            elif c.subscriber.pk in ids:
                c.look_again()

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        look_again()
    else:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(look_again)


revocation.on_change(_changed)
