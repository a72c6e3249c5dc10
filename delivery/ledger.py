"""The delivery ledger: the one module that changes a delivery's state.

    pending --lease--> inflight --ack--> acked
       ^                  |
       +--nack / expiry---+--(attempt >= max_attempts)--> dead --redeliver--> pending

Every function here owns its transaction, works on sets of rows, and sends wake-ups only
after commit. Transports (REST views, the websocket consumer, Celery tasks, commands, the
admin) call these functions and nothing else to move a delivery.
"""

import contextlib
import contextvars
import functools
import json
import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import UTC, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from mqsite import adb, bus, limits, rows
from mqsite.service_errors import ServiceError
from mqsite.values import is_db_id
from queues.models import Event, Message, Queue
from subscribers.filters import filter_holds, filter_source
from subscribers.models import Subscriber, Subscription, may_subscribe_q, may_subscribe_sql

from . import lines, observe, operational, receipts, spans
from .bounds import MAX_EXTEND_SECS
from .frame_sql import message_frame_sql
from .models import Delivery, DeliveryAttempt, Status
from .querysets import (
    OPEN,
    expired_sql,
    is_ready,
    overdue_sql,
    ready_sql,
    status_is,
    unexpired_sql,
)

log = logging.getLogger(__name__)


@contextmanager
def _lease_durability():
    """On SQLite, commit a lease without waiting for fsync (synchronous=NORMAL in WAL mode).

    A lease is the one write that need not survive a power cut: lost, its delivery is simply
    pending again and handed out again (at least once holds). Publishes and acks keep FULL,
    and their fsync also makes every earlier WAL frame durable. SQLite allows the change only
    outside a transaction, so inside a caller's transaction this does nothing.
    """
    relax = connection.vendor == "sqlite" and not connection.in_atomic_block
    if relax:
        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA synchronous=NORMAL")
    try:
        with rows.writing():
            yield
    finally:
        if relax:
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA synchronous=FULL")


def _no_flush_wait(lead=", "):
    """PostgreSQL: a FROM item (after `lead`: ", " among others, "FROM " alone) that lets the
    statement's own transaction commit without waiting for its WAL to reach the disk
    (synchronous_commit off, for that transaction only).

    For leases and acks alone, as _lease_durability() does on SQLite: lost in a crash (the
    last few hundred milliseconds of commits), a lease leaves its delivery pending and an ack
    leaves it in flight until its deadline, so it is handed out again: at least once holds.
    A publish and a receipt still wait for the flush. The flush was most of a lease's and an
    ack's time (3 ms against 0.3 on this machine's disk: bench/README.md, W7). Only where the
    statement is its own transaction: inside a caller's, it would relax the caller's writes."""
    if connection.vendor != "postgresql" or (connection.in_atomic_block and not _relaxing.get()):
        return ""
    return f"{lead}(SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait"


# Set inside no_flush_wait(): that transaction may commit without the flush as a whole.
_relaxing = contextvars.ContextVar("relaxing", default=False)


@contextmanager
def no_flush_wait():
    """A transaction of acks and what goes with them (a webhook's attempt rows) that commits
    without waiting for the WAL flush, as _no_flush_wait() does for a statement alone (lost in
    a crash, they are redone: the delivery is handed out again)."""
    with transaction.atomic():
        token = _relaxing.set(True)  # the ack's own statement relaxes it: no round trip more
        try:
            yield
        finally:
            _relaxing.reset(token)


def backoff_secs(attempt):
    """Seconds to wait before retrying after failed attempt number `attempt` (1, 2, ...)."""
    exponent = max(attempt - 1, 0)
    # Cap the exponent before computing: 2 ** 10_000 is a huge int for nothing.
    return min(settings.MQ_BACKOFF_BASE_SECS * (2 ** min(exponent, 30)), settings.MQ_BACKOFF_MAX_SECS)


# --- dead or retry ------------------------------------------------------------------------------

# Why an attempt ended without an ack, as the delivery's last error says it: one text per cause,
# all here (operators read them in the admin and the dashboard; the README quotes them). A
# retried delivery keeps the cause's words; a dead one adds its count of attempts (died_of).
NACKED = "nacked by the client"
ACK_DEADLINE_PASSED = "ack deadline passed"
CONNECTION_CLOSED = "the connection holding it closed"
CLOSED_IN_FLIGHT = "connection closed while in flight"
NOT_SENT = "leased ahead for a socket and given back unsent"
# And an operator's or a seek's, which hand a delivery out again (or give up on it) at once.
REDELIVERED = "redelivered by an operator"
KILLED = "killed by an operator"
REPLAYED = "replayed by a seek"
# Its message's expiry passed (queues.timing) before an ack: pending, the sweep kills it
# (expire_overdue_leases); in flight, the end of its lease does (dead_or_retry). Exactly this
# text, which operators and the operational events read as the reason.
EXPIRED = operational.EXPIRED  # the last error of one, and delivery.dead's reason: one word


def retried_now_by(operator="an operator"):
    """The last error of a delivery an operator handed out again at once (retry_now)."""
    return f"retried now by {operator}"


def skipped_by(operator):
    """The last error of an ordered queue's head an operator gave up on (skip_deliveries)."""
    return f"skipped by {operator}"


def nack_reason(error):
    """The last error a nack leaves: the client's own words when it gave any."""
    return f"{NACKED}: {error}" if error else NACKED


def died_of(error):
    """The last error of a delivery that `error` ended at its last attempt, as the text before
    its count of attempts and the text after: "<error>; dead after 3 attempts", and for a
    connection that closed while holding it "connection closed while in flight, 3 times"."""
    if error == CLOSED_IN_FLIGHT:
        return f"{CLOSED_IN_FLIGHT}, ", " times"
    return f"{error}; dead after ", " attempts"


# What every move out of flight sets: a delivery that is not in flight holds no lease (no
# deadline, no holder). The SQL, and the same as an ORM update's fields.
UNLEASED_SQL = "ack_deadline = NULL, lease_holder = ''"
UNLEASED = {"ack_deadline": None, "lease_holder": ""}


def dead_or_retry(
    retried, died, next_at, next_params, dead_at="next_attempt_at", dead_at_params=(), now=None
):
    """The one rule for an attempt that ended without an ack, as the SET clauses (and their
    parameters) of an UPDATE of the delivery table: dead if it was its queue's last attempt,
    with the last error `died` (died_of) around its count; else pending again from `next_at`
    (SQL and `next_params`) with the last error `retried`. The lease goes either way. Used by
    nacks, failed pushes, expired leases and closed connections. `dead_at`: what a dead one's
    next_attempt_at becomes (dead letters are listed by it, newest first); unchanged by default.
    `now` (adapted for the database): also dead, with the reason EXPIRED, if its expiry has
    passed by then (a lease that ends unacked after its message expired goes no further).

    Every expression reads the row as it was before the UPDATE (SQL's rule), so the CASEs agree."""
    last = _AT_LAST_ATTEMPT()
    dead, dead_params, expired_case, expired_params = last, [], "", []
    if now is not None:
        expired = expired_sql(Delivery._meta.db_table)
        dead, dead_params = f"({last} OR {expired})", [now]
        expired_case, expired_params = f"WHEN {expired} THEN %s ", [now, EXPIRED]
    before, after = died
    return (
        f"""status = CASE WHEN {dead} THEN %s ELSE %s END,
            next_attempt_at = CASE WHEN {dead} THEN {dead_at} ELSE {next_at} END,
            last_error = CASE {expired_case}WHEN {last} THEN %s || CAST(attempt AS TEXT) || %s ELSE %s END,
            {UNLEASED_SQL}""",
        [
            *dead_params,
            Status.DEAD,
            Status.PENDING,
            *dead_params,
            *dead_at_params,
            *next_params,
            *expired_params,
            before,
            after,
            retried,
        ],
    )


@functools.cache
def _AT_LAST_ATTEMPT():  # noqa: N802 (a constant, made once the models are loaded)
    """SQL, in an UPDATE of the delivery table: this delivery had its queue's last attempt."""
    table = Delivery._meta.db_table
    return f"attempt >= (SELECT q.max_attempts FROM {Queue._meta.db_table} q WHERE q.id = {table}.queue_id)"


def _backoff_steps():
    """[(attempt, seconds)] of the backoff's growing steps, and the seconds of every attempt
    after them: at most 31 steps (it stops growing at its cap, or at 2 ** 30)."""
    steps = []
    for attempt in range(1, 32):
        if backoff_secs(attempt) == backoff_secs(31):
            break
        steps.append((attempt, backoff_secs(attempt)))
    return steps, backoff_secs(31)


def _backoff_case(now):
    """SQL for `now + backoff_secs(attempt)`, and its parameters: one CASE on the attempt."""
    at = connection.ops.adapt_datetimefield_value
    steps, rest = _backoff_steps()
    whens = [f"WHEN attempt <= {attempt} THEN %s" for attempt, _ in steps]
    params = [at(now + timedelta(seconds=secs)) for _, secs in steps]
    return f"CASE {' '.join(whens)} ELSE %s END", [*params, at(now + timedelta(seconds=rest))]


def _backoff_after(column):
    """SQL for `<column> + backoff_secs(attempt)` (a datetime column of the row; no parameter):
    one CASE on the attempt, in whole microseconds as timedelta(seconds=...) rounds them."""
    steps, rest = _backoff_steps()
    micros = [(attempt, round(secs * 1_000_000)) for attempt, secs in steps]
    whens = " ".join(f"WHEN attempt <= {attempt} THEN {us}" for attempt, us in micros)
    case = f"(CASE {whens} ELSE {round(rest * 1_000_000)} END)"
    if connection.vendor == "postgresql":
        return f"{column} + {case} * INTERVAL '1 microsecond'"
    # Django's own SQLite function for datetime arithmetic: the text it gives is the text the
    # ORM writes (str() of a naive datetime), so comparisons with it stay right.
    return f"django_format_dtdelta('+', {column}, {case})"


# --- fan-out ----------------------------------------------------------------------------------


