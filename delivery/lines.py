"""The lines of ordered queues (message groups, API.md Extensions 2026-11-27).

In an ordered queue each delivery waits in a line: its subscription and its message's group
(`Delivery.grp`, "" for the default group; NULL in unordered queues, which have none). Order
holds within a line: at most one delivery of it in flight, handed out in seq order. The
delivery that may go next is marked: `Delivery.head`, the one open delivery of its line that
holds it (the one in flight, else the lowest-seq pending one). So the ordered lease is one
range scan of the partial index delivery_heads (a subscription's pending heads, in seq order),
whatever the number of lines and the backlog behind them (bench/group_lease.py).

Who keeps the mark (database triggers, migration 0015_message_group_lines; the SQL is frozen
there, as migrations are):

- a delivery inserted into a line (fan-out, a replay) is its head when the line has no open
  head (`delivery_line_join`, before insert on PostgreSQL, after on SQLite);
- a head that closes (acked, dead for any reason, deleted) hands the mark to the lowest-seq
  pending delivery of its line (`delivery_line_next`).

Triggers, because every path that closes a delivery (ack, nack, a failed post, expiry of a
lease or of a message, a closed socket, an operator's kill or skip, a delete) must promote,
including paths added later by others, and in the same statement: a trigger's queries take a
fresh snapshot after the row lock of the closing statement, which the lock below needs.

The race, and its lock. A publish that adds a message to a line decides "head or not" by
looking for an open head; an ack that closes the head looks for the next pending one. Run at
once, the publish may see the old head open (not yet committed as acked) and the ack may not
see the new message (not yet committed): the line would have no head, and be stuck. So:

- the insert trigger takes the *lines lock* of its queue exclusively (an advisory transaction
  lock, LINES_LOCK and the queue id) before it looks: publishes of a queue hold its row lock
  anyway, so this adds no wait between publishers;
- a closing head whose line has nothing pending (the only case the race can hurt: with a
  pending delivery behind it, that one is promoted and the new message waits behind it) takes
  the same lock shared, then looks again with a fresh snapshot.

Whichever comes second waits for the other's commit and sees it. Closers never wait for each
other (shared), and no one holding the lock waits for a delivery row lock a closer holds, so
the lock adds no deadlock (tests/delivery/test_line_race.py runs the race on PostgreSQL).
SQLite has one writer at a time and needs no lock.

Paths that reopen deliveries below a line's head (an operator's redelivery, a replay or seek)
call reseat() afterwards: under the lines lock (shared), with the open heads of those lines
locked, each line's head becomes the one in flight, else its lowest pending one.
"""

from django.db import connection, transaction
from django.db.models.signals import post_save, pre_save

from queues.models import Queue

from .models import Delivery
from .querysets import status_is
from .statuses import Status

# The first key of the lines lock (pg_advisory_xact_lock(LINES_LOCK, queue id)); the frozen
# trigger SQL of migration 0014 spells the same number.
LINES_LOCK = 2029


def lines_lock_sql(queue_id_sql, shared=True):
    """SQL taking the lines lock of the queue `queue_id_sql` (PostgreSQL), until commit."""
    kind = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    return f"{kind}({LINES_LOCK}, ({queue_id_sql} %% 2147483648)::integer)"


