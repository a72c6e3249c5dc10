"""Receipts: a publisher learns when every delivery of its message is settled (acked or dead).

Two ways to ask (API.md, Extensions): `GET /api/messages/{id}` (receipt_of, one aggregate
query), and a socket publish frame with `"receipt": true`, answered by one `receipt` frame per
message once none of its deliveries is pending or in flight.

The socket's way rides on the ledger's settling statements and costs nothing to anyone else:

- The publish marks the message `receipt_wanted`, and the fan-out copies the mark onto each of
  its deliveries (`Delivery.receipt`). Publishes without a receipt send the statements they
  always did.
- Every statement that settles deliveries (ack, nack or expiry to dead, a closed socket's last
  attempt, an operator's kill or skip, an unsubscribe dropping what was owed) returns the
  message id of the receipt rows it moved, from the row itself (no join, no extra query). Only
  when there are some does the ledger, *after its commit*, ask which of those messages have no
  receipt delivery open any more (settled_statement: one probe each into the partial index
  delivery_receipt_open, which holds only receipt rows still open), and announce them.
- Checking after the commit closes the race of two transactions settling a message's last two
  deliveries at once: whichever commits last sees the other's commit in its check (each check
  is a statement of its own, so it sees everything committed before it started). Both may
  announce: the waiting socket sends one frame whatever it hears.
- An announcement reaches the sockets that wait for the message: in this process through the
  registry below, in the others through the same Redis channel as wake-ups
  (mqsite.bus, the `settled` word). Each reads the counts once (counts_statement) and sends the frame.
- Only the message's publisher waits for it. A publish whose idempotency key names a message
  already there answers with that message (API.md), but another publisher's repeat neither
  marks it nor waits for its receipt (Owed.published, publishing._publish): its progress, and
  the counts of its deliveries, are its publisher's alone.
- Each such statement also logs the messages whose receipt rows it moved (ReceiptMove: one
  INSERT in its transaction; an ack, one statement and no transaction, logs by the statement
  right after it), only when there are some: other publishes and acks cost nothing new.
- What can be lost (a Redis word, an announcement from a process without Redis: the embedded
  mode's webhook worker and sweeper) is caught by recheck(): every RECHECK_SECS it reads the
  log rows since its last pass (one range query from its watermark) and probes only the
  messages among them its sockets wait for, so a pass costs what changed, not what is waited
  for. Every FULL_RECHECK_SECS it probes all of them instead, for what no statement logged (a
  subscriber or subscription deleted in the admin, its deliveries by cascade): a receipt is
  late then, never lost. The sweep prunes the log after MOVES_KEPT_SECS. What one subscriber's
  sockets in a process may wait for together is capped (MQ_MAX_RECEIPTS_PER_SUBSCRIBER,
  mqsite.limits): opening more sockets adds no room.
"""

import asyncio
import json
import logging
import threading
import time
from collections import defaultdict
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import Count, Q
from django.utils import timezone

from mqsite import adb, bus, limits
from queues.models import Message

from .models import Delivery, ReceiptMove, Status
from .querysets import open_in_sql

log = logging.getLogger(__name__)

# The operator's view of a message lists at most this many subscriptions (by delivery id); the
# counts cover them all.
MAX_SUBSCRIPTIONS_SHOWN = 1000

# Spelled as delivery_receipt_open's condition, so that SQLite (which matches the terms as
# written) and PostgreSQL's generic plans use that index.
OPEN_RECEIPT = f"d.receipt AND {open_in_sql('d')}"


def zero_counts():
    return {s.value: 0 for s in Status}


# --- the statements (sans I/O, for either driver: mqsite/adb.py) ---------------------------------


def _id_values(ids):
    """(a FROM item `v` with one column `id` of these ids, its one parameter): an array on
    PostgreSQL, a JSON list on SQLite, so any number of ids is one parameter."""
    ids = [int(i) for i in ids]
    if connection.vendor == "postgresql":
        return "unnest(%s::bigint[]) AS v (id)", ids
    return "(SELECT value AS id FROM json_each(%s)) v", json.dumps(ids)