def fan_out(queue_id, first_seq, last_seq, now, receipt=False, ordered=False):
    """Insert one pending delivery per (message, matching subscription) for a range of seqs.

    One INSERT ... SELECT for the whole range, called inside the publisher's transaction.
    Returns ({message_id: deliveries made}, {subscriber ids owed something}), from the
    INSERT's own RETURNING: no second query. `receipt`: some of the messages want a receipt.
    `ordered`: the queue is (its deliveries join their lines, delivery.lines).
    """
    sql, params = fan_out_statement(
        "queues_message m",
        "m.queue_id = %s AND m.seq BETWEEN %s AND %s",
        now,
        receipt,
        where_params=[queue_id, first_seq, last_seq],
        timed=True,
        ordered=ordered,
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return fanned_out(cursor.fetchall())


def fan_out_statement(
    messages, where, now, receipt=False, seats=None, where_params=(), timed=False, ordered=False
):
    """The fan-out INSERT for the messages `messages` names as `m` (a table or a CTE with id,
    queue_id, event_id, seq, payload_json, headers_json, receipt_wanted when `receipt`,
    deliver_at and expires_at when `timed`) where `where` (with `where_params`) holds, and all
    its parameters. With `receipt` (some message wants a receipt), each delivery copies its
    message's receipt_wanted; without, the column keeps its default and the statement is the
    one every other publish sends. Likewise `timed` (some message is delayed or expires:
    owed_insert).

    A subscription matches a message when it is for the message's queue and for its event or
    all events and is not being unsubscribed (unsubscribe()), its filter (if any) holds for
    the message (subscribers.filters: evaluated here, in SQL, from the clauses stored as
    data, so the statement's text is the same whatever filters exist), and its subscriber is
    active and may still subscribe to the queue (revocation: a subscription stays, but is owed
    nothing while its right is gone). Deliveries are numbered in seq order, as the messages
    are. It returns (message id, subscriber id) per delivery made.

    `seats` (PostgreSQL; delivery.inline): the sockets of this process that take deliveries
    as they are made, as (the SQL of a FROM item `q` with the queue's ordered, paused and
    ack_timeout, its parameters, [subscriber id], [holder], [room]). Then it returns, after
    those two, each delivery's id, lease holder ('' when pending), ack deadline, attempt and
    subscription (_fan_out_seated).

    `ordered`: the queue is ordered, and `m` has its message's `grp`: each delivery joins the
    line of its subscription and group (delivery.lines; a trigger marks the head). Unordered,
    the statement is the one it always was."""
    if seats is not None:
        return _fan_out_seated(messages, where, now, receipt, seats, where_params, timed, ordered)
    insert, params = owed_insert("s.id, s.subscriber_id", [], now, receipt, timed=timed, ordered=ordered)
    # The messages through filter_source(): what the filters read, parsed once per message.
    sql = f"""
        {insert}
        FROM {filter_source(messages, where)}
        {_OWED_JOIN()}
        ORDER BY m.seq, s.id
        RETURNING message_id, subscriber_id
    """
    return sql, [*params, *where_params, True, True]


def owed_clauses():
    """The fan-out's rule, clause by clause: {name: SQL over subscription `s`, its subscriber
    `r` and message `m` (of subscribers.filters.filter_source)}, each with at most one
    parameter, True. _OWED_JOIN() joins them all; the route (delivery.routing) selects each,
    to say which one fails: one spelling of who is owed a message."""
    return {
        "event": "(s.event_id IS NULL OR s.event_id = m.event_id)",
        "staying": "NOT s.leaving",
        "filter": filter_holds("s", "m"),
        "active": "r.is_active = %s",
        "right": may_subscribe_sql("r", "s"),
    }


@functools.cache
def _OWED_JOIN():  # noqa: N802 (a constant, made once the models are loaded)
    """SQL (two parameters, both True): the subscriptions `s` owed message `m`, of subscribers
    `r` (fan_out_statement says which)."""
    owed = owed_clauses()
    return f"""JOIN {Subscription._meta.db_table} s
          ON s.queue_id = m.queue_id AND {owed["event"]} AND {owed["staying"]} AND {owed["filter"]}
        JOIN {Subscriber._meta.db_table} r ON r.id = s.subscriber_id AND {_may_subscribe()}"""


def _fan_out_seated(messages, where, now, receipt, seats, where_params, timed=False, ordered=False):
    """fan_out_statement() with `seats`: a delivery whose subscriber has a seat is made already
    in flight to the seat's holder, as a lease leaves it (attempt 1, the queue's ack deadline),
    when a lease would take it now and the seat has room: its queue is unordered (an ordered
    queue's line is the lease's alone: _lease_head_statement), _may_lease() holds, its message
    is not delayed (a lease would not take it before its deliver_at), and it is within the
    seat's room, counted in seq order. The others are made pending, as always."""
    queue, queue_params, subscriber_ids, holders, rooms = seats
    may_lease, lease_params = _may_lease()
    at = connection.ops.adapt_datetimefield_value(now)
    seated = ("m.seated", "m.holder", _deadline("m"))
    insert, params = owed_insert(
        "m.subscription_id, m.subscriber_id", [], now, receipt, seated=seated, timed=timed, ordered=ordered
    )
    grp = ", m.grp" if ordered else ""
    sql = f"""
        {insert}
        FROM (
            SELECT m.id, m.queue_id, m.event_id, m.seq{", m.receipt_wanted" if receipt else ""}{grp}
                   {", m.deliver_at, m.expires_at" if timed else ""},
                   s.id AS subscription_id, s.subscriber_id, t.holder, q.ack_timeout,
                   t.holder IS NOT NULL AND q.ordered = %s AND {may_lease}
                   {"AND m.deliver_at IS NULL" if timed else ""}
                   AND row_number() OVER (PARTITION BY s.subscriber_id ORDER BY m.seq, s.id) <= t.room
                   AS seated
            FROM {filter_source(messages, where)}
            CROSS JOIN {queue}
            {_OWED_JOIN()}
            LEFT JOIN unnest(%s::bigint[], %s::text[], %s::int[]) AS t (subscriber_id, holder, room)
              ON t.subscriber_id = s.subscriber_id
        ) m
        ORDER BY m.seq, m.subscription_id
        RETURNING message_id, subscriber_id, id, lease_holder, ack_deadline, attempt, subscription_id
    """
    return sql, [
        *params,
        at,
        at,
        False,
        *lease_params,
        *where_params,
        *queue_params,
        True,
        True,
        subscriber_ids,
        holders,
        rooms,
    ]


def owed_insert(owner, owner_params, now, receipt=False, seated=None, timed=False, ordered=False):
    """The deliveries' INSERT ... SELECT up to its FROM (and its parameters), for fan-out and
    replay alike: one pending delivery, ready at `now`, per row of the SELECT's message `m`.
    `owner`: the SQL of its subscription's and its subscriber's ids (with `owner_params`).
    `receipt`: copy the message's receipt_wanted (the column keeps its default otherwise).
    `timed`: `m` has deliver_at and expires_at: a delayed message's deliveries are ready at its
    deliver_at instead (the wait is no attempt: their attempt stays 0), and each copies its
    message's expiry. Without, the statement is the one every other publish sends.
    `seated`: (SQL of whether the row is taken at once, of its holder, of its ack deadline with
    one parameter, `now`): such a row is made in flight, as _leased_set() leaves a lease (the
    caller appends `now` twice to the parameters, for the deadline and delivered_at).
    `ordered`: each row joins its line, its message's group ("" for none; delivery.lines)."""
    # Raw SQL: adapt the time as the ORM does, or SQLite would compare two spellings of it.
    at = connection.ops.adapt_datetimefield_value(now)
    column, value = (", receipt", ", m.receipt_wanted") if receipt else ("", "")
    ready_at = "%s"
    if timed:
        column, value, ready_at = (
            f"{column}, expires_at",
            f"{value}, m.expires_at",
            "COALESCE(m.deliver_at, %s)",
        )
    if ordered:
        column, value = f"{column}, grp", f"{value}, COALESCE(m.grp, '')"
    if seated is None:
        state, lease, lease_columns = "%s, 0", "''", ""
        params = [Status.PENDING]
    else:
        taken, holder, deadline = seated
        state = f"CASE WHEN {taken} THEN %s ELSE %s END, CASE WHEN {taken} THEN 1 ELSE 0 END"
        lease = f"CASE WHEN {taken} THEN {holder} ELSE '' END"
        lease_columns = f", CASE WHEN {taken} THEN {deadline} END, CASE WHEN {taken} THEN %s::timestamptz END"
        params = [Status.INFLIGHT, Status.PENDING]
    sql = f"""INSERT INTO {Delivery._meta.db_table}
            (subscription_id, subscriber_id, message_id, queue_id, event_id, seq, status,
             attempt, next_attempt_at, created_at, lease_holder, last_error{column}
             {", ack_deadline, delivered_at" if seated else ""})
        SELECT {owner}, m.id, m.queue_id, m.event_id, m.seq, {state}, {ready_at}, %s, {lease}, ''{value}
             {lease_columns}"""
    return sql, [*owner_params, *params, at, at]


@functools.cache
def _may_subscribe():
    """SQL: the subscriber `r` of subscription `s` is active and may subscribe to its queue
    (two parameters, both True): a primary-key row and may_subscribe_sql. (A function: the
    rights table is known once apps load.)"""
    owed = owed_clauses()
    return f"{owed['active']} AND {owed['right']}"


def fanned_out(rows):
    """({message_id: deliveries made}, {subscriber ids owed something}) from the fan-out's rows."""
    counts = defaultdict(int)
    for message_id, _ in rows:
        counts[message_id] += 1
    return counts, {subscriber_id for _, subscriber_id in rows}


# --- lease --------------------------------------------------------------------------------------


def lease_deliveries(
    subscriber, *, limit, queue=None, event_ids=None, holder="", now=None, framed=False, found=None
):
    """Hand out up to `limit` ready deliveries of the subscriber, oldest seq first.

    Each is marked in flight until now + its queue's ack timeout, its attempt counted. Overdue
    leases of the same subscriptions are expired first, so they are ready again (after their
    backoff). An ordered queue's subscription hands out only its head, and nothing while a
    delivery of it is in flight or waiting for its retry: per line (message group,
    delivery.lines) where its messages name groups. Returns dicts ready for the API, or
    with `framed` (a socket's lease) on PostgreSQL, each as _framed() describes it. (`found`:
    see alease_deliveries; here it stays empty.)
    """
    now = now or timezone.now()
    if limit <= 0:
        return []
    subs = _leasable(adb.run_sync(_subscriptions(subscriber, queue, event_ids, now)))
    if not subs:
        return []
    overdue, ordered, unordered = _plan(subs)
    # The common cases, nothing overdue and one subscription or one group of unordered ones,
    # are a single statement: they need no transaction of their own (two more round trips,
    # BEGIN and COMMIT). On SQLite an ordered head takes several (_lease_head).
    alone = not overdue and len(ordered) + len(unordered) == 1 and (not ordered or _heads_in_one())
    leased = []
    with _lease_durability(), contextlib.nullcontext() if alone else transaction.atomic():
        if overdue:
            _expire_overdue(now, overdue)
        for sub in ordered:
            if len(leased) < limit:
                leased += _lease_head(subscriber.pk, sub, event_ids, limit - len(leased), holder, now, framed)
        for ack_timeout, ids in unordered.items():
            if len(leased) >= limit:
                break
            leased += _lease_ready(ids, event_ids, limit - len(leased), ack_timeout, holder, now, framed)
    leased.sort(key=lambda d: (d["seq"], d["id"]))
    return leased


@adb.twin(lease_deliveries)
async def alease_deliveries(
    subscriber, *, limit, queue=None, event_ids=None, holder="", now=None, framed=False, found=None
):
    """lease_deliveries() from the event loop, on the async connection: the read, then one
    statement per ordered subscription (its head) and per group of unordered ones, each its
    own transaction (a lease of one is independent of the others'). Only an expiry, which
    must come first and be seen by the leases, takes a thread, where the sync lease reads again
    and does it all in its transaction. `found`, a list: given an Again when the read found one
    unordered subscription to lease from and nothing overdue (alease_again)."""
    now = now or timezone.now()
    if limit <= 0:
        return []
    async with adb.connect() as conn:
        subs = _leasable(await adb.run(_subscriptions(subscriber, queue, event_ids, now), conn))
        if not subs:
            return []
        overdue, ordered, unordered = _plan(subs)
        if found is not None and not overdue and not ordered and len(subs) == 1 and queue is None:
            found.append(Again(subs[0]["id"], subs[0]["queue__ack_timeout"], event_ids))
        if not overdue:
            leased = []
            for sub in ordered:
                if len(leased) < limit:
                    room = limit - len(leased)
                    leased += await adb.run(
                        _lease_head_statement(subscriber.pk, sub["id"], event_ids, holder, now, framed, room),
                        conn,
                    )
            for ack_timeout, ids in unordered.items():
                if len(leased) >= limit:
                    break
                leased += await adb.run(
                    _lease_ready_statement(
                        ids, event_ids, limit - len(leased), ack_timeout, holder, now, framed
                    ),
                    conn,
                )
            leased.sort(key=lambda d: (d["seq"], d["id"]))
            return leased
    return await adb.thread(lease_deliveries)(
        subscriber, limit=limit, queue=queue, event_ids=event_ids, holder=holder, now=now, framed=framed
    )


class Again(NamedTuple):
    """What a socket's lease read (alease_deliveries' `found`): its subscriber's one unordered
    subscription with something ready, nothing overdue."""

    subscription_id: int
    ack_timeout: int
    event_ids: object


def lease_again(subscriber, again, *, limit, holder="", now=None):
    """Where the async connection is off (SQLite): the whole lease_deliveries()."""
    return lease_deliveries(
        subscriber, limit=limit, event_ids=again.event_ids, holder=holder, now=now, framed=True
    )


@adb.twin(lease_again)
async def alease_again(subscriber, again, *, limit, holder="", now=None):
    """A socket's next lease from the subscription its last one read (`again`, an Again), with
    no read first: one round trip a lease rather than two while it catches up. The statement
    itself checks what the read would have (the subscription its subscriber's, _may_lease(),
    its subscriber active and allowed); what it does not do, expire overdue leases and find
    other subscriptions, the caller's next full lease does (a socket goes back to one at once
    when a lease gets less than it asked, and every consumers.AGAIN_SECS)."""
    now = now or timezone.now()
    if limit <= 0:
        return []
    leased = await adb.run(
        _lease_ready_statement(
            [again.subscription_id],
            again.event_ids,
            limit,
            again.ack_timeout,
            holder,
            now,
            framed=True,
            checked_for=subscriber.pk,
        )
    )
    leased.sort(key=lambda d: d["seq"])  # as RETURNING has them, in no order
    return leased


def _leasable(subs):
    """Only the subscriptions with something ready or overdue: an idle poller's lease is the
    one read, and takes no write lock (on SQLite, the whole database's)."""
    return [s for s in subs if s["ready"] or s["overdue"]]


def _plan(subs):
    """(subscription ids with a lease overdue, ordered subscriptions, {ack timeout: ids of the
    unordered subscriptions})."""
    overdue = [s["id"] for s in subs if s["overdue"]]
    ordered = [s for s in subs if s["queue__ordered"]]
    unordered = defaultdict(list)
    for sub in subs:
        if not sub["queue__ordered"]:
            unordered[sub["queue__ack_timeout"]].append(sub["id"])
    return overdue, ordered, unordered


def _of_subscriptions(sub_ids, event_ids):
    """The WHERE clause (and its parameters) for deliveries of these subscriptions, of these
    events when `event_ids` is not None."""
    of_subscriptions, params = adb.one_of("subscription_id", sub_ids)
    of_events, event_params = _of_events("event_id", event_ids)
    return f"{of_subscriptions}{of_events}", [*params, *event_params]


def _of_events(column, event_ids):
    """(" AND <column> is one of them", its parameters) for these events; nothing when None."""
    if event_ids is None:
        return "", []
    event_ids = list(event_ids)
    if not event_ids:
        return " AND 1 = 0", []
    of_events, params = adb.one_of(column, event_ids)
    return f" AND {of_events}", params


def _subscriptions(subscriber, queue, event_ids, now):
    """The subscriber's subscriptions that may lease (_may_lease: neither paused nor their queue,
    not in the middle of a replay or an unsubscribe) (to `queue` only, if given), and that it
    is still active and allowed to subscribe to, each with its queue's
    settings and whether it has a delivery ready and a lease overdue (of `event_ids`, if
    given): one read, EXISTS stopping at the first row."""
    at = connection.ops.adapt_datetimefield_value(now)
    of_events, event_params = _of_events("d.event_id", event_ids)
    deliveries = f"SELECT 1 FROM {Delivery._meta.db_table} d WHERE d.subscription_id = s.id{of_events}"
    of_queue = "AND s.queue_id = %s" if queue is not None else ""
    may_lease, lease_params = _may_lease()
    found = yield (
        f"""
            SELECT s.id, q.ordered, q.ack_timeout,
                   EXISTS ({deliveries} AND {ready_sql("d")}),
                   EXISTS ({deliveries} AND {overdue_sql("d")})
            FROM {Subscription._meta.db_table} s JOIN {Queue._meta.db_table} q ON q.id = s.queue_id
            JOIN {Subscriber._meta.db_table} r ON r.id = s.subscriber_id AND {_may_subscribe()}
            WHERE s.subscriber_id = %s AND {may_lease} {of_queue}
            """,
        [
            *event_params,
            at,
            at,
            *event_params,
            at,
            True,
            True,
            subscriber.pk,
            *lease_params,
            *([queue.pk] if queue is not None else []),
        ],
    )
    return [
        {
            "id": id_,
            "queue__ordered": bool(ordered),
            "queue__ack_timeout": ack_timeout,
            "ready": bool(ready),
            "overdue": bool(overdue),
        }
        for id_, ordered, ack_timeout, ready, overdue in found
    ]


def _may_lease():
    """SQL (and its parameters): subscription `s` of queue `q` may be leased from: neither the
    queue nor the subscription is paused (subscribing.pause: still owed, handed out nothing),
    and no replay or unsubscribe of it is under way (begin_replay(), unsubscribe(): its history
    is not all owed yet). With the subscriber's rights (_may_subscribe()), what every lease
    checks: _subscriptions() before a lease, _lease_head_statement() in one, alease_again()'s
    statement with no read first, and a publish that hands its deliveries to sockets as it
    makes them (_fan_out_seated())."""
    return "q.paused = %s AND s.paused = %s AND s.busy_since IS NULL", [False, False]


def may_lease_q():
    """The pause part of _may_lease() as a Q over Delivery rows, for the ORM's "anything due?"
    reads that decide whether to lease at all (the webhook job's, the sweep's): neither the
    delivery's queue nor its subscription paused, so that paused work wakes no job. (The
    lease itself checks the whole rule.)"""
    return Q(queue__paused=False, subscription__paused=False)


def _deadline(q="q"):
    """SQL (one parameter, `now`): a lease's ack deadline, now + its queue `q`'s ack timeout."""
    return f"%s + make_interval(secs => {q}.ack_timeout)"


def _lease_ready(sub_ids, event_ids, limit, ack_timeout, holder, now, framed=False):
    leased = adb.run_sync(_lease_ready_statement(sub_ids, event_ids, limit, ack_timeout, holder, now, framed))
    return leased if connection.vendor == "postgresql" else _describe(leased)


def _lease_ready_statement(
    sub_ids, event_ids, limit, ack_timeout, holder, now, framed=False, checked_for=None
):
    """Lease the oldest ready deliveries of these subscriptions (one statement) and describe
    them. SKIP LOCKED: two leasers running at once each take rows the other has not locked, so
    no delivery is handed to both (PostgreSQL; SQLite serialises writers with BEGIN IMMEDIATE).
    `checked_for` (a subscriber id; PostgreSQL): the statement checks what _subscriptions()
    would have, for a lease with no read first (alease_again)."""
    table = Delivery._meta.db_table
    where, where_params = _of_subscriptions(sub_ids, event_ids)
    # A subscription is of one queue, where seq is unique: ordered by seq alone, delivery_lease
    # (subscription, status, seq) yields its rows in order and the LIMIT stops the scan. With
    # "seq, id" PostgreSQL read and sorted every pending row of the backlog on each lease.
    order = "seq" if len(sub_ids) == 1 else "seq, id"
    pick = f"SELECT id FROM {table} p WHERE {where} AND {ready_sql('p')} ORDER BY {order} LIMIT %s"
    set_, set_params = _leased_set(ack_timeout, holder, now)
    at = connection.ops.adapt_datetimefield_value(now)
    params = [*set_params, *where_params, at, at, limit]
    if connection.vendor != "postgresql":  # the ids, that _lease_ready() describes
        leased = yield f"UPDATE {table} SET {set_} WHERE id IN ({pick}) RETURNING id", params
        return [row[0] for row in leased]
    # PostgreSQL returns the message with the lease: one round trip where the ORM took four
    # (lock, update, then read back with the joins), bench/PROFILE.md.
    checks, check_params = "", []
    if checked_for is not None:
        may_lease, lease_params = _may_lease()
        checks = f"""
              AND s.id = d.subscription_id AND s.subscriber_id = %s
              AND r.id = s.subscriber_id AND {_may_subscribe()} AND {may_lease} AND q.ordered = %s"""
        check_params = [checked_for, True, True, *lease_params, False]
    joined = (
        f", {Subscription._meta.db_table} s, {Subscriber._meta.db_table} r" if checked_for is not None else ""
    )
    leased = yield (
        f"""
            UPDATE {table} d SET {set_}
            FROM {Message._meta.db_table} m, {Queue._meta.db_table} q,
                 {Event._meta.db_table} e{joined}{_no_flush_wait()}
            WHERE d.id IN ({pick} FOR UPDATE SKIP LOCKED)
              AND m.id = d.message_id AND q.id = d.queue_id AND e.id = d.event_id{checks}
            RETURNING {_FRAMED if framed else _DESCRIBED}
            """,
        [*params, *check_params],
    )
    return [(_framed if framed else _delivery)(*row) for row in leased]


def _leased_set(ack_timeout, holder, now):
    """The SET of a lease (and its parameters): in flight to `holder` until now + `ack_timeout`
    seconds, its attempt counted."""
    at = connection.ops.adapt_datetimefield_value
    return (
        "status = %s, attempt = attempt + 1, ack_deadline = %s, delivered_at = %s, lease_holder = %s",
        [Status.INFLIGHT, at(now + timedelta(seconds=ack_timeout)), at(now), holder],
    )


def _mark_leased(ids, ack_timeout, holder, now):
    set_, params = _leased_set(ack_timeout, holder, now)
    of_ids, id_params = adb.one_of("id", ids)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {Delivery._meta.db_table} SET {set_} WHERE {of_ids}", [*params, *id_params])
    return list(ids)


def _heads_in_one():
    """Whether an ordered head is leased in one statement (_lease_head_statement): on
    PostgreSQL. SQLite locks the subscription row and reads the head first."""
    return connection.vendor == "postgresql"


def _lease_head(subscriber_id, sub, event_ids, limit, holder, now, framed=False):
    """Lease up to `limit` heads of an ordered subscription's lines that are ready (described,
    as the API gives them)."""
    if _heads_in_one():
        return adb.run_sync(
            _lease_head_statement(subscriber_id, sub["id"], event_ids, holder, now, framed, limit)
        )
    # SQLite (one writer at a time): the heads, then their lease, in the caller's transaction.
    table = Delivery._meta.db_table
    pick, params = _heads_pick(sub["id"], [], event_ids, now, limit)
    set_, set_params = _leased_set(sub["queue__ack_timeout"], holder, now)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {set_} WHERE id IN ({pick}) RETURNING id", [*set_params, *params])
        return _describe([row[0] for row in cursor.fetchall()])


def _heads_pick(sub_sql, sub_params, event_ids, now, limit):
    """SQL (and its parameters) of the ids of up to `limit` ready heads of the subscription
    `sub_sql` (an id placeholder or a subquery), oldest first: one range scan of delivery_heads
    (a subscription's pending heads by seq, one per line, delivery.lines). A head waiting for
    its retry, a delayed one and an expired one are passed over, and hold their lines: nothing
    behind them is a head (ready_sql)."""
    table = Delivery._meta.db_table
    if isinstance(sub_sql, int):
        sub_sql, sub_params = "%s", [sub_sql]
    of_events, event_params = _of_events("h.event_id", event_ids)
    return (
        f"""SELECT h.id FROM {table} h
            WHERE h.subscription_id = ({sub_sql}) AND h.head AND {ready_sql("h")}{of_events}
            ORDER BY h.seq LIMIT %s""",
        [*sub_params, *[connection.ops.adapt_datetimefield_value(now)] * 2, *event_params, limit],
    )


def _lease_head_statement(subscriber_id, subscription, event_ids, holder, now, framed=False, limit=1):
    """PostgreSQL: lease up to `limit` ready heads of an ordered subscription's lines in one
    statement, and describe them. `subscription` is its id, or the SQL of a subquery giving it,
    as (sql, params).

    A line's head (delivery.lines) is its one open delivery that may be in flight: leasing
    heads only, a lease hands out at most one delivery per line, in seq order within it, and
    the heads of different lines at once, the oldest first. A head that is not ready holds its
    line: a delayed one, one waiting for its retry, and an expired one until the sweep makes it
    dead (within a second; the trigger then makes the next of its line the head). Also checked:
    the subscription may lease at all (_may_lease(): no replay under way, neither it nor its
    queue paused), its subscriber active and allowed (the checks of _subscriptions(), so that
    after an ack the heads need no read first). This is what an ordered queue's speed turns on:
    one round trip, one range scan of delivery_heads, whatever the number of lines and the
    backlog behind them (bench/group_lease.py).

    SKIP LOCKED: two leasers at once take different heads, never one twice; a head locked by
    another (a leaser, an operator's reseat) waits for the next lease."""
    table = Delivery._meta.db_table
    sub_sql, sub_params = ("%s", [subscription]) if isinstance(subscription, int) else subscription
    pick, pick_params = _heads_pick(sub_sql, sub_params, event_ids, now, limit)
    at = connection.ops.adapt_datetimefield_value
    may_lease, lease_params = _may_lease()
    leased = yield (
        f"""
        UPDATE {table} d
        SET status = %s, attempt = d.attempt + 1, delivered_at = %s, lease_holder = %s,
            ack_deadline = {_deadline()}
        FROM {Message._meta.db_table} m, {Queue._meta.db_table} q, {Event._meta.db_table} e,
             {Subscription._meta.db_table} s, {Subscriber._meta.db_table} r{_no_flush_wait()}
        WHERE d.id IN ({pick} FOR UPDATE SKIP LOCKED)
          AND s.id = d.subscription_id AND s.subscriber_id = %s
          AND r.id = s.subscriber_id AND {_may_subscribe()}
          AND q.id = d.queue_id AND {may_lease} AND q.ordered = %s
          AND m.id = d.message_id AND e.id = d.event_id
        RETURNING {_FRAMED if framed else _DESCRIBED}
        """,
        [
            Status.INFLIGHT,
            at(now),
            holder,
            at(now),
            *pick_params,
            subscriber_id,
            True,
            True,
            *lease_params,
            True,
        ],
    )
    return [(_framed if framed else _delivery)(*row) for row in leased]


def lease_heads_after(subscriber, acked_ids, *, limit, holder="", now=None, framed=False):
    """After acks of ordered deliveries (committed): the next heads of their subscriptions'
    lines (an ack of a head made the next of its line the head), as alease_heads_after()
    does, one statement each on PostgreSQL (a webhook job's ordered line: a round trip per
    message, where the whole lease's read and head statement took two). SQLite, which
    leases heads in several statements, leases what is ready of the subscriber: the whole
    lease_deliveries()."""
    if not _heads_in_one():
        return lease_deliveries(subscriber, limit=limit, holder=holder, now=now, framed=framed)
    now = now or timezone.now()
    leased = []
    for acked in acked_ids:
        if len(leased) >= limit:
            break
        head = _lease_head_statement(
            subscriber.pk, _of_acked(acked), None, holder, now, framed, limit - len(leased)
        )
        leased += adb.run_sync(head)
    return leased


@adb.twin(lease_heads_after)
async def alease_heads_after(subscriber, acked_ids, *, limit, holder="", now=None, framed=False):
    """The next heads of the ordered subscriptions of `acked_ids` (deliveries just acked,
    committed), one statement each and no read first: a prompt consumer of an ordered queue
    waits for its next message one round trip after its ack, not three. Whatever else may be
    ready was leased when the window last had room; a wake-up leases anything new."""
    now = now or timezone.now()
    leased = []
    async with adb.connect() as conn:
        for acked in acked_ids:
            if len(leased) >= limit:
                break
            head = _lease_head_statement(
                subscriber.pk, _of_acked(acked), None, holder, now, framed, limit - len(leased)
            )
            leased += await adb.run(head, conn)
    return leased


def _of_acked(delivery_id):
    """The subscription of that delivery, as the SQL of a subquery (_lease_head_statement)."""
    return f"SELECT subscription_id FROM {Delivery._meta.db_table} WHERE id = %s", [delivery_id]


# What a lease returns of each delivery: what _delivery() makes of it, or (a socket's lease,
# `framed`) what _framed() does, the frame written by PostgreSQL.
_DESCRIBED = """d.id, d.message_id, q.name, e.name, d.seq, m.payload_json, d.attempt,
                m.created_at, d.ack_deadline, m.headers_json, m.deliver_at, d.expires_at, m.grp"""
_FRAMED = f"d.id, q.name, e.name, d.seq, d.ack_deadline, {message_frame_sql()}"


def _framed(id, queue, event, seq, ack_deadline, frame):
    """A delivery leased for a socket: what the socket keeps of it, and its `message` frame
    as text (frames.message_text), its payload never decoded."""
    return {
        "id": id,
        "queue": queue,
        "event": event,
        "seq": seq,
        "ack_deadline": ack_deadline,
        "frame": frame,
    }


def _describe(ids):
    if not ids:
        return []
    rows = (
        Delivery.objects.filter(id__in=ids)
        .order_by("seq", "id")
        .values_list(
            "id",
            "message_id",
            "queue__name",
            "event__name",
            "seq",
            "message__payload_json",
            "attempt",
            "message__created_at",
            "ack_deadline",
            "message__headers_json",
            "message__deliver_at",
            "expires_at",
            "message__group",
        )
    )
    return [_delivery(*row) for row in rows]


def _delivery(
    id,
    message_id,
    queue,
    event,
    seq,
    payload_json,
    attempt,
    published_at,
    ack_deadline,
    headers_json=None,
    deliver_at=None,
    expires_at=None,
    group=None,
):
    """A leased delivery as the API gives it: with `headers` only when its message has some
    (queues.headers), so that clients that send none see exactly what they saw before; with
    `deliver_at` and `expires_at` always (null when none: queues.timing), and its message's
    `group` (None when none)."""
    delivery = {
        "id": id,
        "message_id": message_id,
        "queue": queue,
        "event": event,
        "seq": seq,
        "payload": json.loads(payload_json),
        "attempt": attempt,
        "published_at": published_at,
        "ack_deadline": ack_deadline,
        "deliver_at": deliver_at,
        "expires_at": expires_at,
        "group": group,
    }
    if headers_json:
        delivery["headers"] = json.loads(headers_json)
    return delivery


# A delivery as the API gives it, from its columns (a publish that seats it builds it so).
describe_row = _delivery


def subscribers_with_work(subscriber_ids, now=None):
    """Which of these subscribers have a delivery ready or a lease overdue: one query for all
    the open sockets of a process (EXISTS stops at the first row of each). Only of active
    subscribers and of queues they may still subscribe to: what a revoked right left owed
    wakes nobody."""
    now = now or timezone.now()
    owed = Delivery.objects.filter(subscriber=OuterRef("pk")).filter(may_subscribe_q())
    return set(
        Subscriber.objects.filter(pk__in=subscriber_ids, is_active=True)
        .filter(Exists(owed.ready(now)) | Exists(owed.overdue(now)))
        .values_list("pk", flat=True)
    )


# --- ack and nack -------------------------------------------------------------------------------


@spans.acked("rest")
def ack_deliveries(subscriber, ids, now=None):
    """Acknowledge the subscriber's deliveries among `ids`.

    Returns (newly acked count, ids that are not the subscriber's or do not exist). Acking
    twice is harmless; a late ack of a delivery that was expired or dead still counts, since
    the client did get it.
    """
    with rows.writing():
        acked, unknown, receipt_messages = adb.run_sync(_ack(subscriber.pk, ids, now or timezone.now()))
    receipts.check_after_commit(receipt_messages)
    return acked, unknown


@spans.aacked("socket")
@adb.twin(ack_deliveries)
async def aack_deliveries(subscriber, ids, now=None):
    """ack_deliveries() from the event loop: the same statements on the async connection."""
    acked, unknown, receipt_messages = await adb.run(_ack(subscriber.pk, ids, now or timezone.now()))
    await receipts.acheck(receipt_messages)  # committed: the statement was its own transaction
    return acked, unknown


class Posted(NamedTuple):
    """How one webhook post of a leased delivery went, as its attempt row keeps it."""

    delivery_id: int
    attempt: int
    ok: bool
    status_code: int | None
    error: str
    duration_ms: int
    permanent: bool


@spans.settled
def settle_posts(subscriber, posted, now=None):
    """After a webhook job's posts (Posted): their attempt rows, and the acks of those that
    succeeded, committed together without waiting for the WAL flush (lost in a crash, the
    posts are made again: at least once). On PostgreSQL one statement: the attempts
    are a data-modifying WITH of the ack (three round trips less than a transaction of an
    INSERT and the ack). Returns the number newly acked."""
    now = now or timezone.now()
    ok = [p.delivery_id for p in posted if p.ok]
    if connection.vendor != "postgresql":
        with no_flush_wait():
            DeliveryAttempt.objects.bulk_create(
                DeliveryAttempt(
                    delivery_id=p.delivery_id,
                    number=p.attempt,
                    at=now,
                    ok=p.ok,
                    status_code=p.status_code,
                    error=p.error,
                    duration_ms=p.duration_ms,
                    permanent=p.permanent,
                )
                for p in posted
            )
            return ack_deliveries(subscriber, ok, now)[0] if ok else 0
    tried = _attempts_insert(posted, now)
    if not ok:
        adb.run_sync(_once(*tried))
        return 0
    acked, _, receipt_messages = adb.run_sync(_ack(subscriber.pk, ok, now, tried))
    receipts.check_after_commit(receipt_messages)
    return acked


def _attempts_insert(posted, now):
    """PostgreSQL: the INSERT of these posts' attempt rows at `now`, one text for any number
    of them (an array parameter per column), as (sql, params)."""
    columns = list(zip(*posted, strict=True)) if posted else [[] for _ in Posted._fields]
    return (
        f"""
        INSERT INTO {DeliveryAttempt._meta.db_table}
            (delivery_id, number, at, ok, status_code, error, duration_ms, permanent)
        SELECT t.delivery_id, t.number, %s, t.ok, t.status_code, t.error, t.duration_ms, t.permanent
        FROM unnest(%s::bigint[], %s::integer[], %s::boolean[], %s::integer[], %s::text[],
                    %s::integer[], %s::boolean[])
             AS t(delivery_id, number, ok, status_code, error, duration_ms, permanent)
        """,
        [connection.ops.adapt_datetimefield_value(now), *(list(c) for c in columns)],
    )


def _once(sql, params):
    """One statement as a sans-I/O operation (mqsite/adb.py): its rows, or its row count."""
    return (yield sql, params)


def _ack(subscriber_id, ids, now, lead=None):
    """(newly acked, unknown ids, message ids of the receipt deliveries it acked). `lead`, on
    PostgreSQL: a data-modifying statement (sql, params) run as a WITH of the ack's own, in
    its transaction."""
    ids = list(dict.fromkeys(ids))
    if not ids:
        return 0, [], set()
    # One statement, compare-and-set on the owner and the status; plain SQL for its RETURNING
    # (PostgreSQL, SQLite 3.35+). Only when it did not ack them all is a second query needed,
    # to tell ids acked before from ids that are not the subscriber's. A receipt row also
    # returns its message id (delivery.receipts); others a NULL, read from the row: no join.
    table = Delivery._meta.db_table
    of_ids, id_params = adb.one_of("id", ids)
    at = connection.ops.adapt_datetimefield_value(now)
    lead_sql, lead_params = (f"WITH lead AS ({lead[0]})", lead[1]) if lead else ("", [])
    returned = yield (
        f"""
        {lead_sql}
        UPDATE {table} SET status = %s, acked_at = %s, {UNLEASED_SQL}
        {_no_flush_wait("FROM ")}
        WHERE {of_ids} AND subscriber_id = %s AND status <> %s
        RETURNING id, CASE WHEN receipt THEN message_id END, {observe.ack_returning()}
        """,
        [*lead_params, Status.ACKED, at, *id_params, subscriber_id, Status.ACKED],
    )
    acked = {row[0] for row in returned}
    yield from observe.acked_statement(returned)  # their latency (/metrics)
    # Logged by the statement right after (delivery.receipts.recheck), only when it moved
    # receipt rows: an ack is one statement and no transaction of its own, which an ack
    # without receipts keeps. Lost in between (the process died), the recheck's full pass
    # finds it.
    receipt_messages = yield from receipts.moved_statement(row[1] for row in returned)
    mine = acked
    if len(acked) < len(ids):
        of_rest, rest_params = adb.one_of("id", [i for i in ids if i not in acked])
        found = yield (
            f"SELECT id FROM {table} WHERE {of_rest} AND subscriber_id = %s",
            [*rest_params, subscriber_id],
        )
        mine = acked | {row[0] for row in found}
    # No wake-up: the acking client leases next itself (its consumer wakes on its own acks).
    return len(acked), [i for i in ids if i not in mine], receipt_messages


# --- lease extension ----------------------------------------------------------------------------


class Extended(NamedTuple):
    """What an extension did: the ids whose deadline moved, and the ids that are not the
    caller's in-flight deliveries (another's, pending, acked, dead, held by another socket, or
    no delivery at all)."""

    ids: list
    unknown: list


def extend_deliveries(subscriber, ids, seconds, holder=None, now=None):
    """Move the ack deadline of the subscriber's in-flight deliveries among `ids` to now +
    `seconds` (Pub/Sub's modifyAckDeadline, SQS's ChangeMessageVisibility): a slow worker says
    it is still working. `holder`: only leases held by it (a socket's own); None: any of the
    subscriber's (REST, where a pull is no connection of its own).

    A lease whose deadline passed but that nobody expired yet is still the caller's, and is
    extended; once expired it is pending (or leased again, to its new holder) and unknown here.
    """
    with rows.writing():
        return adb.run_sync(_extend(subscriber.pk, ids, seconds, holder, now or timezone.now()))


@adb.twin(extend_deliveries)
async def aextend_deliveries(subscriber, ids, seconds, holder=None, now=None):
    """extend_deliveries() from the event loop: the same statement on the async connection."""
    return await adb.run(_extend(subscriber.pk, ids, seconds, holder, now or timezone.now()))


def _extend(subscriber_id, ids, seconds, holder, now):
    if not 1 <= seconds <= MAX_EXTEND_SECS:
        raise ValueError(f"seconds must be from 1 to {MAX_EXTEND_SECS}")
    ids = list(dict.fromkeys(ids))
    valid = [i for i in ids if is_db_id(i)]  # others are nobody's (left out, as adb.one_of asks)
    if not valid:
        return Extended([], ids)
    # One statement, compare-and-set on the owner and the status (and the holder): an expiry
    # that ran first made it pending, so it is not extended; one that runs after sees the new
    # deadline (on PostgreSQL it locks the row, and waits for or skips this UPDATE's lock).
    of_ids, id_params = adb.one_of("id", valid, unbounded=True)
    of_holder, holder_params = ("AND lease_holder = %s", [holder]) if holder is not None else ("", [])
    deadline = connection.ops.adapt_datetimefield_value(now + timedelta(seconds=seconds))
    returned = yield (
        f"""
        UPDATE {Delivery._meta.db_table} SET ack_deadline = %s
        WHERE {of_ids} AND subscriber_id = %s AND status = %s {of_holder}
        RETURNING id
        """,
        [deadline, *id_params, subscriber_id, Status.INFLIGHT, *holder_params],
    )
    extended = {row[0] for row in returned}
    return Extended([i for i in ids if i in extended], [i for i in ids if i not in extended])


class NotOwned(ServiceError, LookupError):
    """The delivery does not exist or belongs to another subscriber (the caller sees 404)."""

    status_code, code = 404, "not_found"

    def detail(self):
        return "You have no delivery with that id."


class AlreadySettled(ServiceError):
    """The delivery is acked or dead (its status is the error's text); a nack cannot move it."""

    status_code, code = 409, "already_settled"

    def detail(self):
        return f"The delivery is already {self}; a nack cannot move it."


class Nacked(NamedTuple):
    """What a nack did: {id: (status, attempt, next_attempt_at)} of those it moved, the ids that
    are not the subscriber's or do not exist, and {id: status} of those already acked or dead."""

    done: dict
    unknown: list
    settled: dict


def nack_deliveries(subscriber, ids, retry_in=None, now=None, error=NACKED):
    """Give back the subscriber's deliveries among `ids` (dead_or_retry, as a failed push):
    pending again after `retry_in` seconds or its backoff, or dead if that was its last attempt.

    One transaction of at most three statements whatever the number of ids (a nack frame of
    10,000 ids was 10,000 transactions, each a write lock and a disk flush on SQLite): one
    UPDATE (_end_attempts), compare-and-set on the owner and the status, with the queue's
    max_attempts and the backoff by attempt written as CASEs; then, only when it did not move
    them all, one read to tell settled ids from unknown ones; and, only when one died, one to
    see whether it was the head of an ordered queue. The ids go as one parameter (an array, or
    JSON on SQLite), so there is no limit of parameters to mind.
    """
    with transaction.atomic():
        nacked, wake, died = adb.run_sync(_nack(subscriber.pk, ids, retry_in, now or timezone.now(), error))
        if wake:
            bus.send_after_commit(bus.WAKE, [subscriber.pk])
        receipts.check_after_commit(died)
        operational.died(_dead_of(nacked.done))
    return nacked


@adb.twin(nack_deliveries)
async def anack_deliveries(subscriber, ids, retry_in=None, now=None, error=NACKED):
    """nack_deliveries() from the event loop: the same statements, in one transaction of the
    async connection, the wake-up after its commit."""
    async with adb.transaction() as conn:
        nacked, wake, died = await adb.run(
            _nack(subscriber.pk, ids, retry_in, now or timezone.now(), error), conn
        )
    if wake:
        bus.send(bus.WAKE, [subscriber.pk])
    await receipts.acheck(died)
    dead = _dead_of(nacked.done)
    # Committed: told from a thread (a read, a publish), only when anyone hears of it.
    if dead and await operational.alistened(operational.DELIVERY_DEAD, operational.signals.delivery_dead):
        await adb.thread(operational.tell_deaths)(dead, operational.MAX_ATTEMPTS)
    return nacked


def _nack(subscriber_id, ids, retry_in, now, error):
    """The nack's statements; (Nacked, whether to wake the subscriber after the commit, message
    ids of the receipt deliveries that died)."""
    ids = list(dict.fromkeys(ids))
    valid = [i for i in ids if is_db_id(i)]  # others are nobody's (left out, as adb.one_of asks)
    if not valid:
        return Nacked({}, ids, {}), False, set()
    table = Delivery._meta.db_table
    of_ids, id_params = adb.one_of("id", valid, unbounded=True)
    done, wake, died = yield from _end_attempts(
        f"{of_ids} AND subscriber_id = %s AND status IN (%s, %s)",
        [*id_params, subscriber_id, Status.PENDING, Status.INFLIGHT],
        retry_in,
        now,
        error,
    )
    settled = {}
    if len(done) < len(valid):
        of_rest, rest_params = adb.one_of("id", [i for i in valid if i not in done], unbounded=True)
        settled = dict(
            (
                yield (
                    f"SELECT id, status FROM {table} WHERE {of_rest} AND subscriber_id = %s",
                    [*rest_params, subscriber_id],
                )
            )
        )
    return Nacked(done, [i for i in ids if i not in done and i not in settled], settled), wake, died


def _dead_of(done):
    """The ids that died, of _end_attempts()'s {id: (status, attempt, next_attempt_at)}."""
    return [id_ for id_, (status, _, _) in done.items() if status == Status.DEAD]


def _end_attempts(where, params, retry_in, now, error):
    """A nack's or a failed push's statements for the deliveries `where` selects (dead_or_retry:
    pending again after `retry_in` seconds or their backoff, with `error`, or dead): ({id:
    (status, attempt, next_attempt_at)} of those moved, whether to wake their subscriber after
    the commit, message ids of the receipt deliveries that died). One UPDATE; then one INSERT
    only when receipt rows died, and one read only when one died and none is ready."""
    at = connection.ops.adapt_datetimefield_value
    if retry_in is None:
        next_at, next_params = _backoff_case(now)
    else:
        next_at, next_params = "%s", [at(now + timedelta(seconds=retry_in))]
    set_, set_params = dead_or_retry(error, died_of(error), next_at, next_params, now=at(now))
    rows = yield (
        f"""
        UPDATE {Delivery._meta.db_table} SET {set_}
        WHERE {where}
        RETURNING id, status, attempt, next_attempt_at, queue_id, CASE WHEN receipt THEN message_id END
        """,
        [*set_params, *params],
    )
    done = {
        id_: (status, attempt, _datetime(next_attempt_at))
        for id_, status, attempt, next_attempt_at, _, _ in rows
    }
    died = yield from receipts.moved_statement(
        message_id for _, status, _, _, _, message_id in rows if message_id and status == Status.DEAD
    )
    # Wake only for what is ready now: a retry after a backoff is found by the sweeper and the
    # waiters' own timers when it falls due (and a wake-up now would start a webhook job that
    # finds nothing to post). A dead head of an ordered queue lets the next one go now.
    wake = any(is_ready(status, at_, now) for status, _, at_ in done.values())
    died_in = sorted({queue_id for _, status, _, _, queue_id, _ in rows if status == Status.DEAD})
    if not wake and died_in:
        of_queues, queue_params = adb.one_of("id", died_in)
        wake = bool(
            (
                yield (
                    f"SELECT 1 FROM {Queue._meta.db_table} WHERE {of_queues} AND ordered = %s",
                    [*queue_params, True],
                )
            )
        )
    return done, wake, died


def _datetime(value):
    """A datetime column read by raw SQL: SQLite gives it naive (or as text), in UTC."""
    if isinstance(value, str):
        value = parse_datetime(value)
    if value is not None and timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return value


def nack_one(subscriber, delivery_id, retry_in=None, now=None, error=NACKED):
    """nack_deliveries() of one id: NotOwned or AlreadySettled when it did not move, else its
    (status, attempt, next_attempt_at)."""
    nacked = nack_deliveries(subscriber, [delivery_id], retry_in=retry_in, now=now, error=error)
    if nacked.unknown:
        raise NotOwned(delivery_id)
    if nacked.settled:
        raise AlreadySettled(nacked.settled[delivery_id])
    return nacked.done[delivery_id]


def nack_delivery(subscriber, delivery_id, retry_in=None, now=None, error=NACKED):
    """nack_one(), answered with the updated Delivery (read again: for the admin, the demo and
    tests, not for hot paths)."""
    nack_one(subscriber, delivery_id, retry_in=retry_in, now=now, error=error)
    return Delivery.objects.select_related("queue").get(pk=delivery_id)


def fail_delivery(delivery_id, holder, error, now=None):
    """A failed push (webhook) by the lease holder: like a nack, retried after its backoff or
    dead after the last attempt. Does nothing if the lease has since moved on (expired, acked).
    Returns the Delivery, or None."""
    with transaction.atomic():
        done, wake, died = adb.run_sync(
            _end_attempts(
                "id = %s AND status = %s AND lease_holder = %s",
                [delivery_id, Status.INFLIGHT, holder],
                None,
                now or timezone.now(),
                error,
            )
        )
        if not done:
            return None
        delivery = Delivery.objects.get(pk=delivery_id)
        if wake:
            bus.send_after_commit(bus.WAKE, [delivery.subscriber_id])
        receipts.check_after_commit(died)
        operational.died(_dead_of(done))
    return delivery


# --- expiry, redelivery, death ------------------------------------------------------------------


def expire_overdue_leases(now=None):
    """Return every overdue lease to pending after its backoff, or to dead after the last
    attempt (or, its message expired meanwhile, dead: EXPIRED); and make every pending delivery
    whose message expired dead (expire_pending). For the sweeper; leases do the same for
    their own subscriptions' overdue leases. Returns how many moved."""
    now = now or timezone.now()
    with transaction.atomic():
        expired = _expire_overdue(now, None)
        # Those that are pending again may be ready at once (the backoff runs from the deadline).
        bus.send_after_commit(bus.WAKE, set(expired))
    return len(expired) + expire_pending(now)


def expire_pending(now=None):
    """Pending deliveries whose message's expiry has passed go no further: dead, EXPIRED,
    listed among the dead letters as dying now. The sweep's: until it runs, a lease already
    skips them (querysets.ready_sql), and an ordered line's head steps past them
    (_lease_head_statement). A dead path like the others (kill_deliveries): its receipts are
    logged as moved, and its subscribers woken, for what may now lead their lines (and for
    whatever else closing a delivery sets going). One UPDATE by delivery_expiring; returns how many."""
    table = Delivery._meta.db_table
    at = connection.ops.adapt_datetimefield_value(now or timezone.now())
    # SKIP LOCKED: a lease holding one (it read it just before it expired) is left to finish.
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE {table} SET status = %s, last_error = %s, next_attempt_at = %s, {UNLEASED_SQL}
            WHERE id IN (SELECT d.id FROM {table} d
                         WHERE {status_is(Status.PENDING, "d")} AND {expired_sql("d")}{lock})
              AND {status_is(Status.PENDING, table)}
            RETURNING subscriber_id, CASE WHEN receipt THEN message_id END, id
            """,
            [Status.DEAD, EXPIRED, at, at],
        )
        died = cursor.fetchall()
        receipts.moved(message_id for _, message_id, _ in died)
        bus.send_after_commit(bus.WAKE, {subscriber_id for subscriber_id, _, _ in died})
        operational.died((id_ for _, _, id_ in died), operational.EXPIRED)
    return len(died)


def _expire_overdue(now, subscription_ids):
    """One UPDATE of the overdue leases (of these subscriptions, if not None): dead_or_retry,
    the backoff running from the missed deadline, so that a late sweep does not add to it.
    Returns the subscriber id of each delivery expired."""
    table = Delivery._meta.db_table
    of_subscriptions, params = "", [connection.ops.adapt_datetimefield_value(now)]
    if subscription_ids is not None:
        of_subscriptions, subscription_params = adb.one_of("d.subscription_id", subscription_ids)
        of_subscriptions = f" AND {of_subscriptions}"
        params += subscription_params
    set_, set_params = dead_or_retry(
        ACK_DEADLINE_PASSED, died_of(ACK_DEADLINE_PASSED), _backoff_after("ack_deadline"), [], now=params[0]
    )
    # Plain SQL for the status literal (delivery_overdue is partial). Locks the rows, not
    # their queue's (publishers hold that); SKIP LOCKED: the sweeper and leases at once.
    lock = " FOR UPDATE OF d SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE {table} SET {set_}
            WHERE id IN (SELECT d.id FROM {table} d WHERE {overdue_sql("d")}{of_subscriptions}{lock})
            RETURNING subscriber_id, CASE WHEN receipt AND status = %s THEN message_id END,
              CASE WHEN status = %s THEN id END
            """,
            [*set_params, *params, Status.DEAD, Status.DEAD],
        )
        expired = cursor.fetchall()
    receipts.moved(message_id for _, message_id, _ in expired)
    operational.died(dead_id for _, _, dead_id in expired if dead_id is not None)
    return [subscriber_id for subscriber_id, _, _ in expired]


