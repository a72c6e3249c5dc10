"""The archive: acked history leaves the hot tables for Parquet under MQ_ARCHIVE_DIR.

A message moves, with its deliveries, once it is older than its queue's retention (or than
the days asked for) and every one of its deliveries is acked, or it has none. A message with a
pending, in-flight or dead delivery stays, and so do those deliveries.

Order of work, per batch of messages: read the rows, commit the batch's journal row
(ArchiveBatch: its message ids), write its Parquet files completely and durably
(analytics.layout), named after the journaled ids only, and then delete the rows and the
journal row in one transaction. A crash anywhere leaves the rows in the hot tables, and
perhaps in Parquet too, with the journal row saying so. Every run, under the lock, first
replays what the journal holds: the same ids, so the same rows under the same file names
(overwritten, not copied beside), and files of the batch that no longer have a row (an
operator deleted messages meanwhile) removed; then the delete. Batches the run picks itself
afterwards may have other boundaries (a message that became archivable meanwhile, another
cutoff), but they never hold a journaled message: each message is in the archive once.

A message archivable when read may not be at the delete: a seek (ledger.replay) reopens acked
deliveries and adds missing ones. The delete checks again and keeps such a message; the
batch's files are then written again without it before the delete commits, so the archive
never holds a message that is still in the hot tables.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from datetime import timedelta

from django.conf import settings
from django.db import OperationalError, connection, connections, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from delivery.models import Delivery, Status
from queues.models import Message, Queue

from . import layout
from .models import ArchiveBatch

log = logging.getLogger(__name__)

# Messages per batch: the rows of one batch and its Parquet files are held in memory, and one
# delete transaction takes them; a few thousand keeps both small.
BATCH_MESSAGES = 2000

MESSAGE_FIELDS = (
    "id",
    "event__name",
    "seq",
    "created_at",
    "payload_json",
    "key",
    "publisher__name",
    "headers_json",
)
DELIVERY_FIELDS = (
    "id",
    "message_id",
    "event__name",
    "subscriber__name",
    "seq",
    "status",
    "attempt",
    "created_at",
    "delivered_at",
    "acked_at",
    "last_error",
)


# Writes of one batch before it is left to the next run, when its messages keep being reopened
# between the write and the delete.
WRITE_TRIES = 5

# How often a waiting exclusive() tries the lock again.
LOCK_POLL_SECS = 0.2


class ArchiveBusy(RuntimeError):
    """Another run holds the archive's lock."""


def archive_history(
    *,
    older_than_days=None,
    now=None,
    root=None,
    batch_size=BATCH_MESSAGES,
    budget_secs=None,
    wait_secs=0,
    progress=None,
):
    """Move archivable history to Parquet; returns {"messages": n, "deliveries": n} moved.

    `older_than_days` replaces each queue's retention (0: everything acked, whatever its age).
    With `budget_secs`, stops after the batch that passes it (the next run goes on from there).
    Raises ArchiveBusy when the archive is held (another run, compaction, an analysis) past
    `wait_secs`. Calls `progress(queue name or None for a journaled batch, messages,
    deliveries)` after each batch.
    """
    progress = progress or (lambda queue, messages, deliveries: None)
    now = now or timezone.now()
    root = str(root or settings.MQ_ARCHIVE_DIR)
    started = time.monotonic()
    moved = {"messages": 0, "deliveries": 0}
    with exclusive(root, wait_secs=wait_secs):
        for messages, deliveries in replay_journal(root):
            moved["messages"] += messages
            moved["deliveries"] += deliveries
            progress(None, messages, deliveries)
        for queue in Queue.objects.order_by("name"):
            days = queue.retention_days if older_than_days is None else older_than_days
            cutoff = now - timedelta(days=days)
            after = 0
            while True:
                ids = list(
                    archivable(queue, cutoff)
                    .filter(id__gt=after)
                    .order_by("id")
                    .values_list("id", flat=True)[:batch_size]
                )
                if not ids:
                    break
                messages, deliveries = archive_batch(root, queue.name, ids)
                moved["messages"] += messages
                moved["deliveries"] += deliveries
                progress(queue.name, messages, deliveries)
                after = ids[-1]
                if budget_secs is not None and time.monotonic() - started > budget_secs:
                    log.info("archive: budget of %s s spent, the next run goes on", budget_secs)
                    return moved
    return moved


def archivable(queue, cutoff):
    """The queue's messages older than `cutoff` whose deliveries are all acked (or none)."""
    unsettled = Delivery.objects.filter(message_id=OuterRef("pk")).exclude(status=Status.ACKED)
    return Message.objects.filter(queue=queue, created_at__lt=cutoff).filter(~Exists(unsettled))