def settled_statement(message_ids):
    """Those of these messages none of whose receipt deliveries is still open (a message with
    none at all too): one probe each into delivery_receipt_open."""
    if not message_ids:
        return []
    values, param = _id_values(message_ids)
    rows = yield (
        f"""
        SELECT v.id FROM {values}
        WHERE NOT EXISTS (SELECT 1 FROM {Delivery._meta.db_table} d
                          WHERE d.message_id = v.id AND {OPEN_RECEIPT})
        """,
        [param],
    )
    return [row[0] for row in rows]


def counts_statement(message_ids):
    """{message id: {pending, inflight, acked, dead}} of these messages: one grouped read over
    the delivery table's message index (a message without deliveries: all zeros)."""
    out = {i: zero_counts() for i in message_ids}
    if not out:
        return out
    values, param = _id_values(out)
    rows = yield (
        f"""
        SELECT d.message_id, d.status, COUNT(*) FROM {Delivery._meta.db_table} d
        WHERE d.message_id IN (SELECT v.id FROM {values})
        GROUP BY d.message_id, d.status
        """,
        [param],
    )
    for message_id, status, n in rows:
        out[message_id][status] = n
    return out


@adb.twin(adb.run_sync)
async def arun(op):
    """A statement above, from the event loop (a thread where the async connection is off)."""
    return await adb.run(op)


# --- the ledger's side: after a commit that settled receipt deliveries ---------------------------


def moved_statement(message_ids):
    """Log that receipt deliveries of these messages moved (ReceiptMove), sans I/O: one INSERT,
    run in the transaction of the statement that moved them. None, and no statement, when
    there are none. Returns the ids."""
    ids = sorted({int(i) for i in message_ids if i is not None})
    if ids:
        values, param = _id_values(ids)
        yield f"INSERT INTO {ReceiptMove._meta.db_table} (message_id) SELECT v.id FROM {values}", [param]
    return ids


def moved(message_ids):
    """The ledger's statement in the caller's transaction moved receipt deliveries of these
    messages: log them there (moved_statement), and check_after_commit(). Nothing, no
    statement, when there are none."""
    ids = [i for i in message_ids if i is not None]
    if ids:
        check_after_commit(adb.run_sync(moved_statement(ids)))


def check_after_commit(message_ids):
    """The ledger settled receipt deliveries of these messages: once the transaction commits (at
    once outside one), announce those now settled. Nothing to do, no query, when empty."""
    ids = sorted({i for i in message_ids if i is not None})
    if ids:
        transaction.on_commit(lambda: announce(adb.run_sync(settled_statement(ids))), robust=True)


async def acheck(message_ids):
    """check_after_commit() on the event loop, after a commit made there."""
    ids = sorted({i for i in message_ids if i is not None})
    if not ids:
        return
    try:
        settled = await arun(settled_statement(ids))
    except Exception:  # what settled is committed: the sockets' recheck finds it
        log.warning("could not check receipts of %s", ids, exc_info=True)
        return
    announce(settled)


def announce(message_ids):
    """These messages are settled: tell the sockets waiting for them, here and elsewhere."""
    bus.send(bus.SETTLED, message_ids)  # settled_here() at once, then the other processes


# --- the sockets' side ---------------------------------------------------------------------------

_lock = threading.Lock()
# message id -> {Owed: its event loop} of the sockets waiting for its receipt: announcements come
# from any thread (a REST ack, a Celery task) and from the listener of other processes. Several
# sockets may wait for one message (its publisher's workers retrying one key), each gets a frame.
_waiting = {}
# subscriber id -> its Owed in this process that wait for receipts or have some booked: the cap
# MQ_MAX_RECEIPTS_PER_SUBSCRIBER counts across them (mqsite.limits).
_of_subscriber = defaultdict(set)