def redeliver(deliveries, now=None):
    """Operator redelivery: put the given deliveries (a queryset) back to pending, ready now,
    with a fresh count of attempts. Acked deliveries are left alone. Returns how many moved.

    Their expiry goes (expires_at cleared): an operator who redelivers an expired dead letter
    wants it delivered, not dead again at the next sweep."""
    now = now or timezone.now()
    with transaction.atomic():
        moving = deliveries.exclude(status=Status.ACKED)
        subscriber_ids = list(moving.order_by().values_list("subscriber_id", flat=True).distinct())
        line_keys = set(moving.exclude(grp=None).order_by().values_list("subscription_id", "grp").distinct())
        count = Delivery.objects.filter(id__in=moving.values("id")).update(
            status=Status.PENDING,
            attempt=0,
            next_attempt_at=now,
            expires_at=None,
            **UNLEASED,
            last_error=REDELIVERED,
            head=False,  # a dead one's mark is stale; reseat() gives each line its head
        )
        # One reopened below its line's head goes first, unless one of its line is in flight.
        lines.reseat({s for s, _ in line_keys}, line_keys)
    bus.send_after_commit(bus.WAKE, subscriber_ids)
    return count


def kill_deliveries(deliveries, reason=KILLED):
    """Operator action: mark the given deliveries (a queryset) dead. Acked ones stay acked."""
    with transaction.atomic():
        moving = Delivery.objects.filter(id__in=deliveries.exclude(status=Status.ACKED).values("id"))
        subscriber_ids = list(moving.order_by().values_list("subscriber_id", flat=True).distinct())
        receipts.moved(_receipt_messages(moving))
        dying = _not_dead_ids(moving)
        count = moving.update(status=Status.DEAD, **UNLEASED, last_error=reason)
        operational.died(dying, operational.KILLED)
        # A killed head of an ordered queue lets the next one go: as skip_deliveries().
        bus.send_after_commit(bus.WAKE, subscriber_ids)
    return count


