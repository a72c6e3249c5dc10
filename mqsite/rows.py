"""One model row by a plain SQL condition, for the lookups every request makes."""

import contextlib
import functools

from django.db import connection

from . import adb


def writing():
    """The process's SQLite write lock (mqsite/sqlite) around a write made outside a
    transaction; nothing on other databases."""
    lock = getattr(connection, "writing", None)
    return lock() if lock is not None else contextlib.nullcontext()


def first(model, where, params):
    """The first `model` instance whose row meets the SQL condition `where` (with `params`),
    or None: model.objects.filter(...).first() without the ORM building the query each time,
    which cost more CPU than running it (the token and the queue of every request, a third of
    a single publish's time in Daphne: bench/PROFILE.md). The values go through the same
    converters the ORM applies (SQLite's text datetimes and integer booleans)."""
    return adb.run_sync(first_statement(model, where, params))


def first_statement(model, where, params):
    """first() as a sans-I/O operation, for either driver (mqsite/adb.py)."""
    columns, converters = _shape(model, connection.vendor)
    found = yield f"SELECT {columns} FROM {model._meta.db_table} WHERE {where} LIMIT 1", params
    if not found:
        return None
    values = list(found[0])
    for i, expression, convert in converters:
        values[i] = convert(values[i], expression, connection)
    return model.from_db(connection.alias, None, values)


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