def wait_for(message_ids, owed):
    """Call `owed.settled(ids)` on the running loop when these messages are announced settled."""
    loop = asyncio.get_running_loop()
    with _lock:
        for i in message_ids:
            _waiting.setdefault(i, {})[owed] = loop


def forget(message_ids, owed):
    with _lock:
        for i in message_ids:
            waiters = _waiting.get(i)
            if waiters is not None:
                waiters.pop(owed, None)
                if not waiters:
                    del _waiting[i]


def waiting():
    """How many messages the sockets of this process wait for a receipt of."""
    with _lock:
        return len(_waiting)


def settled_here(message_ids):
    """Hand each of these messages to the sockets of this process waiting for it, if any."""
    by_waiter = defaultdict(list)
    with _lock:
        for i in message_ids:
            for owed, loop in _waiting.get(i, {}).items():
                by_waiter[(loop, owed)].append(i)
    if not by_waiter:
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:  # a sync thread (a request, a Celery task)
        running = None
    for (loop, owed), ids in by_waiter.items():
        if loop is running:
            owed.settled(ids)
        else:
            try:
                loop.call_soon_threadsafe(owed.settled, ids)
            except RuntimeError:  # that loop is closed: its socket is gone
                pass


def _heard(message_ids, source):
    """The bus's `settled` word: this process's own, and the others' (not its echo: its sockets
    were handed them when it was said)."""
    if source in (bus.SENT, bus.HEARD):
        settled_here(message_ids)


bus.on(bus.SETTLED, _heard)


def owned_statement(message_ids, publisher_id):
    """Those of these messages that this subscriber published: a repeated idempotency key
    answers with the first message whoever published it (API.md), but only its publisher may
    wait for its receipt."""
    if not message_ids:
        return []
    values, param = _id_values(message_ids)
    rows = yield (
        f"SELECT m.id FROM {Message._meta.db_table} m WHERE m.publisher_id = %s "
        f"AND m.id IN (SELECT v.id FROM {values})",
        [publisher_id, param],
    )
    return [row[0] for row in rows]


def receipt_frame(message_id, counts, ref):
    """A publisher's receipt: every delivery of its message is acked or dead. Its shape is here,
    not with the other frames (delivery.frames), which sit above the ledger this module serves;
    `ref` is the publish frame's, as frames.with_ref adds it."""
    frame = {"type": "receipt", "id": message_id, "deliveries": counts}
    return {**frame, "ref": ref} if ref is not None else frame


class Owed:
    """The receipts one socket of subscriber `subscriber_id` owes, and the sending of their
    frames (through `send`, the socket's own send of a frame), on the socket's event loop."""

    def __init__(self, send, subscriber_id):
        self.send = send
        self.subscriber_id = subscriber_id
        self.refs = {}  # message id -> ref of its publish frame
        self.booked = 0  # messages of publish frames not yet published that want a receipt
        self.due = set()  # announced settled, their frames not sent yet
        self.task = None
        self.closed = False

    def book(self, count):
        """Room for `count` more, before their publish: limits.LimitExceeded (too_many_receipts)
        past what the subscriber's sockets in this process may wait for together."""
        with _lock:
            mine = _of_subscriber[self.subscriber_id]
            limits.check_receipts(sum(len(o.refs) + o.booked for o in mine), count)
            mine.add(self)
            self.booked += count

    def unbook(self, count):
        self.booked -= count

    async def published(self, answers, ref):
        """Owe a receipt for each message of a publish that is this subscriber's, once its
        `published` frame is out (a receipt never comes before it). `answers`: [(answer,
        created)]; a message its key found is owed only to its own publisher (one query, only
        then). Returns their ids, for check()."""
        ids = [a["id"] for a, created in answers if created]
        repeated = list(dict.fromkeys(a["id"] for a, created in answers if not created))
        if repeated:
            ids += await arun(owned_statement(repeated, self.subscriber_id))
        for i in ids:
            self.refs[i] = ref
        wait_for(ids, self)
        return ids

    async def check(self, ids):
        """Those settled already (owed to nobody, or settled before the socket waited for them:
        an announcement made before then found nobody) are due now: one query."""
        try:
            self.settled(await arun(settled_statement(ids)))
        except Exception:  # the recheck of socket_loops finds them
            log.warning("checking receipts %s failed", ids, exc_info=True)

    def settled(self, ids):
        """Announced settled: send their receipts, one sender at a time."""
        self.due.update(i for i in ids if i in self.refs)
        if self.due and not self.closed and (self.task is None or self.task.done()):
            self.task = asyncio.ensure_future(self._send_due())

    async def _send_due(self):
        while self.due and not self.closed:
            due, self.due = sorted(i for i in self.due if i in self.refs), set()
            refs = {i: self.refs.pop(i) for i in due}
            forget(due, self)
            try:
                counts = await arun(counts_statement(due))
            except Exception:  # owed again: the recheck of socket_loops finds them again
                log.warning("reading receipts %s failed", due, exc_info=True)
                self.refs.update(refs)
                wait_for(due, self)
                return
            for i in due:
                await self.send(receipt_frame(i, counts[i], refs[i]))

    def close(self):
        """The socket closed: nobody to tell any more."""
        self.closed = True
        forget(list(self.refs), self)
        self.refs.clear()
        with _lock:
            mine = _of_subscriber.get(self.subscriber_id)
            if mine is not None:
                mine.discard(self)
                if not mine:
                    del _of_subscriber[self.subscriber_id]
        if self.task is not None:
            self.task.cancel()


