"""Django's SQLite backend, with a process's write transactions queued on a lock.

SQLite has one writer at a time. A transaction that finds the write lock taken waits in
SQLite's busy handler, which sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between tries whatever
happens meanwhile: with the publishes, leases and acks of one server process all writing, a
waiter often slept tens of milliseconds past the moment the lock came free, which was most of
the embedded mode's latency tail (bench/PROFILE.md section 8). Within a process, write
transactions now take a lock first, and the next one starts the moment the last commits; only
the other process (the Celery worker) still meets SQLite's busy handler.

Writes outside a transaction (autocommit statements) take the same lock, through `writing()`.

Its test: tests/mqsite/test_sqlite_writer.py. It can go when Django's SQLite backend queues a process's
writers itself, or SQLite's busy handler wakes a waiter when the lock frees instead of sleeping
on a fixed schedule.
"""

import threading
from contextlib import contextmanager

from django.db import OperationalError
from django.db.backends.sqlite3 import base

_writer = threading.Lock()


class DatabaseWrapper(base.DatabaseWrapper):
    _holds_writer = False

    def _start_transaction_under_autocommit(self):
        self._take_writer()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._release_writer()
            raise

    # A commit, a rollback or a close ends the transaction: the next writer may start.
    def _commit(self):
        return self._ending(super()._commit)

    def _rollback(self):
        return self._ending(super()._rollback)

    def _close(self):
        return self._ending(super()._close)

    def _ending(self, end):
        try:
            return end()
        finally:
            self._release_writer()

    def _take_writer(self):
        if not self._holds_writer:
            # As long as SQLite itself would wait (the `timeout` option), and the same error.
            if not _writer.acquire(timeout=self.settings_dict["OPTIONS"].get("timeout", 5)):
                raise OperationalError("database is locked (by a write transaction of this process)")
            self._holds_writer = True

    def _release_writer(self):
        if self._holds_writer:
            self._holds_writer = False
            _writer.release()

    @contextmanager
    def writing(self):
        """Hold the process's write lock around a write outside a transaction."""
        if self.in_atomic_block or self._holds_writer:
            yield
            return
        self._take_writer()
        try:
            yield
        finally:
            self._release_writer()


class DatabaseOperations(base.DatabaseOperations):
    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        """Empty the kept counts last: on SQLite the delete triggers of the other tables
        (delivery migration 0010) append to them while those are emptied (PostgreSQL's
        TRUNCATE fires no delete trigger)."""
        statements = super().sql_flush(
            style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
        last = [s for s in statements if "delivery_tally" in s]
        return [s for s in statements if "delivery_tally" not in s] + last


DatabaseWrapper.ops_class = DatabaseOperations
