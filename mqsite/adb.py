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

Both bind parameters on the client, as Django's psycopg backend does, so one SQL text with
`%s` placeholders means the same on both; datetimes come back aware (UTC) on both, and errors
are Django's (an IntegrityError is django.db.IntegrityError on both paths).

Side effects after commit are the caller's: on the sync path transaction.on_commit(), on the
async path simply the next line after the commit (mqsite.bus.send()).
"""

import asyncio
import contextlib
import functools
import logging
import weakref

from channels.db import DatabaseSyncToAsync
from django.conf import settings
from django.db import connection, connections

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


def run_sync(op):
    """Run a sans-I/O operation on Django's connection; its result."""
    rows = None
    with connection.cursor() as cursor:
        while True:
            try:
                sql, params = op.send(rows)
            except StopIteration as stop:
                return stop.value
            cursor.execute(sql, params)
            rows = cursor.fetchall() if cursor.description is not None else cursor.rowcount


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
                await cursor.execute(sql, params)
                rows = await cursor.fetchall() if cursor.description is not None else cursor.rowcount


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


class _Pool:
    """One event loop's connections: opened when first needed, kept for the next caller, at
    most MQ_ASYNC_DB_POOL_MAX_SIZE at once. No tasks of its own (psycopg_pool's workers and
    scheduler kept reconnecting while a test's loop was being closed, and hung it): one that
    breaks, or is given back mid-transaction (a cancelled caller), is closed, and the next
    caller opens another; PostgreSQL restarted, the next call fails once, as Django's pool."""

    def __init__(self):
        import psycopg

        wrapper = connections["default"]
        # Django's own connection parameters (its adapters: aware datetimes in UTC), with the
        # async flavour of its client-side binding cursor.
        self.kwargs = {
            **wrapper.get_connection_params(),
            "cursor_factory": psycopg.AsyncClientCursor,
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
