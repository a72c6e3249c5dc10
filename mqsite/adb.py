"""Two drivers for one statement: the socket's hot operations run on the event loop, the rest of
the code calls them as plain sync Django, and each SQL statement is written once.

An operation is written "sans I/O", as a generator: it yields `(sql, params)` for each
statement and is sent back the statement's rows (a list of tuples; the row count for a
statement that returns none), and its return value is the operation's result. It decides
nothing about connections or transactions: its caller does.

- run_sync(op) runs it on Django's connection (inside the caller's transaction.atomic()
  when there is one), for the admin, Celery, commands, REST and the embedded mode;
- await run(op) runs it on an async psycopg connection from this process's pool, on the
  event loop, with no thread in between (the services mode, PostgreSQL); `async with
  transaction()` gives an operation that needs several statements its own transaction.

Django's connection binds parameters on the client; the async pool binds them on the server
and prepares each statement it runs again (_Pool), so that PostgreSQL plans it once per
connection rather than on every call (0.5 to 0.8 ms a statement). One SQL text with `%s`
placeholders means the same on both: a statement's text must not depend on its values, or
each variant is planned anew (one_of() writes a set of values as one array parameter), and
each parameter must have a type PostgreSQL can infer from where it stands (a bare `%s` in a
SELECT list is text). Datetimes come back aware (UTC) on both, and errors are Django's (an
IntegrityError is django.db.IntegrityError on both paths).

Side effects after commit are the caller's: on the sync path transaction.on_commit(), on the
async path simply the next line after the commit (mqsite.bus.send()).
"""

import asyncio
import contextlib
import functools
import json
import logging
import weakref

from channels.db import DatabaseSyncToAsync
from django.conf import settings
from django.db import NotSupportedError, connection, connections

log = logging.getLogger(__name__)

# Event loop -> its pool. A pool's connections and workers belong to the loop that opened it:
# a server process has one loop; tests open one per test (close_pools() ends them).
_pools = weakref.WeakKeyDictionary()


def enabled():
    """Whether the hot operations run on the async connection: PostgreSQL, unless
    MQ_ASYNC_DB=false. SQLite has one writer at a time (mqsite/workarounds/sqlite), queued on a lock of
    threads: there they run in a thread, as the rest of the code does."""
    return settings.MQ_ASYNC_DB and connection.vendor == "postgresql"


def thread(fn):
    """`fn` (sync, using Django's connection) as a coroutine function run in a pool thread,
    its connection returned after each call (the consumer's db() does the same)."""
    return DatabaseSyncToAsync(fn, thread_sensitive=False)


def twin(sync_fn):
    """Decorate the async twin of `sync_fn` (its arguments the same): where the async
    connection is off (not enabled(): SQLite, MQ_ASYNC_DB=false) the twin is `sync_fn` in a
    thread; else its own body runs, on the event loop. The one guard every twin needs."""

    def decorate(afn):
        @functools.wraps(afn)
        async def either(*args, **kwargs):
            if not enabled():
                return await thread(sync_fn)(*args, **kwargs)
            return await afn(*args, **kwargs)

        return either

    return decorate


def one_of(column, values, unbounded=False):
    """SQL for `column` being one of `values`, and its parameters (a list), for a statement of
    either driver. On PostgreSQL one text whatever the number of values, so that the pool
    prepares it once: `= %s` for one value (the planner then reads an index in its order, as it
    does for an IN list of one: a lease's ORDER BY seq LIMIT stops at the first rows, where
    `= ANY` of one subscription read and sorted its whole backlog), else `= ANY(%s)` with the
    list as one array parameter (PostgreSQL turns an IN list into that anyway). On SQLite, which
    has no arrays, an IN list of one placeholder per value; `unbounded` (a client's frame of
    any number of ids), one JSON list, which SQLite's limit of parameters cannot refuse. An
    empty list matches nothing. Ints go as the smallest array type that holds them (int2[] to
    int8[]: each a prepared statement of its own, all using bigint indexes); ids past bigint
    must be left out first (mqsite.values.is_db_id), or PostgreSQL compares them as numeric and
    reads the whole table."""
    values = list(values)
    if connection.vendor != "postgresql":
        if unbounded:
            return f"{column} IN (SELECT value FROM json_each(%s))", [json.dumps(values)]
        return f"{column} IN ({', '.join(['%s'] * len(values))})", values
    if len(values) == 1:
        return f"{column} = %s", values
    return f"{column} = ANY(%s)", [values]