def reseat(subscription_ids, lines=None):
    """Make each line's head right again after deliveries were reopened or inserted below it:
    the one in flight, else the lowest-seq pending one. `subscription_ids`: their lines
    (all of them: a replay's end); `lines`: only these (subscription id, grp) pairs (an
    operator's redelivery). Inside the caller's transaction; returns nothing."""
    subscription_ids = sorted(set(subscription_ids))
    if not subscription_ids:
        return
    table = Delivery._meta.db_table
    of_subs = ", ".join(["%s"] * len(subscription_ids))
    where, params = f"d.subscription_id IN ({of_subs})", list(subscription_ids)
    if lines is not None:
        lines = sorted({(s, g) for s, g in lines if g is not None})
        if not lines:
            return
        where = " OR ".join(["(d.subscription_id = %s AND d.grp = %s)"] * len(lines))
        where, params = f"({where})", [v for pair in lines for v in pair]
    open_head = f"d.head AND d.status IN ('{Status.PENDING.value}', '{Status.INFLIGHT.value}')"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # No publish may insert into these lines meanwhile (it would look for a head as it
            # was), and a head closing meanwhile finishes first (its row locked here) or waits.
            cursor.execute(
                f"""SELECT {lines_lock_sql("q.queue_id")} FROM (
                        SELECT DISTINCT d.queue_id FROM {table} d WHERE {where}
                          AND d.grp IS NOT NULL AND d.status IN ('pending', 'inflight')) q""",
                params,
            )
            cursor.execute(f"SELECT d.id FROM {table} d WHERE {where} AND {open_head} FOR UPDATE", params)
        # Pending heads lose the mark; in-flight ones keep it (only one may be in flight).
        cursor.execute(
            f"UPDATE {table} SET head = %s WHERE id IN (SELECT d.id FROM {table} d WHERE {where}"
            f" AND d.head AND {status_is(Status.PENDING, 'd')})",
            [False, *params],
        )
        for status in (Status.INFLIGHT, Status.PENDING):
            # A line with none: its lowest open delivery of this status.
            cursor.execute(
                f"""
                UPDATE {table} SET head = %s WHERE id IN (
                    SELECT (SELECT p.id FROM {table} p
                            WHERE p.subscription_id = l.subscription_id AND p.grp = l.grp
                              AND {status_is(status, "p")}
                            ORDER BY p.seq LIMIT 1)
                    FROM (SELECT DISTINCT d.subscription_id, d.grp FROM {table} d
                          WHERE {where} AND d.grp IS NOT NULL AND {status_is(status, "d")}) l
                    WHERE NOT EXISTS (SELECT 1 FROM {table} d
                                      WHERE d.subscription_id = l.subscription_id AND d.grp = l.grp
                                        AND {open_head}))
                """,
                [True, *params],
            )


def connect_signals():
    """A queue saved with `ordered` changed (the admin, createqueue, any save) relines its
    backlog: reline_queue()."""
    pre_save.connect(_before_queue_saved, sender=Queue, dispatch_uid="mq-lines-queue-before")
    post_save.connect(_queue_saved, sender=Queue, dispatch_uid="mq-lines-queue-saved")


def _before_queue_saved(sender, instance, raw=False, update_fields=None, **kwargs):
    if instance.pk is None or raw or (update_fields is not None and "ordered" not in update_fields):
        return
    instance._mq_was_ordered = Queue.objects.filter(pk=instance.pk).values_list("ordered", flat=True).first()


def _queue_saved(sender, instance, created=False, raw=False, **kwargs):
    was = instance.__dict__.pop("_mq_was_ordered", None)
    if not created and was is not None and was != instance.ordered:
        reline_queue(instance.pk, instance.ordered)


def reline_queue(queue_id, ordered):
    """A queue became ordered, or stopped being: its open deliveries join their lines (grp from
    their message's group) and get their heads, or leave them. The admin and createqueue
    change `ordered` rarely; this reads the queue's open deliveries once. (Deliveries in flight
    when a queue becomes ordered finish as they are; the lowest of each line is its head.)"""
    table = Delivery._meta.db_table
    with transaction.atomic(), connection.cursor() as cursor:
        if ordered:
            cursor.execute(
                f"""UPDATE {table} SET grp = COALESCE(
                        (SELECT m.grp FROM queues_message m WHERE m.id = {table}.message_id), '')
                    WHERE queue_id = %s AND grp IS NULL AND status IN ('pending', 'inflight')""",
                [queue_id],
            )
            cursor.execute(
                f"SELECT DISTINCT subscription_id FROM {table} WHERE queue_id = %s AND grp IS NOT NULL"
                " AND status IN ('pending', 'inflight') AND subscription_id IS NOT NULL",
                [queue_id],
            )
            reseat([row[0] for row in cursor.fetchall()])
        else:
            cursor.execute(
                f"UPDATE {table} SET grp = NULL, head = %s WHERE queue_id = %s AND grp IS NOT NULL"
                " AND status IN ('pending', 'inflight')",
                [False, queue_id],
            )
