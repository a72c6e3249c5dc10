"""Extract: the hot tables to Parquet, so that the analytics job reads Parquet only.

hot_snapshot() reads the columns the job needs (layout.HOT_*_SCHEMA: no payload, headers or
errors), both tables at one instant, straight into Arrow; write_snapshot() writes them as
<root>/messages/part-0.parquet and <root>/deliveries/part-0.parquet.

    PostgreSQL: COPY (SELECT ...) TO STDOUT as CSV, parsed by pyarrow in blocks, in one
        REPEATABLE READ READ ONLY transaction: no Python object per row is kept, and every
        delivery's message is in the snapshot (the archive moves a message with its deliveries,
        publish makes them together).
    SQLite: the same SELECTs, fetched a chunk at a time into Arrow, in one read transaction.

The SQL is the ORM's, from the archive's own lookups (analytics.archive): a name means the
same in the archive and the snapshot.
"""

import contextlib
import functools
import io
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.csv as pacsv
from django.db import connection, transaction

from delivery.models import Delivery
from queues.models import Message

from . import layout
from .archive import DELIVERY_FIELDS, MESSAGE_FIELDS

# SQLite's rows per fetch: each chunk becomes an Arrow batch before the next is read.
CHUNK_ROWS = 50_000
# PostgreSQL's CSV is parsed a block at a time (pyarrow's default size, its unit of parallel work).
CSV_BLOCK_BYTES = 1 << 20
SNAPSHOT_FILE = "part-0.parquet"


@dataclass(frozen=True)
class HotSnapshot:
    """The hot tables at one instant: layout.HOT_MESSAGE_SCHEMA and HOT_DELIVERY_SCHEMA."""

    messages: pa.Table
    deliveries: pa.Table


def _lookups(hot_schema, archive_schema, archive_fields):
    """The ORM lookup of each snapshot column: the archive's for the same column (events and
    subscribers by the delivery's own keys, as the archive names them), and the queue's name."""
    by_column = dict(zip(archive_schema.names, archive_fields, strict=True))
    # A delivery's queue is a copy of its message's (the fan-out makes it): no join to messages.
    by_column["queue"] = "queue__name"
    return tuple(by_column[name] for name in hot_schema.names)


MESSAGE_LOOKUPS = _lookups(layout.HOT_MESSAGE_SCHEMA, layout.MESSAGE_SCHEMA, MESSAGE_FIELDS)
DELIVERY_LOOKUPS = _lookups(layout.HOT_DELIVERY_SCHEMA, layout.DELIVERY_SCHEMA, DELIVERY_FIELDS)


def hot_snapshot():
    """Every message and delivery now in the hot tables, columns only, both from one snapshot.

    Call it outside a transaction: it opens its own. Inside one (transaction.atomic) it reads
    in the caller's, which then decides what is seen: on PostgreSQL at READ COMMITTED each of
    the two statements sees its own instant.
    """
    read = _read_copy if connection.vendor == "postgresql" else _read_rows
    with _one_snapshot() as cursor:
        messages = read(cursor, _select(Message, MESSAGE_LOOKUPS), layout.HOT_MESSAGE_SCHEMA)
        deliveries = read(cursor, _select(Delivery, DELIVERY_LOOKUPS), layout.HOT_DELIVERY_SCHEMA)
    return HotSnapshot(messages=messages, deliveries=deliveries)


def write_snapshot(root, snapshot):
    """Write a HotSnapshot under `root` (plain Parquet, one file per table, for Spark); returns
    the paths. Not fsynced: a snapshot lost in a crash is taken again."""
    return [
        layout.write_table(root, layout.MESSAGES, SNAPSHOT_FILE, snapshot.messages, durable=False),
        layout.write_table(root, layout.DELIVERIES, SNAPSHOT_FILE, snapshot.deliveries, durable=False),
    ]


def _select(model, lookups):
    # No ordering: the models' default ones would join and sort millions of rows for nothing.
    query = model.objects.order_by().values_list(*lookups).query
    return query.get_compiler(connection=connection).as_sql()


@contextlib.contextmanager
def _one_snapshot():
    """A cursor whose statements all see the database at one instant."""
    if connection.in_atomic_block:
        with connection.cursor() as cursor:
            yield cursor
    elif connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield cursor
    else:
        # SQLite: a deferred transaction, which in WAL mode reads one snapshot and takes no
        # lock; transaction.atomic() would BEGIN IMMEDIATE (the settings' transaction_mode)
        # and hold every publish and ack of the process back until the read is done.
        with connection.cursor() as cursor:
            cursor.execute("BEGIN DEFERRED")
            try:
                yield cursor
            finally:
                cursor.execute("ROLLBACK")