def _not_dead_ids(deliveries):
    """The ids of those of `deliveries` (a queryset) an operator's action is about to kill that
    are not dead already (delivery.dead tells of each death once). Read in the action's
    transaction: not a hot path."""
    return list(deliveries.exclude(status=Status.DEAD).order_by().values_list("id", flat=True))


def _receipt_messages(deliveries):
    """The messages of the open receipt deliveries among `deliveries`, which an operator's
    action (not a hot path) is about to settle: one read of the partial index's rows. Open as
    an IN list here, as delivery_receipt_open's condition spells it."""
    open_receipts = deliveries.filter(receipt=True, status__in=OPEN).order_by()
    return set(open_receipts.values_list("message_id", flat=True).distinct())


def retry_now(deliveries, reason=None, now=None):
    """Operator action on a stuck delivery (the blocking head of an ordered subscription):
    hand it out again now. A pending one stops waiting for its retry; an in-flight one is
    taken back from its holder (a late ack from it still counts). Its attempts keep counting,
    so max_attempts still bounds it. Acked and dead ones are left alone. Returns how many."""
    now = now or timezone.now()
    with transaction.atomic():
        # Re-checked in the UPDATE itself: one acked meanwhile is not moved (compare-and-set).
        chosen = deliveries.open().values("id")
        moving = Delivery.objects.filter(id__in=chosen).open()
        subscriber_ids = list(moving.order_by().values_list("subscriber_id", flat=True).distinct())
        count = moving.update(
            status=Status.PENDING,
            next_attempt_at=now,
            **UNLEASED,
            last_error=reason or retried_now_by(),
        )
        bus.send_after_commit(bus.WAKE, subscriber_ids)
    return count