def replay_journal(root):
    """Finish the batches a crashed run left in the journal, oldest first; yields each one's
    (messages, deliveries) deleted. Call it under exclusive(root)."""
    # Only this place's: a batch journaled for another MQ_ARCHIVE_DIR waits for a run there.
    for batch in ArchiveBatch.objects.filter(root=str(root)).order_by("id"):
        log.info("archive: replaying the journaled batch %s", batch)
        yield _run_batch(root, batch, replay=True)


def archive_batch(root, queue_name, ids):
    """Journal, write to Parquet, then delete these messages and their deliveries. Returns the
    (messages, deliveries) deleted."""
    rows = _read_batch(ids)
    if not rows[0]:
        return 0, 0
    # Committed before a file is written: from here on a crash is replayed with these ids.
    batch = ArchiveBatch.objects.create(
        root=str(root),
        queue=queue_name,
        message_ids=list(ids),
        days=sorted({layout.day_of(m[3]) for m in rows[0]}),
    )
    return _run_batch(root, batch, rows=rows)


def _read_batch(ids):
    """(messages, deliveries) of these ids that may be archived, as tuples in the layout's
    column order."""
    messages = list(Message.objects.filter(id__in=ids).order_by("id").values_list(*MESSAGE_FIELDS))
    deliveries = list(
        Delivery.objects.filter(message_id__in=ids).order_by("id").values_list(*DELIVERY_FIELDS)
    )
    if any(d[5] != Status.ACKED for d in deliveries):
        # Reopened by a seek since the batch was chosen: never archive an open delivery.
        unsettled = {d[1] for d in deliveries if d[5] != Status.ACKED}
        messages = [m for m in messages if m[0] not in unsettled]
        deliveries = [d for d in deliveries if d[1] not in unsettled]
    return messages, deliveries


def _run_batch(root, batch, *, rows=None, replay=False):
    # The name comes from the journaled ids alone, never from the rows found: a replay that
    # finds fewer rows still overwrites the files of the first attempt.
    name = layout.part_name(min(batch.message_ids), max(batch.message_ids))
    for attempt in range(WRITE_TRIES):
        messages, deliveries = rows if rows and not attempt else _read_batch(batch.message_ids)
        # The files are complete and on disk before a single row goes.
        _write_batch(root, batch, name, messages, deliveries, clean=replay or attempt > 0)
        written = [m[0] for m in messages]
        try:
            with transaction.atomic():
                moved = delete_archived(written, {d[0] for d in deliveries})
                # A seek (ledger.replay) may reopen an acked delivery, or add one, between the
                # read and the delete: that message stays in the hot tables, so its copy must
                # leave the files, or it would be archived twice once settled again.
                if Message.objects.filter(id__in=written).exists():
                    raise _Reopened
                ArchiveBatch.objects.filter(pk=batch.pk).delete()
            return moved
        except _Reopened:
            log.info("archive: a message of %s was reopened meanwhile; writing the batch again", batch)
        except RowsBusy:
            log.info("archive: a seek holds rows of %s; writing the batch again", batch)
            time.sleep(BUSY_BACKOFF_SECS * (attempt + 1))
    raise RuntimeError(f"archive: the batch {batch} kept changing; the next run replays it")


class _Reopened(Exception):
    pass


class RowsBusy(Exception):
    """A seek under way holds rows of the batch (PostgreSQL's lock_not_available)."""


LOCK_NOT_AVAILABLE = "55P03"
# The pause before writing a batch again whose rows a seek held: the seek commits meanwhile.
BUSY_BACKOFF_SECS = 0.2


def _write_batch(root, batch, name, messages, deliveries, *, clean):
    written = set(layout.write_history(root, batch.queue, messages, deliveries, durable=True, name=name))
    if not clean:
        return
    # A (kind, day) an earlier attempt wrote and this one did not: its rows have left the batch
    # (deleted by an operator, or reopened); the archive keeps no copy of them.
    fs, base = layout.filesystem(root)
    for day in batch.days:
        for kind in (layout.MESSAGES, layout.DELIVERIES):
            path = f"{layout.partition(base, kind, batch.queue, day)}/{name}"
            if path not in written:
                layout.remove_file(fs, path)


