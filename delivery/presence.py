"""Presence: which subscribers have a websocket open now, and to what.

A Connection row lives as long as its socket. A server that dies cannot delete its rows, so
each open connection refreshes `last_seen` every HEARTBEAT_SECS and a sweep removes the stale
ones (Connection.is_stale: not refreshed for STALE_AFTER_SECS), handing back what they held.
"""

from django.db import connection, transaction
from django.utils import timezone

from mqsite import adb, limits, rows
from subscribers.models import HEARTBEAT_SECS as HEARTBEAT_SECS  # the sockets' heartbeat reads it here
from subscribers.models import Connection, Subscriber, Subscription

from . import ledger, liveness


def open_connection(subscriber, channel_name, remote_addr=""):
    """Record a subscriber's socket; mqsite.limits.LimitExceeded when it has as many open as
    MQ_MAX_CONNECTIONS_PER_SUBSCRIBER allows."""
    with transaction.atomic():
        lock_subscriber(subscriber)  # two connects at once must not both see the last free slot
        limits.check_connections(Connection.objects.filter(subscriber=subscriber).count())
        return Connection.objects.create(
            subscriber=subscriber, channel_name=channel_name, remote_addr=remote_addr
        )


def lock_subscriber(subscriber):
    """Hold the subscriber's row until commit, so that its counts (connections, subscriptions)
    are checked and grown one caller at a time. NO KEY UPDATE: rows that refer to it (its
    deliveries, messages it publishes) may still be written meanwhile. SQLite's write
    transactions are one at a time already."""
    Subscriber.objects.select_for_update(no_key=True).filter(pk=subscriber.pk).values_list("pk").first()


def close_connection(channel_name, spend=False, reason=ledger.CONNECTION_CLOSED, unsent=()):
    """The socket closed: what it held goes back to pending at once, and the row goes.
    `spend`: the client closed it, and the attempts it held count (ledger.release_held);
    but never those of `unsent`, leased ahead and never sent to it."""
    with transaction.atomic():
        if unsent:
            ledger.release_held([channel_name], reason=ledger.NOT_SENT, delivery_ids=unsent)
        close_connections([channel_name], spend=spend, reason=reason)


def close_connections(channel_names, spend=False, reason=ledger.CONNECTION_CLOSED):
    """close_connection() of many (an operator's, a sweep's): one release and one DELETE."""
    with transaction.atomic():
        ledger.release_held(channel_names, reason=reason, spend=spend)
        Connection.objects.filter(channel_name__in=channel_names).delete()


def heartbeat(channel_names):
    """Mark these connections (all the open sockets of one process) seen now, in one UPDATE.
    Returns those of them that have no row any more (an operator closed them): their sockets
    should close."""
    if not channel_names:
        return set()
    table = Connection._meta.db_table
    names = list(channel_names)
    of_names, params = adb.one_of("channel_name", names)
    with rows.writing(), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET last_seen = %s WHERE {of_names} RETURNING channel_name",
            [connection.ops.adapt_datetimefield_value(timezone.now()), *params],
        )
        seen = {row[0] for row in cursor.fetchall()}
    return set(names) - seen


def sweep_stale_connections(now=None):
    """Remove connections whose server stopped refreshing them; returns how many."""
    now = now or timezone.now()
    with transaction.atomic():
        stale = list(Connection.objects.stale(now).values_list("channel_name", flat=True))
        if stale:
            close_connections(stale)
    return len(stale)


def connections_now():
    """Who is connected now and to what: a connection receives every subscription of its
    subscriber (they resume by themselves), so those are its subscriptions."""
    rows = list(Connection.objects.select_related("subscriber").order_by("connected_at"))
    subs = {}
    for s in Subscription.objects.filter(subscriber_id__in={c.subscriber_id for c in rows}).select_related(
        "queue", "event"
    ):
        subs.setdefault(s.subscriber_id, []).append(
            {"queue": s.queue.name, "event": s.event.name if s.event_id else None}
        )
    return [
        {
            "subscriber": c.subscriber.name,
            "connected_at": c.connected_at,
            "last_seen": c.last_seen,
            "remote_addr": c.remote_addr,
            "subscriptions": subs.get(c.subscriber_id, []),
        }
        for c in rows
    ]


def held_elsewhere(subscriber_ids, process_name):
    """Which of these subscribers also have sockets open in server processes other than
    `process_name` (their sockets share a stream across processes: delivery.wakeups)."""
    prefix = liveness.holders_of(process_name)
    others = Connection.objects.filter(subscriber_id__in=subscriber_ids).exclude(
        channel_name__startswith=prefix
    )
    return set(others.values_list("subscriber_id", flat=True).distinct())
