"""One model row by a plain SQL condition, for the lookups every request makes, and a cache
of such rows in the process."""

import contextlib
import functools
import threading
import time

from django.conf import settings
from django.db import connection

from . import adb


def writing():
    """The process's SQLite write lock (mqsite/workarounds/sqlite) around a write made outside a
    transaction; nothing on other databases."""
    lock = getattr(connection, "writing", None)
    return lock() if lock is not None else contextlib.nullcontext()


def first(model, where, params):
    """The first `model` instance whose row meets the SQL condition `where` (with `params`),
    or None: model.objects.filter(...).first() without the ORM building the query each time,
    which cost more CPU than running it (the token and the queue of every request, a third of
    a single publish's time in Daphne: bench/PROFILE.md). The values go through the same
    converters the ORM applies (SQLite's text datetimes and integer booleans)."""
    values = _first_values(model, where, params)
    return None if values is None else model.from_db(connection.alias, None, values)


def first_statement(model, where, params):
    """first() as a sans-I/O operation, for either driver (mqsite/adb.py)."""
    values = yield from first_values_statement(model, where, params)
    return None if values is None else model.from_db(connection.alias, None, values)


def _first_values(model, where, params):
    return adb.run_sync(first_values_statement(model, where, params))


def first_values_statement(model, where, params):
    """The converted values of the first row, or None (sans-I/O)."""
    columns, converters = _shape(model, connection.vendor)
    found = yield f"SELECT {columns} FROM {model._meta.db_table} WHERE {where} LIMIT 1", params
    if not found:
        return None
    values = list(found[0])
    for i, expression, convert in converters:
        values[i] = convert(values[i], expression, connection)
    return values


class Kept:
    """Answers kept in this process by key, for the lookups every request makes, which each
    cost a round trip to the database: Cached's rows (below), and the publish grants
    (subscribers.models).

    Whoever changes what an answer says calls forget() in every process (delivery.revocation,
    through the bus's `changed` words), so a change holds from the next request on. A change
    no announcement told of (one made by a process without Redis, a queryset update, a word
    Redis lost) holds once the answer is MQ_REVOCATION_CHECK_SECS old here, the bound the
    sockets' periodic token check keeps too. An answer read before a forget() and stored after
    it is not kept (the forget() counts), so a change is never hidden by a lookup that raced
    it. Callers keep only answers that a new row could change without a forget() (a token or
    queue found, a grant given), so what is new is seen at once."""

    MAX_ROWS = 10_000

    def __init__(self):
        self._lock = threading.Lock()
        self._rows = {}  # key -> (value, monotonic time it is kept until)
        self._forgotten = 0  # how many times forget() ran

    def kept(self, key):
        """(the value kept for key, or None; the forget() count to keep a miss's answer by)."""
        with self._lock:
            kept, forgotten = self._rows.get(key), self._forgotten
        return (kept[0] if kept is not None and kept[1] > time.monotonic() else None), forgotten

    def keep(self, key, value, forgotten):
        """Keep `value` (None: nothing) for `key`, unless forget() ran since `forgotten` was read."""
        if value is None:
            return
        with self._lock:
            if self._forgotten == forgotten:
                if len(self._rows) >= self.MAX_ROWS:
                    self._rows.clear()
                self._rows[key] = (value, time.monotonic() + settings.MQ_REVOCATION_CHECK_SECS)

    def forgotten(self):
        """How many times forget() ran: a caller that read a row before a wait and must know
        whether it changed meanwhile compares this before and after."""
        with self._lock:
            return self._forgotten

    def forget(self):
        """Every answer: changes are rare (an operator's, a rotation), lookups are not."""
        with self._lock:
            self._forgotten += 1
            self._rows.clear()


class Cached(Kept):
    """rows.first() by one key (a token's hash, a queue's name), kept in this process (Kept).
    Only rows found are kept (a new token or queue is seen at once); each caller gets an
    instance of its own."""

    def __init__(self, model, where, params=lambda key: [key]):
        super().__init__()
        self.model, self.where, self.params = model, where, params

    def first(self, key):
        values, forgotten = self.kept(key)
        if values is None:
            values = _first_values(self.model, self.where, self.params(key))
            self.keep(key, values, forgotten)
        return None if values is None else self.model.from_db(connection.alias, None, list(values))

    async def afirst(self, key):
        """first() from the event loop (mqsite/adb.py's driver for a miss)."""
        values, forgotten = self.kept(key)
        if values is None:
            values = await adb.run(first_values_statement(self.model, self.where, self.params(key)))
            self.keep(key, values, forgotten)
        return None if values is None else self.model.from_db(connection.alias, None, list(values))


@functools.cache
def _shape(model, vendor):
    """The column list of the model's concrete fields, and their converters on this backend."""
    fields = model._meta.concrete_fields
    table = model._meta.db_table
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    converters = []
    for i, field in enumerate(fields):
        expression = field.get_col(table)
        for convert in connection.ops.get_db_converters(expression) + field.get_db_converters(connection):
            converters.append((i, expression, convert))
    return columns, converters