def deliver_now(deliveries, now=None):
    """Operator action on delayed messages: those of the given deliveries (a queryset) that
    still wait for their message's deliver_at (pending, no attempt yet, due later) are ready
    now, and their subscribers woken. Others are left alone: a retry's wait is retry_now's.
    Returns how many moved."""
    now = now or timezone.now()
    with transaction.atomic():
        # One UPDATE, its conditions re-checked in it (compare-and-set): one leased meanwhile
        # (a deliver_at that came) is not moved.
        moving = Delivery.objects.filter(
            id__in=deliveries.order_by().values("id"),
            status=Status.PENDING,
            attempt=0,
            next_attempt_at__gt=now,
            message__deliver_at__gt=now,
        )
        subscriber_ids = list(moving.order_by().values_list("subscriber_id", flat=True).distinct())
        count = moving.update(next_attempt_at=now)
        bus.send_after_commit(bus.WAKE, subscriber_ids)
    return count


def skip_deliveries(deliveries, operator):
    """Operator action on the head of an ordered subscription that holds back those behind
    it: give up on it, dead with the reason "skipped by <operator>", so that the next one
    goes. Only pending and in-flight deliveries move. Returns how many."""
    with transaction.atomic():
        chosen = deliveries.open().values("id")
        moving = Delivery.objects.filter(id__in=chosen).open()
        subscriber_ids = list(moving.order_by().values_list("subscriber_id", flat=True).distinct())
        receipts.moved(_receipt_messages(moving))
        dying = _not_dead_ids(moving)
        count = moving.update(status=Status.DEAD, **UNLEASED, last_error=skipped_by(operator))
        operational.died(dying, operational.SKIPPED)
        # What waited behind it is ready now.
        bus.send_after_commit(bus.WAKE, subscriber_ids)
    return count