def _read_rows(cursor, select, schema):
    sql, params = select
    cursor.execute(sql, params)
    batches = []
    while rows := cursor.fetchmany(CHUNK_ROWS):
        # Timestamps come as naive datetimes in UTC (Django's converter of SQLite's text),
        # which pyarrow takes as UTC for a UTC column.
        columns = zip(*rows, strict=True)
        batches.append(
            pa.record_batch(
                [pa.array(values, type=field.type) for values, field in zip(columns, schema, strict=True)],
                schema=schema,
            )
        )
    return pa.Table.from_batches(batches, schema=schema)


def _read_copy(cursor, select, schema):
    sql, params = select
    copy_sql = f"COPY ({sql}) TO STDOUT (FORMAT csv)"

    def copy(sql, params, many, context):
        with connection.wrap_database_errors, context["cursor"].cursor.copy(sql, params or None) as rows:
            return _csv_table(_CopyStream(rows), schema)

    with _timestamps_in_iso(cursor):
        return _execute_with_wrappers(cursor, copy_sql, params, copy)


@contextlib.contextmanager
def _timestamps_in_iso(cursor):
    """PostgreSQL writes timestamps as DateStyle says: ISO is what pyarrow parses, with the
    zone offset it prints (UTC, as Django sets the connection's). Set for the statement's
    transaction only, and put back after for a caller's transaction."""
    cursor.execute("SELECT current_setting('DateStyle'), set_config('DateStyle', 'ISO', true)")
    before = cursor.fetchone()[0]
    try:
        yield
    finally:
        cursor.execute("SELECT set_config('DateStyle', %s, true)", [before])


def _execute_with_wrappers(cursor, sql, params, executor):
    """Run `executor` as Django runs a statement: through connection.execute_wrapper()'s hooks
    and, when queries are logged, into connection.queries. psycopg's copy() is not a cursor's
    execute(), so Django would see neither; instrumentation and tests that watch the SQL would
    miss the one statement that reads the most. (What CursorWrapper._execute_with_wrappers
    does, from Django's documented wrapper signature.)"""
    context = {"connection": connection, "cursor": cursor}
    for wrapper in reversed(connection.execute_wrappers):
        executor = functools.partial(wrapper, executor)
    logged = cursor.debug_sql(sql, params) if connection.queries_logged else contextlib.nullcontext()
    with logged:
        return executor(sql, params, False, context)


# pyarrow's CSV reader, told each column's type: exact to the microsecond, an unquoted empty
# field (PostgreSQL's NULL in CSV) a null, a quoted one ("") an empty string, and a name may
# hold commas, quotes or newlines.
_CSV_PARSE = pacsv.ParseOptions(newlines_in_values=True)


def _csv_table(stream, schema):
    convert = pacsv.ConvertOptions(
        column_types=dict(zip(schema.names, schema.types, strict=True)),
        null_values=[""],
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
    )
    try:
        table = pacsv.read_csv(
            stream,
            read_options=pacsv.ReadOptions(column_names=schema.names, block_size=CSV_BLOCK_BYTES),
            parse_options=_CSV_PARSE,
            convert_options=convert,
        )
    except pa.ArrowInvalid:
        if stream.bytes_read == 0:  # no rows: pyarrow's "Empty CSV file"
            return schema.empty_table()
        raise
    return table.cast(schema)


class _CopyStream(io.RawIOBase):
    """A COPY TO's output as a file pyarrow reads in blocks. PostgreSQL sends a message per
    row, which psycopg hands over one by one; they are gathered a block at a time here, into
    one buffer (keeping psycopg's views of the rows instead was four times slower: each holds
    a libpq buffer of its own)."""

    def __init__(self, copy):
        self._rows = iter(copy)
        self._buffer = bytearray()
        self.bytes_read = 0

    def readable(self):
        return True

    def read(self, size=-1):
        buffer = self._buffer
        while size < 0 or len(buffer) < size:
            row = next(self._rows, None)
            if row is None:
                break
            buffer += row
        if size < 0 or len(buffer) <= size:
            data = bytes(buffer)
            buffer.clear()
        else:  # what is left is less than a row
            data = bytes(buffer[:size])
            del buffer[:size]
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer):
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