def run_sync(op):
    """Run a sans-I/O operation on Django's connection; its result. On PostgreSQL its
    statements are prepared, as on the async pool (_prepared_cursor)."""
    rows = None
    with _prepared_cursor() as cursor:
        while True:
            try:
                sql, params = op.send(rows)
            except StopIteration as stop:
                return stop.value
            _execute_sync(cursor, sql, params)
            rows = cursor.fetchall() if cursor.description is not None else cursor.rowcount


def _prepared_cursor():
    """A cursor of Django's connection (its checks, its query log, its errors) that binds on the
    server and prepares what it runs again, on PostgreSQL; Django's own cursor elsewhere.

    Django's cursors bind on the client, and Django turns psycopg's prepared statements off, so
    PostgreSQL planned the hot statements of REST calls (a publish, a lease, an ack, a token or
    queue looked up) on every call, as the async pool's did before it prepared them (0.5 to
    0.8 ms a statement). Only the operations written for both drivers run on this cursor, whose
    texts are fit for it (the module's docstring); the rest of the code keeps Django's cursors,
    which never prepare (client-side binding), whatever the connection's threshold. The
    prepared statements belong to the pooled connection's server session, as the async pool's;
    with MQ_DB_PREPARE off (a transaction-mode pooler in between), Django's own cursor. While
    queries are logged (DEBUG, a test that captures them), Django's own cursor: its log shows a
    statement with its values, which Django cannot compose from a server-binding cursor's
    prepared statement."""
    if connection.vendor != "postgresql" or connection.queries_logged or not settings.MQ_DB_PREPARE:
        return connection.cursor()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        raw = connection.connection
        if raw.prepare_threshold is None:
            raw.prepare_threshold = PREPARE_THRESHOLD
        return connection._prepare_cursor(_server_binding_cursor()(raw))


@functools.cache
def _server_binding_cursor():
    from django.db.backends.postgresql.base import ServerBindingCursor

    return ServerBindingCursor


def _execute_sync(cursor, sql, params):
    """_execute() on Django's connection: a statement prepared before a schema change made it
    stale is run again, unprepared, in autocommit."""
    try:
        cursor.execute(sql, params)
    except NotSupportedError as exc:  # Django's name for psycopg's FeatureNotSupported
        if not _stale_plan(exc) or connection.vendor != "postgresql" or connection.in_atomic_block:
            raise
        cursor.execute("DEALLOCATE ALL")  # psycopg forgets its names with it
        cursor.execute(sql, params)


def _stale_plan(exc):
    return "cached plan must not change result type" in str(exc)


async def run(op, conn=None):
    """Run a sans-I/O operation on an async connection (`conn`, or one of the pool's in
    autocommit: a single statement is its own transaction, one round trip); its result."""
    if conn is None:
        async with connect() as conn:
            return await run(op, conn)
    rows = None
    with connections["default"].wrap_database_errors:  # psycopg's errors as Django's
        async with conn.cursor() as cursor:
            while True:
                try:
                    sql, params = op.send(rows)
                except StopIteration as stop:
                    return stop.value
                await _execute(conn, cursor, sql, params)
                rows = await cursor.fetchall() if cursor.description is not None else cursor.rowcount


async def _execute(conn, cursor, sql, params):
    """cursor.execute(), and once more when a schema change made this connection's prepared
    statement of it stale ("cached plan must not change result type": PostgreSQL plans a
    prepared statement again after a migration, but fails it if its columns' types changed).
    In autocommit the failed statement did nothing, so the connection forgets its prepared
    statements (DEALLOCATE ALL, which psycopg follows) and runs it again, unprepared. In a
    transaction, which the error has aborted, the caller gets it; psycopg's rollback forgets
    the connection's prepared statements too, so the next caller's are prepared anew."""
    import psycopg
    from psycopg.pq import TransactionStatus

    try:
        await cursor.execute(sql, params)
    except psycopg.errors.FeatureNotSupported as exc:
        if not _stale_plan(exc):
            raise
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise
        await conn.execute("DEALLOCATE ALL")
        await cursor.execute(sql, params)