def want_receipts(message_ids):
    """A publish with a receipt named, by its key, messages published before without one (a
    retried publish): their deliveries are receipt rows from now on. Rare, so plain updates."""
    Message.objects.filter(pk__in=message_ids, receipt_wanted=False).update(receipt_wanted=True)
    Delivery.objects.filter(message_id__in=message_ids, receipt=False).update(receipt=True)


def drop_undelivered(subscription):
    """An unsubscribe drops what was still owed; acked history stays (subscription unset)."""
    dropping = Delivery.objects.filter(subscription=subscription).exclude(status=Status.ACKED)
    receipt_messages = _receipt_messages(dropping)
    dropping.delete()
    receipts.moved(receipt_messages)  # what is left of them may be settled now


def release_held(
    holders, reason=CONNECTION_CLOSED, wake=True, spend=False, subscription_ids=None, delivery_ids=None
):
    """Deliveries held by these lease holders go back to pending, ready at once: a closed
    websocket (the client is gone, there is nothing to wait for), or a webhook job's batch left
    untried when its endpoint failed (`reason` says which; `wake=False` leaves them to the
    sweeper rather than wake a job that would only find it failing). `subscription_ids`: only
    those of these subscriptions (a revoked right's, on a socket that stays open);
    `delivery_ids`: only these (what a socket leased ahead and never sent).

    `spend`: the attempt counts, and a delivery that had its last one is dead. A socket that
    the client closed (or dropped) while holding a delivery spends it: a message its client
    dies on must die too, not block its subscription for ever (API.md, Extensions). Otherwise
    (the server's own shutdown, a revocation, an untried batch) the attempt is given back.
    Returns the ids released."""
    holders = list(holders)
    if not holders:
        return []
    where, params = adb.one_of("lease_holder", holders)
    if subscription_ids is not None:
        of_subscriptions, subscription_params = adb.one_of("subscription_id", list(subscription_ids) or [0])
        where += f" AND {of_subscriptions}"
        params = [*params, *subscription_params]
    if delivery_ids is not None:
        of_ids, id_params = adb.one_of("id", list(delivery_ids) or [0])
        where += f" AND {of_ids}"
        params = [*params, *id_params]
    return _release(where, params, reason, wake, spend)


