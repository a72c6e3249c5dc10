"""The relay: sends the outbox's waiting rows in id order, in batches, each with its row's key
as the publish's idempotency key, and marks them sent only once the server has confirmed them.

What each crash leaves:
- killed before the publish reached the server: the rows are still waiting; the next relay
  sends them.
- killed after the server kept them but before they were marked sent: still waiting; the next
  relay sends them again with the same keys, and the server answers the messages it already
  has (docs/concepts.md: idempotency keys) — nothing is published twice.
- two relays at once: only the one holding the lock sends (rows locked FOR UPDATE on a real
  database, a file lock on SQLite), so batches never overtake each other.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

from django.db import connections, transaction
from django.utils import timezone

from .. import Client, MQBadRequest, MQError
from . import conf

try:
    import fcntl
except ImportError:  # Windows: SQLite's relays are kept apart within one process only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("mqclient.django.relay")


class RelayFailed(Exception):
    """The server could not be reached, or refused a batch for a reason that may pass (a 5xx,
    a 429, a token not accepted yet): try again after a backoff."""


@dataclasses.dataclass
class Drained:
    sent: int = 0
    refused: int = 0
    busy: bool = False  # another relay holds the lock: it sends what this one found


def drain(using: str = "default", client: Client | None = None) -> Drained:
    """Send every waiting row of database `using`, a batch at a time. Raises RelayFailed (the
    rows keep their error) when the server cannot take the head of the outbox."""
    from .models import OutboxMessage

    done = Drained()
    own_client = client is None
    client = client or Client(conf.need("URL"), conf.need("TOKEN"), timeout=conf.get("TIMEOUT_SECS"))
    try:
        while True:
            with _relay_lock(using) as held:
                if not held:
                    done.busy = True
                    return done
                rows = _head_of_outbox(OutboxMessage, using)
                if not rows:
                    return done
                sent, refused, failure = _send(client, using, rows)
            done.sent += sent
            done.refused += refused
            # Raised once the lock's transaction has committed the rows' error.
            if failure is not None:
                raise RelayFailed(str(failure)) from failure
    finally:
        if own_client:
            client.close()


def _head_of_outbox(model, using: str) -> list:
    """The oldest waiting rows that go to one queue (a batch publishes to one queue)."""
    waiting = model.objects.using(using).filter(status=model.Status.WAITING).order_by("id")
    rows = list(waiting[: conf.get("RELAY_BATCH")])
    for i, row in enumerate(rows):
        if row.queue != rows[0].queue:
            return rows[:i]
    return rows


def _send(client: Client, using: str, rows: list) -> tuple[int, int, MQError | None]:
    """Publish `rows` (one queue) as one batch: (sent, refused, the error that stopped it). A
    batch the server refuses as bad (all or nothing) is sent again row by row, so that one bad
    row is refused alone."""
    try:
        answers = client.publish_many(rows[0].queue, [r.as_message() for r in rows])
    except MQBadRequest as exc:
        if len(rows) > 1:
            sent = refused = 0
            for row in rows:
                s, r, failure = _send(client, using, [row])
                sent, refused = sent + s, refused + r
                if failure is not None:
                    return sent, refused, failure
            return sent, refused, None
        _mark_refused(using, rows[0], exc)
        return 0, 1, None
    except MQError as exc:
        _mark_failed(using, rows, exc)
        return 0, 0, exc
    log.debug("published outbox rows %s..%s; marking them sent", rows[0].id, rows[-1].id)
    _mark_sent(using, rows, answers)
    return len(rows), 0, None


def _mark_sent(using: str, rows: list, answers: list) -> None:
    from .models import OutboxMessage

    now = timezone.now()
    with transaction.atomic(using=using):
        for row, answer in zip(rows, answers, strict=True):
            OutboxMessage.objects.using(using).filter(id=row.id).update(
                status=OutboxMessage.Status.SENT,
                sent_at=now,
                message_id=answer.get("id"),
                attempts=row.attempts + 1,
                last_error="",
            )


def _mark_refused(using: str, row, exc: MQError) -> None:
    from .models import OutboxMessage

    log.error(
        "outbox row %s (%s/%s) refused by the server, never sent: %s", row.id, row.queue, row.event, exc
    )
    OutboxMessage.objects.using(using).filter(id=row.id).update(
        status=OutboxMessage.Status.REFUSED, attempts=row.attempts + 1, last_error=str(exc)[:2000]
    )


def _mark_failed(using: str, rows: list, exc: MQError) -> None:
    from django.db.models import F

    from .models import OutboxMessage

    log.warning(
        "outbox rows %s..%s (%s) not sent, will retry: %s", rows[0].id, rows[-1].id, rows[0].queue, exc
    )
    OutboxMessage.objects.using(using).filter(id__in=[r.id for r in rows]).update(
        attempts=F("attempts") + 1, last_error=str(exc)[:2000]
    )


# --- the lock ---------------------------------------------------------------------------------

_memory_locks: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def _relay_lock(using: str) -> Iterator[bool]:
    """Held while one batch is sent and marked: True when this relay holds it, False when
    another does (this one then leaves the rows to it)."""
    connection = connections[using]
    if connection.vendor == "sqlite":
        with _sqlite_lock(connection.settings_dict["NAME"]) as held:
            yield held
        return
    # The lock row stays locked through the publish (an HTTP call of at most TIMEOUT_SECS):
    # that is the point, a second relay must not send the rows behind this batch before it.
    # SKIP LOCKED: the second relay does not queue up behind the first, it leaves.
    from .models import RelayLock

    with transaction.atomic(using=using):
        lock = RelayLock.objects.using(using).select_for_update(skip_locked=True).filter(pk=1).first()
        yield lock is not None


@contextlib.contextmanager
def _sqlite_lock(name: object) -> Iterator[bool]:
    path = str(name)
    in_memory = path == ":memory:" or path.startswith("file::memory:") or "mode=memory" in path
    if in_memory or fcntl is None:
        lock = _memory_locks.setdefault(path, threading.Lock())
        held = lock.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                lock.release()
        return
    # A file lock beside the database: other processes on the machine (SQLite's only users) see
    # it, and the kernel drops it when the holder dies, even by SIGKILL.
    fd = os.open(path + ".mqrelay.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        # flock is per open file, so a second thread of this process is kept out too.
        yield True
    finally:
        os.close(fd)


# --- retention --------------------------------------------------------------------------------


# How often a relay (the command, or a process's thread) deletes what is past its retention.
PURGE_EVERY_SECS = 60


def purge(using: str = "default") -> tuple[int, int]:
    """Delete sent rows older than OUTBOX_RETENTION_SECS and handled delivery ids older than
    RECEIVED_RETENTION_SECS: (rows, ids) deleted."""
    from .models import OutboxMessage, ReceivedDelivery

    now = timezone.now()
    rows, _ = (
        OutboxMessage.objects.using(using)
        .filter(
            status=OutboxMessage.Status.SENT,
            sent_at__lt=now - timedelta(seconds=conf.get("OUTBOX_RETENTION_SECS")),
        )
        .delete()
    )
    ids, _ = (
        ReceivedDelivery.objects.using(using)
        .filter(received_at__lt=now - timedelta(seconds=conf.get("RECEIVED_RETENTION_SECS")))
        .delete()
    )
    return rows, ids


def backoff_secs(failures: int) -> float:
    """1 s, doubling, at most RELAY_MAX_BACKOFF_SECS."""
    return min(2.0 ** max(failures - 1, 0), float(conf.get("RELAY_MAX_BACKOFF_SECS")))


# --- the thread that sends after each commit -----------------------------------------------------


class _Sender:
    """One daemon thread a process (made again after a fork): woken by each commit that wrote
    outbox rows, it drains those databases; while the server fails it retries with backoff.
    At exit the process waits a little for it (a management command or a script commits and
    ends at once); a process that dies with rows unsent leaves them to `manage.py mqrelay`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.wake = threading.Event()
        self.idle = threading.Event()  # nothing pending, nothing failing
        self.pending: set[str] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, name="mqclient-relay", daemon=True)
        self.thread.start()

    def add_all(self, aliases: set[str]) -> None:
        with self.lock:
            self.pending |= aliases
            self.idle.clear()
        self.wake.set()

    def add(self, using: str) -> None:
        self.add_all({using})

    def run(self) -> None:
        failures = 0
        purged_at: dict[str, float] = {}
        while True:
            self.wake.wait(backoff_secs(failures) if failures else None)
            self.wake.clear()
            with self.lock:
                aliases, self.pending = set(self.pending), set()
            failed, busy = set(), set()
            for using in aliases:
                try:
                    if drain(using).busy:
                        busy.add(using)
                    if time.monotonic() - purged_at.get(using, float("-inf")) > PURGE_EVERY_SECS:
                        purge(using)
                        purged_at[using] = time.monotonic()
                except RelayFailed:
                    failed.add(using)
                except Exception:  # a bug or a database error: logged, the mqrelay command retries
                    log.exception("the outbox relay thread failed on database %s", using)
                finally:
                    connections[using].close()
            failures = failures + 1 if failed else 0
            with self.lock:
                self.pending |= failed
                if not self.pending and not busy:
                    self.idle.set()
            if busy and not failed:
                # Another relay holds the lock; it may have looked before this commit's rows
                # were there, so look again shortly rather than leave them to mqrelay.
                time.sleep(BUSY_RECHECK_SECS)
                self.add_all(busy)

    def wait_idle(self, timeout: float) -> bool:
        return self.idle.wait(timeout)


# How soon a relay thread that found the lock held looks again.
BUSY_RECHECK_SECS = 0.5

_sender: _Sender | None = None
_sender_lock = threading.Lock()


def kick(using: str) -> None:
    """After a commit that wrote outbox rows: have this process's relay thread send them."""
    global _sender
    if not conf.get("RELAY_ON_COMMIT"):
        return
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid():
            _sender = _Sender()
    _sender.add(using)


@atexit.register
def _send_before_exit() -> None:
    """Give the relay thread up to RELAY_EXIT_WAIT_SECS to send what this process committed:
    daemon threads are stopped at exit, and a short-lived process would otherwise leave its
    rows to mqrelay."""
    sender = _sender
    if sender is not None and sender.pid == os.getpid():
        try:
            wait = float(conf.get("RELAY_EXIT_WAIT_SECS"))
        except Exception:  # settings gone at exit: do not wait
            return
        sender.wait_idle(wait)