@contextlib.asynccontextmanager
async def connect():
    """An async connection of this loop's pool, in autocommit."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = _pools[loop] = _Pool()
    async with pool.connection() as conn:
        yield conn


@contextlib.asynccontextmanager
async def transaction():
    """An async connection in a transaction: committed when the block ends, rolled back when
    it raises. What must follow the commit (wake-ups) goes after the block."""
    async with connect() as conn:
        with connections["default"].wrap_database_errors:
            async with conn.transaction():
                yield conn


# psycopg's count of earlier runs of a statement (of a text and parameter types) on a connection
# from which it prepares it: 1, the second run.
PREPARE_THRESHOLD = 1


class _Pool:
    """One event loop's connections: opened when first needed, kept for the next caller, at
    most MQ_ASYNC_DB_POOL_MAX_SIZE at once. No tasks of its own (psycopg_pool's workers and
    scheduler kept reconnecting while a test's loop was being closed, and hung it): one that
    breaks, or is given back mid-transaction (a cancelled caller), is closed with its prepared
    statements, and the next caller opens another; PostgreSQL restarted, the next call fails
    once, as Django's pool."""

    def __init__(self):
        import psycopg

        wrapper = connections["default"]
        # Django's own connection parameters (its adapters: aware datetimes in UTC), with
        # server-side binding and prepared statements (Django turns them off, for connection
        # poolers). The hot statements are few texts run many times: prepared from their second
        # run on (a text run once, like the time zone's, is not), PostgreSQL plans each once per
        # connection, and after five runs settles on a generic plan where it is as good, which
        # the partial indexes still serve: their statuses are literals (querysets.status_is).
        # Prepared statements belong to the server session of one connection: behind a pooler
        # in transaction mode MQ_DB_PREPARE is off (None: never prepared), unless the pooler
        # keeps track of them (PgBouncer 1.22+, max_prepared_statements).
        self.kwargs = {
            **wrapper.get_connection_params(),
            "cursor_factory": psycopg.AsyncCursor,
            "prepare_threshold": PREPARE_THRESHOLD if settings.MQ_DB_PREPARE else None,
            "autocommit": True,
        }
        self.timezone_name, self.set_time_zone = wrapper.timezone_name, wrapper.ops.set_time_zone_sql()
        self.timeout = (settings.DATABASES["default"].get("OPTIONS", {}).get("pool") or {}).get("timeout", 10)
        self.slots = asyncio.Semaphore(settings.MQ_ASYNC_DB_POOL_MAX_SIZE)
        self.idle = []

    @contextlib.asynccontextmanager
    async def connection(self):
        from psycopg.pq import TransactionStatus

        with connections["default"].wrap_database_errors:
            async with asyncio.timeout(self.timeout):
                await self.slots.acquire()
            try:
                conn = self.idle.pop() if self.idle else await self._open()
            except BaseException:
                self.slots.release()
                raise
        try:
            yield conn
        finally:
            if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                self.idle.append(conn)
            else:
                _finish(conn)
            self.slots.release()

    async def _open(self):
        import psycopg

        conn = await psycopg.AsyncConnection.connect(**self.kwargs)
        if self.timezone_name and conn.info.parameter_status("TimeZone") != self.timezone_name:
            await conn.execute(self.set_time_zone, [self.timezone_name])
        return conn

    def close(self):
        while self.idle:
            _finish(self.idle.pop())


def _finish(conn):
    """Close a connection without its loop (the socket, at once)."""
    with contextlib.suppress(Exception):
        conn.pgconn.finish()


async def close_pool():
    """Close this loop's pool (a server stopping)."""
    pool = _pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        pool.close()


def close_pools():
    """Close the pools of loops that are not running (tests: each test's loop has ended by
    now), so that no connection outlives its loop."""
    for loop, pool in list(_pools.items()):
        if not loop.is_running():
            del _pools[loop]
            pool.close()