def release_held_by_prefix(prefix, reason):
    """What every lease holder whose name starts with `prefix` held: the holdings of a server
    or worker process that died (delivery.liveness), ready at once, the attempt given back.
    Returns (id, subscriber id) of each delivery released."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return _release("lease_holder LIKE %s ESCAPE '\\'", [f"{escaped}%"], reason, True, False, whose=True)


def _release(where, params, reason, wake, spend, whose=False):
    """One UPDATE of the in-flight deliveries `where` selects; returns their ids (with their
    subscriber's, as pairs, if `whose`)."""
    table = Delivery._meta.db_table
    at = connection.ops.adapt_datetimefield_value(timezone.now())
    if spend:
        # Ready at once, and a dead one listed among the dead letters as dying now.
        set_, set_params = dead_or_retry(reason, died_of(CLOSED_IN_FLIGHT), "%s", [at], "%s", [at], now=at)
    else:
        # Whether the client saw the message cannot be known (or it was never sent): given
        # back, so that a subscriber whose server restarts does not see its deliveries die of
        # attempts that never reached it.
        set_ = (
            "status = %s, attempt = CASE WHEN attempt > 0 THEN attempt - 1 ELSE 0 END, last_error = %s,"
            f" next_attempt_at = %s, {UNLEASED_SQL}"
        )
        set_params = [Status.PENDING, reason, at]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE {table} SET {set_}
            WHERE status = %s AND {where}
            RETURNING id, subscriber_id, CASE WHEN receipt AND status = %s THEN message_id END, status
            """,
            [*set_params, Status.INFLIGHT, *params, Status.DEAD],
        )
        released = cursor.fetchall()
        if wake:
            bus.send_after_commit(bus.WAKE, {subscriber_id for _, subscriber_id, _, _ in released})
        receipts.moved(message_id for _, _, message_id, _ in released)
        if spend:
            operational.died(id_ for id_, _, _, status in released if status == Status.DEAD)
    return [(id_, subscriber_id) if whose else id_ for id_, subscriber_id, _, _ in released]


def purge_dead(deliveries):
    """Operator action: delete the dead deliveries among `deliveries` (a queryset), with their
    attempt history. Deliveries in any other state are left alone. Returns how many went."""
    with transaction.atomic():
        ids = list(deliveries.filter(status=Status.DEAD).values_list("id", flat=True))
        # Status re-checked in the DELETE: one redelivered meanwhile is not purged.
        deleted, per_model = Delivery.objects.filter(id__in=ids, status=Status.DEAD).delete()
    return per_model.get(Delivery._meta.label, 0)


# --- replay -------------------------------------------------------------------------------------


class Replayed(NamedTuple):
    """What a replay did: the seq it started from (the one asked, or the oldest still in the
    hot tables if later), and how many deliveries it made owed."""

    from_seq: int
    deliveries: int


def replay(subscription, point, *, reopen=False, event_ids=None, now=None):
    """Make the subscription owe every message of its queue (and event) from `point` (a
    subscribers.replay.Point) that is still in the hot tables, in seq order: begin_replay(),
    then finish_replay(). Returns Replayed."""
    from_seq = begin_replay(subscription, point, reopen=reopen, event_ids=event_ids, now=now)
    return Replayed(from_seq, finish_replay(subscription.pk))


def begin_replay(subscription, point, *, reopen=False, event_ids=None, now=None):
    """Mark the subscription as owing its queue's seqs from `point` to the queue's last seq,
    in a short transaction (the caller's, if it has one); finish_replay() makes them owed.
    Returns the seq the replay starts from.

    A message that has expired (queues.timing) is not owed again: a replay makes no delivery
    of it and reopens none (it would only be dead at the next sweep, a dead letter for nothing).

    Each chunk is one INSERT ... SELECT of the deliveries it lacks (ON CONFLICT on the unique
    (subscription, message): those it has are left as they are, so a chunk done twice makes
    nothing twice) and, to `reopen` (a seek), one UPDATE that hands its acked and dead ones of
    the chunk out again, pending at once, same ids. An acked one keeps its attempt count, so
    the next lease is a new attempt; a dead one starts a fresh count, as an operator's
    redelivery does (it had spent them all, and would die again at its first failure).
    In-flight and pending ones are left alone. `event_ids`: only these events (listen --from
    on an every-event subscription).

    Until the last chunk the subscription is leased nothing: its history is not all owed
    yet, and handing out what is (its live messages, or the first chunks) would break seq
    order. A new subscription's replay holds the queue row here, as publishers do (NO KEY
    UPDATE): a publish under way when it was made committed first and is within the replay's
    range; those after wait and fan out to it. (A seek needs no lock: publishes fan out to its
    subscription already.) One replay at a time per subscription: another is refused
    (LimitExceeded, 429 with Retry-After).
    """
    now = now or timezone.now()
    with transaction.atomic():
        queue = Queue.objects.filter(pk=subscription.queue_id).values_list("last_seq", flat=True)
        if not reopen:
            queue = queue.select_for_update(no_key=True)
        last_seq = queue.get()
        busy = list(_lock_subscription(subscription.pk).values_list("busy_since", flat=True))
        if busy:
            limits.check_not_busy(busy[0])
        from_seq = _replay_start(subscription.queue_id, point, last_seq)
        # A new subscription's replay always ends with a look at its queue's last seq (even
        # with nothing before it to replay): replay_chunk().
        if (from_seq <= last_seq or not reopen) and busy:
            Subscription.objects.filter(pk=subscription.pk).update(
                busy_since=now,
                replay_next=from_seq,
                replay_until=last_seq,
                replay_reopen=reopen,
                replay_events=None if event_ids is None else sorted(event_ids),
                replay_extend=not reopen,
            )
    return from_seq


def finish_replay(subscription_id):
    """Do the chunks of a replay under way (begin_replay()) until none is left, each in its own
    transaction, giving way to other writers between them; returns how many deliveries they
    made owed. Several callers at once (a request and the sweep) share the chunks."""
    owed = 0
    while True:
        made, done = replay_chunk(subscription_id)
        owed += made
        if done:
            return owed
        _give_way()


def _give_way():
    """Between two chunks: let a writer waiting for the lock (SQLite's, one writer at a time;
    mqsite/workarounds/sqlite) have it before the next chunk takes it again."""
    time.sleep(GIVE_WAY_SECS)


# Long enough for a waiting thread to wake and take the writer lock.
GIVE_WAY_SECS = 0.002


def _lock_subscription(subscription_id):
    """The subscription's row, held until commit (NO KEY UPDATE, as a lease of its ordered
    queue does: publishers may still fan out to it), as a queryset already read."""
    return (
        Subscription.objects.select_for_update(of=("self",), no_key=True)
        .filter(pk=subscription_id)
        .order_by()
    )


def replay_chunk(subscription_id, now=None):
    """The next chunk of the replay under way: the next MQ_REPLAY_CHUNK seqs of its range (in
    seq order; a crash between chunks leaves the rest still marked owed, and the sweep goes
    on). Returns (deliveries made owed, whether the replay is done)."""
    now = now or timezone.now()
    table = Delivery._meta.db_table
    at = connection.ops.adapt_datetimefield_value(now)
    with transaction.atomic():
        row = (
            _lock_subscription(subscription_id)
            .values_list(
                "subscriber_id",
                "queue_id",
                "event_id",
                "replay_next",
                "replay_until",
                "replay_reopen",
                "replay_events",
                "replay_extend",
                "leaving",
                "filter",
                "queue__ordered",
            )
            .first()
        )
        if row is None or row[3] is None or row[8]:
            return 0, True  # gone, done, or being unsubscribed
        subscriber_id, queue_id, event_id, first, until, reopen, event_ids, extend, _, filtered, ordered = row
        if first > until and extend:
            # The end of a new subscription's range: read the queue's last seq again, under its
            # lock, which waits for the publishes that were waiting on begin_replay()'s; they
            # fanned out without the subscription (their statement read the subscriptions
            # before it was committed), so their seqs, just after the range, are replayed too.
            until = max(until, _locked_last_seq(queue_id))
            Subscription.objects.filter(pk=subscription_id).update(replay_until=until, replay_extend=False)
            extend = False
        last = min(until, first + settings.MQ_REPLAY_CHUNK - 1)
        of_events, event_params = ("", []) if event_id is None else (" AND m.event_id = %s", [event_id])
        narrow, narrow_params = _of_events("m.event_id", event_ids)
        # SQLite reads "FROM t ON CONFLICT" as a join without its WHERE: the WHERE is needed.
        insert, insert_params = owed_insert(
            "%s, %s", [subscription_id, subscriber_id], now, timed=True, ordered=ordered
        )
        # A replay owes what a publish would owe the subscription now: its filter as it is now
        # applies (filter_holds, the fan-out's own clause), to history published before it too;
        # an expired message is owed to no one any more.
        of_range = f"m.queue_id = %s AND m.seq BETWEEN %s AND %s{of_events}{narrow}"
        owed_now = f"""{filter_source(f"{Message._meta.db_table} m", of_range)}
                JOIN {Subscription._meta.db_table} s ON s.id = %s"""
        owed_params = [queue_id, first, last, *event_params, *narrow_params, subscription_id]
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                {insert}
                FROM {owed_now}
                WHERE {filter_holds("s", "m")} AND {unexpired_sql("m")}
                ORDER BY m.seq
                ON CONFLICT (subscription_id, message_id) DO NOTHING
                """,
                [*insert_params, *owed_params, at],
            )
            owed = cursor.rowcount
            if reopen:
                narrow, narrow_params = _of_events("event_id", event_ids)
                if filtered is not None:  # reopened only where the filter holds now, as above
                    narrow += (
                        f" AND message_id IN (SELECT m.id FROM {owed_now} WHERE {filter_holds('s', 'm')})"
                    )
                    narrow_params = [*narrow_params, *owed_params]
                cursor.execute(
                    f"""
                    UPDATE {table} SET status = %s, next_attempt_at = %s, {UNLEASED_SQL},
                        acked_at = NULL, head = %s,
                        attempt = CASE WHEN status = %s THEN 0 ELSE attempt END,
                        last_error = CASE WHEN status = %s THEN %s ELSE last_error END
                    WHERE subscription_id = %s AND seq BETWEEN %s AND %s AND status IN (%s, %s){narrow}
                      AND {unexpired_sql(table)}
                    """,
                    [
                        Status.PENDING,
                        at,
                        False,  # a closed one's mark is stale: the end of the replay reseats
                        Status.DEAD,
                        Status.DEAD,
                        REPLAYED,
                        subscription_id,
                        first,
                        last,
                        Status.ACKED,
                        Status.DEAD,
                        *narrow_params,
                        at,
                    ],
                )
                owed += cursor.rowcount
        done = last >= until and not extend
        if done:
            # Its history came in below its lines' heads: each line's head is its lowest open
            # delivery again (or the one in flight) before it may lease (delivery.lines).
            lines.reseat([subscription_id])
            Subscription.objects.filter(pk=subscription_id).update(**_NOT_BUSY)
            bus.send_after_commit(bus.WAKE, [subscriber_id])  # leased again, the history first
        else:
            Subscription.objects.filter(pk=subscription_id).update(replay_next=last + 1, busy_since=now)
    return owed, done


