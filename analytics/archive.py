"""The archive: acked history leaves the hot tables for Parquet under MQ_ARCHIVE_DIR.

A message moves, with its deliveries, once it is older than its queue's retention (or than
the days asked for) and every one of its deliveries is acked, or it has none. A message with a
pending, in-flight or dead delivery stays, and so do those deliveries.

Order of work, per batch of messages: read the rows, write their Parquet files completely and
durably (analytics.layout), and only then delete the rows, in one transaction. A crash between
the two leaves the batch both in Parquet and in the hot tables: nothing is lost, the next run
writes the same files again under the same names (overwriting, not adding copies) and deletes
the rows; until then the analytics job counts each id once (it dedupes by id).

Acked is a final state (the ledger never moves an acked delivery) and deliveries are made only
at publish, so a message that was archivable when read is still archivable at the delete; the
delete checks it again all the same.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from delivery.models import Delivery, Status
from queues.models import Message, Queue

from . import layout

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


class ArchiveBusy(RuntimeError):
    """Another archive run holds the lock."""


def archive_history(
    *, older_than_days=None, now=None, root=None, batch_size=BATCH_MESSAGES, budget_secs=None
):
    """Move archivable history to Parquet; returns {"messages": n, "deliveries": n} moved.

    `older_than_days` replaces each queue's retention (0: everything acked, whatever its age).
    With `budget_secs`, stops after the batch that passes it (the next run goes on from there).
    Raises ArchiveBusy when another run is archiving into the same place.
    """
    now = now or timezone.now()
    root = str(root or settings.MQ_ARCHIVE_DIR)
    started = time.monotonic()
    moved = {"messages": 0, "deliveries": 0}
    with _exclusive(root):
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
                messages, deliveries = archive_batch(root, queue, ids)
                moved["messages"] += messages
                moved["deliveries"] += deliveries
                after = ids[-1]
                if budget_secs is not None and time.monotonic() - started > budget_secs:
                    log.info("archive: budget of %s s spent, the next run goes on", budget_secs)
                    return moved
    return moved


def archivable(queue, cutoff):
    """The queue's messages older than `cutoff` whose deliveries are all acked (or none)."""
    unsettled = Delivery.objects.filter(message_id=OuterRef("pk")).exclude(status=Status.ACKED)
    return Message.objects.filter(queue=queue, created_at__lt=cutoff).filter(~Exists(unsettled))


def archive_batch(root, queue, ids):
    """Write these messages and their deliveries to Parquet, then delete them. Returns the
    (messages, deliveries) deleted."""
    messages = list(Message.objects.filter(id__in=ids).order_by("id").values_list(*MESSAGE_FIELDS))
    deliveries = list(
        Delivery.objects.filter(message_id__in=ids).order_by("id").values_list(*DELIVERY_FIELDS)
    )
    if any(d[5] != Status.ACKED for d in deliveries):
        # Not reachable through the ledger (acked is final); never archive an open delivery.
        unsettled = {d[1] for d in deliveries if d[5] != Status.ACKED}
        messages = [m for m in messages if m[0] not in unsettled]
        deliveries = [d for d in deliveries if d[1] not in unsettled]
    if not messages:
        return 0, 0
    # The files are complete and on disk before a single row goes.
    layout.write_history(root, queue.name, messages, deliveries, durable=True)
    return delete_archived([m[0] for m in messages], {d[0] for d in deliveries})


def delete_archived(message_ids, delivery_ids):
    """Delete archived messages and their deliveries in one transaction; returns the
    (messages, deliveries) deleted. A message with a delivery that was not written (or is no
    longer acked) is kept, with its deliveries."""
    with transaction.atomic():
        current = Delivery.objects.filter(message_id__in=message_ids).values_list(
            "id", "message_id", "status"
        )
        keep = {mid for did, mid, status in current if did not in delivery_ids or status != Status.ACKED}
        gone = [mid for mid in message_ids if mid not in keep]
        # Deliveries first, then messages: the counts are what this transaction removed (a
        # concurrent run that got there first removes them itself and reports them).
        _, by_model = Delivery.objects.filter(message_id__in=gone).delete()
        deliveries = by_model.get(Delivery._meta.label, 0)
        _, by_model = Message.objects.filter(id__in=gone).delete()
    return by_model.get(Message._meta.label, 0), deliveries


@contextlib.contextmanager
def _exclusive(root):
    """One archive run at a time per archive place.

    Two runs at once could each write a file of the same name with different rows in it (their
    batches read at different moments), the second rename winning while both delete: rows
    would go that no file holds. PostgreSQL: a session advisory lock (any host); otherwise a
    file lock beside the database (SQLite is one machine's anyway).
    """
    key = int.from_bytes(hashlib.sha256(f"mqsite.archive:{root}".encode()).digest()[:8], "big", signed=True)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            if not cursor.fetchone()[0]:
                raise ArchiveBusy(f"another archive run is writing to {root}")
        try:
            yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
        return
    lock_dir = os.path.dirname(os.path.abspath(str(connection.settings_dict["NAME"])))
    path = os.path.join(lock_dir, f".archive-{key & 0xFFFFFFFF:08x}.lock")
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchiveBusy(f"another archive run is writing to {root}") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