# --- the recheck: what the announcements missed -------------------------------------------------

# How long ReceiptMove rows are kept (the sweep prunes older ones): far more than the sockets'
# recheck period (socket_loops.RECHECK_SECS), so a process reads every row at least once. A
# process that read none for half of it (no receipt waited for, or its database unreachable)
# cannot know what was pruned since, and makes its next pass a full one.
MOVES_KEPT_SECS = 60
# Every this often a pass probes every receipt waited for, not only those the log names: the
# net under the net, for settles no ledger statement logged (a subscriber or subscription
# deleted in the admin, whose deliveries go by cascade) and for a log row that became visible
# only after its id was given up on (below). A receipt is late then, never lost.
FULL_RECHECK_SECS = 30
# On PostgreSQL ids are taken when a row is inserted, not when it commits: a row with a lower
# id can become visible after a higher one was read. An id skipped over is read again on each
# pass for this long (a settling transaction lasts milliseconds), then left to the full pass; a
# rolled-back insert leaves such a gap for good. More gaps than MAX_GAPS at once (a sequence
# that jumped): those past it are left to the full pass too.
GAP_SECS = 10
MAX_GAPS = 10_000


def last_move_statement():
    """The highest ReceiptMove id (0 when none): where a process's reading starts."""
    rows = yield f"SELECT COALESCE(MAX(id), 0) FROM {ReceiptMove._meta.db_table}", []
    return rows[0][0]


def moves_statement(after, gaps):
    """[(id, message id)] of the ReceiptMove rows after id `after`, and of the ids `gaps`: one
    range of the primary key (and one lookup per gap)."""
    table = ReceiptMove._meta.db_table
    sql, params = f"SELECT id, message_id FROM {table} WHERE id > %s", [after]
    if gaps:
        values, param = _id_values(gaps)
        sql += f" UNION ALL SELECT id, message_id FROM {table} WHERE id IN (SELECT v.id FROM {values})"
        params.append(param)
    return [tuple(row) for row in (yield sql, params)]


def prune_moves(now=None):
    """Delete the ReceiptMove rows older than MOVES_KEPT_SECS (one DELETE by their index on
    `at`): for the sweep. Returns how many."""
    cutoff = (now or timezone.now()) - timedelta(seconds=MOVES_KEPT_SECS)
    return ReceiptMove.objects.filter(at__lt=cutoff).delete()[0]