_NOT_BUSY = {
    "busy_since": None,
    "replay_next": None,
    "replay_until": None,
    "replay_reopen": False,
    "replay_events": None,
    "replay_extend": False,
}


def _locked_last_seq(queue_id):
    """The queue's last seq, its row held until commit as publishers hold it (NO KEY UPDATE)."""
    return (
        Queue.objects.select_for_update(no_key=True)
        .filter(pk=queue_id)
        .order_by()
        .values_list("last_seq", flat=True)
        .get()
    )


def finish_stalled(now=None):
    """The sweep: finish the replays and unsubscribes that stopped halfway (their server died
    between two chunks: their last chunk ran MQ_REPLAY_STALL_SECS ago). Returns how many."""
    now = now or timezone.now()
    stalled = list(
        Subscription.objects.filter(busy_since__lt=now - timedelta(seconds=settings.MQ_REPLAY_STALL_SECS))
        .order_by()
        .values_list("pk", "leaving")
    )
    for subscription_id, leaving in stalled:
        # One that fails is logged and tried again at the next sweep; the others, and the rest
        # of the sweep (expired leases, webhook jobs), go on.
        try:
            if leaving:
                unsubscribe(subscription_id)
            else:
                finish_replay(subscription_id)
        except DatabaseError:
            log.exception(
                "could not finish the stalled replay or unsubscribe of subscription %s", subscription_id
            )
    return len(stalled)


# --- unsubscribe --------------------------------------------------------------------------------


def unsubscribe(subscription_id):
    """Delete the subscription; what it was still owed is dropped, its acked history stays
    (subscription unset). A subscription owed tens of thousands of deliveries is emptied in
    chunks first, each its own transaction: it is marked leaving (leased nothing, its replay
    stopped), then its undelivered deliveries go and its acked ones are let go of, chunk by
    chunk; the last transaction drops what fan-out added meanwhile and deletes the row."""
    with transaction.atomic():
        if not list(_lock_subscription(subscription_id).values_list("pk")):
            return
        Subscription.objects.filter(pk=subscription_id).update(
            **{**_NOT_BUSY, "leaving": True, "busy_since": timezone.now()}
        )
    chunk = settings.MQ_REPLAY_CHUNK
    while _leave_chunk(subscription_id, chunk) >= chunk:
        _give_way()
    with transaction.atomic():
        subscription = Subscription.objects.filter(pk=subscription_id).first()
        if subscription is not None:
            # The queue's row first, as publishers take it before their deliveries' keys: a
            # publish under way commits before the row goes (deleting it first, then waiting on
            # that publish's delivery, deadlocked with its check of the key). Publishes since
            # the mark fan out to it no more.
            _locked_last_seq(subscription.queue_id)
            drop_undelivered(subscription)
            subscription.delete()


def _leave_chunk(subscription_id, chunk):
    """Drop up to `chunk` undelivered deliveries of a subscription being unsubscribed, or, none
    left, let go of up to `chunk` acked ones; returns how many."""
    with transaction.atomic():
        Subscription.objects.filter(pk=subscription_id).update(busy_since=timezone.now())
        of_subscription = Delivery.objects.filter(subscription_id=subscription_id).order_by()
        ids = list(of_subscription.exclude(status=Status.ACKED).values_list("id", flat=True)[:chunk])
        if ids:
            receipt_messages = _receipt_messages(Delivery.objects.filter(id__in=ids))
            # Plain DELETEs, their attempts first: the ORM's cascade read every row of the
            # chunk as a model first, five times the time.
            with connection.cursor() as cursor:
                of_deliveries, params = adb.one_of("delivery_id", ids)
                cursor.execute(f"DELETE FROM {DeliveryAttempt._meta.db_table} WHERE {of_deliveries}", params)
                of_ids, params = adb.one_of("id", ids)
                cursor.execute(f"DELETE FROM {Delivery._meta.db_table} WHERE {of_ids}", params)
            receipts.moved(receipt_messages)  # what is left of them may be settled now
            return len(ids)
        ids = list(of_subscription.filter(status=Status.ACKED).values_list("id", flat=True)[:chunk])
        return Delivery.objects.filter(id__in=ids).update(subscription=None)


def _replay_start(queue_id, point, last_seq):
    """The seq a replay from `point` starts at: the one asked ("all": the first; a time: the
    first message published at or after it), or the oldest message still in the hot tables if
    that is later; past the last seq when there is nothing to replay. One read."""
    kind, value = point
    if kind == "new":
        return last_seq + 1
    table = Message._meta.db_table
    oldest = f"SELECT MIN(seq) FROM {table} WHERE queue_id = %s"
    with connection.cursor() as cursor:
        if kind == "time":
            cursor.execute(
                f"SELECT ({oldest}), (SELECT MIN(seq) FROM {table} WHERE queue_id = %s AND created_at >= %s)",
                [queue_id, queue_id, connection.ops.adapt_datetimefield_value(value)],
            )
            oldest_seq, asked_seq = cursor.fetchone()
        else:
            cursor.execute(oldest, [queue_id])
            (oldest_seq,), asked_seq = cursor.fetchone(), 1 if kind == "all" else value
    if asked_seq is None:  # no message at or after that time
        return last_seq + 1
    # Nothing left in the hot tables: the next message is the oldest there could be.
    return max(asked_seq, last_seq + 1 if oldest_seq is None else oldest_seq)