def delete_archived(message_ids, delivery_ids):
    """Delete archived messages and their deliveries in one transaction; returns the
    (messages, deliveries) deleted. A message with a delivery that was not written (or is no
    longer acked) is kept, with its deliveries."""
    with transaction.atomic():
        # Row locks, messages then deliveries (PostgreSQL; SQLite's IMMEDIATE transactions are
        # serial anyway): a seek (ledger.replay) that reopened or added a delivery and committed
        # before is seen below, and one after waits for this commit and finds the rows gone.
        # Without them a delivery reopened between this read and the delete went with its
        # message, though the seek had reported it handed out again. NOWAIT: a seek under way
        # holds its deliveries and, at its commit, wants its messages (the foreign keys are
        # checked then), so waiting here while holding the messages would deadlock it; the
        # archive, which can come back, gives way instead (RowsBusy, _run_batch tries again).
        try:
            list(
                Message.objects.select_for_update(nowait=True)
                .filter(id__in=message_ids)
                .order_by("id")
                .values_list("id")
            )
            current = list(
                Delivery.objects.select_for_update(nowait=True)
                .filter(message_id__in=message_ids)
                .order_by("id")
                .values_list("id", "message_id", "status")
            )
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
                raise RowsBusy from exc
            raise
        keep = {mid for did, mid, status in current if did not in delivery_ids or status != Status.ACKED}
        gone = [mid for mid in message_ids if mid not in keep]
        # Deliveries first, then messages: the counts are what this transaction removed (a
        # concurrent run that got there first removes them itself and reports them).
        _, by_model = Delivery.objects.filter(message_id__in=gone).delete()
        deliveries = by_model.get(Delivery._meta.label, 0)
        _, by_model = Message.objects.filter(id__in=gone).delete()
    return by_model.get(Message._meta.label, 0), deliveries


@contextlib.contextmanager
def exclusive(root, wait_secs=0):
    """Hold the archive's lock: one archive run, compaction or analytics listing at a time per
    archive place. With `wait_secs`, tries again until then; raises ArchiveBusy if still held.

    Two archive runs at once could each write a file of the same name with different rows in
    it (their batches read at different moments), the second rename winning while both delete:
    rows would go that no file holds. Compaction swaps a partition's files for one, and a
    reader that listed them before must not find them gone. PostgreSQL: a transaction-level
    advisory lock (any host; _held_in_a_transaction says why); otherwise a file lock beside the
    database (SQLite is one machine's anyway). Neither is re-entrant.
    """
    root = str(root or settings.MQ_ARCHIVE_DIR)
    # One place, one lock, however it is named: "var/archive", its absolute path, a slash more.
    place = root.rstrip("/") if "://" in root else os.path.abspath(root)
    key = int.from_bytes(hashlib.sha256(f"mqsite.archive:{place}".encode()).digest()[:8], "big", signed=True)
    deadline = time.monotonic() + wait_secs
    if connection.vendor == "postgresql":
        with _held_in_a_transaction(key, root, deadline):
            yield
        return
    lock_dir = os.path.dirname(os.path.abspath(str(connection.settings_dict["NAME"])))
    path = os.path.join(lock_dir, f".archive-{key & 0xFFFFFFFF:08x}.lock")
    with open(path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                _wait_or_give_up(root, deadline)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _held_in_a_transaction(key, root, deadline):
    """pg_try_advisory_xact_lock in a transaction kept open, on a connection of its own, for as
    long as the block runs (its batches commit on the caller's connection meanwhile).

    Not a session lock (pg_advisory_lock): behind a pooler in transaction mode (PgBouncer's
    default) a session is not the client's between transactions, so the lock could be taken on
    one server connection and released on another (never, then), or another client's
    transaction could find it held. An open transaction keeps its server connection for
    itself, and its lock goes with it when it ends or its connection drops (a killed run holds
    nothing). Idle in a transaction at READ COMMITTED, it holds no snapshot and no transaction
    id: vacuum is not held back. idle_in_transaction_session_timeout, if an operator set one,
    is lifted for this transaction alone (SET LOCAL), which would otherwise end it mid-run."""
    holder = connections.create_connection(connection.alias)
    try:
        holder.set_autocommit(False)
        with holder.cursor() as cursor:
            cursor.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
            while True:
                cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [key])
                if cursor.fetchone()[0]:
                    break
                _wait_or_give_up(root, deadline)
        yield
    finally:
        try:
            holder.rollback()  # ends the transaction: the lock goes
        finally:
            holder.close()


def _wait_or_give_up(root, deadline):
    left = deadline - time.monotonic()
    if left <= 0:
        raise ArchiveBusy(f"another archive run is writing to {root}")
    time.sleep(min(LOCK_POLL_SECS, left))