class Reading:
    """How far this process has read ReceiptMove: the highest id read, the lower ids not seen
    yet (gaps, each with the monotonic time it is given up at), and when it last read and last
    made a full pass."""

    def __init__(self):
        self.after = None  # None: nothing read yet, the next pass is a full one
        self.gaps = {}
        self.read_at = self.full_at = float("-inf")

    def start(self, last_id, now):
        """Read from after `last_id` on (what came before, a full pass covers)."""
        self.after, self.gaps, self.read_at = last_id, {}, now

    def advance(self, rows, now):
        """Take in the rows moves_statement() read."""
        for id_, _ in rows:
            self.gaps.pop(id_, None)
        top = max((id_ for id_, _ in rows), default=self.after)
        seen = {id_ for id_, _ in rows}
        missing = (i for i in range(self.after + 1, top) if i not in seen)
        for i in missing:
            if len(self.gaps) >= MAX_GAPS:
                break
            self.gaps[i] = now + GAP_SECS
        self.gaps = {i: until for i, until in self.gaps.items() if until > now}
        self.after, self.read_at = max(self.after, top), now


_reading = Reading()


async def recheck():
    """The safety net under the announcements, every RECHECK_SECS (socket_loops): which of the
    receipts waited for in this process were settled, handed to their sockets. It reads the
    ReceiptMove rows logged since its last pass (one range query) and probes only the messages
    among them that are waited for here: its cost is what changed, not what is waited for.
    Every FULL_RECHECK_SECS (and when it cannot know what it missed) it probes all of them
    instead. Nothing, no query, when none is waited for."""
    with _lock:
        awaited = set(_waiting)
    if not awaited:
        return
    now = time.monotonic()
    reading = _reading
    if reading.after is None or now - reading.read_at > MOVES_KEPT_SECS / 2:
        # Where the log ends, read before the probe: what moves after the probe is logged after.
        last_id, rows, full = await arun(last_move_statement()), [], True
    else:
        last_id, rows = None, await arun(moves_statement(reading.after, sorted(reading.gaps)))
        full = now - reading.full_at >= FULL_RECHECK_SECS
    probe = sorted(awaited if full else awaited & {message_id for _, message_id in rows})
    if probe:
        settled_here(await arun(settled_statement(probe)))
    # Only once probed: a pass that failed reads the same rows again next time.
    if last_id is not None:
        reading.start(last_id, now)
    else:
        reading.advance(rows, now)
    if full:
        reading.full_at = now


# --- GET /api/messages/{id} ----------------------------------------------------------------------


def receipt_of(message_id, publisher=None, operator=False, subscriptions=False):
    """The message as its publisher (a Subscriber) or an operator sees it, with the count of its
    deliveries in each state (one aggregate query over the delivery table's message index), and
    with `subscriptions` (an operator who may view deliveries) the first MAX_SUBSCRIPTIONS_SHOWN
    of its subscriptions (one more). None when
    it does not exist or the caller did not publish it (an operator's message is nobody's)."""
    messages = Message.objects.filter(pk=message_id)
    if not operator:
        if publisher is None:
            return None
        messages = messages.filter(publisher=publisher)
    found = (
        messages.order_by()
        .values("id", "queue__name", "event__name", "seq", "created_at")
        .annotate(**{s.value: Count("deliveries", filter=Q(deliveries__status=s.value)) for s in Status})
        .first()
    )
    if found is None:
        return None
    answer = {
        "id": found["id"],
        "queue": found["queue__name"],
        "event": found["event__name"],
        "seq": found["seq"],
        "created_at": found["created_at"],
        "deliveries": {s.value: found[s.value] for s in Status},
    }
    if operator and subscriptions:
        rows = (
            Delivery.objects.filter(message_id=message_id)
            .order_by("id")
            .values_list("subscriber__name", "subscription__event__name", "status", "attempt", "acked_at")
        )
        answer["subscriptions"] = [
            {"subscriber": name, "event": event, "status": status, "attempt": attempt, "acked_at": acked_at}
            for name, event, status, attempt, acked_at in rows[:MAX_SUBSCRIPTIONS_SHOWN]
        ]
    return answer
