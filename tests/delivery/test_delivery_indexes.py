"""The delivery table's partial indexes: the hot statements can use them, as the planner sees
them when it must plan once for any parameters (a generic plan: the async connection's
prepared statements), and the migration that makes them applies and reverses.

PostgreSQL's planner is asked with sequential scans priced out, so that "can it use the index"
does not depend on how few rows a test has; SQLite is asked with EXPLAIN QUERY PLAN.
"""

from datetime import datetime, timedelta

import psycopg
import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone
from psycopg.sql import Literal

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery, Status

PENDING_LITERAL = "p.status = 'pending'"
# The partial indexes of pending deliveries. The lease's pick is meant for delivery_ready, but on
# a table of ten rows the planner may take delivery_due (next_attempt_at <= now) instead, once
# the table has statistics (PostgreSQL, after earlier tests' rows were analysed): either shows
# that the status literal lets a generic plan use a partial index, which is what is tested here.
PENDING_INDEXES = ("delivery_ready", "delivery_due")


def uses_a_pending_index(plan):
    return any(name in plan for name in PENDING_INDEXES)


def pg_type(value):
    for kind, name in ((bool, "boolean"), (int, "bigint"), (str, "text"), (datetime, "timestamptz")):
        if isinstance(value, kind):
            return name
    raise TypeError(value)


class Statements:
    """The SQL (with its placeholders) and the parameters of every statement run while active."""

    def __init__(self):
        self.seen = []

    def __call__(self, execute, sql, params, many, context):
        self.seen.append((sql, params))
        return execute(sql, params, many, context)

    def having(self, text):
        found = [(sql, params) for sql, params in self.seen if text in sql]
        assert found, f"no statement with {text!r} among {[s for s, _ in self.seen]}"
        return found[0]


def plan_of(sql, params):
    """The plan the database would use for `sql`, its parameters bound the way a prepared
    statement binds them (PostgreSQL: sent apart from the text, planned generically)."""
    if connection.vendor == "postgresql":
        numbered = sql.split("%s")
        numbered = "".join(f"{part}${k + 1}" for k, part in enumerate(numbered[:-1])) + numbered[-1]
        raw = connection.connection
        with raw.transaction(), psycopg.Cursor(raw) as cursor:  # server-side binding
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            cursor.execute("SET LOCAL enable_seqscan = off")
            types = ", ".join(pg_type(p) for p in params)
            cursor.execute(
                f"PREPARE planned({types}) AS {numbered}" if params else f"PREPARE planned AS {numbered}"
            )
            try:
                arguments = ", ".join(Literal(p).as_string(raw) for p in params)
                cursor.execute(
                    f"EXPLAIN EXECUTE planned({arguments})" if params else "EXPLAIN EXECUTE planned"
                )
                return "\n".join(row[0] for row in cursor.fetchall())
            finally:
                cursor.execute("DEALLOCATE planned")
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN QUERY PLAN {sql}", params)
        return "\n".join(str(row[-1]) for row in cursor.fetchall())


@pytest.fixture
def backlog(logger, db_queue):
    """Ten messages owed to the logger, the first three acked (history the index leaves out)."""
    subscribing.subscribe(logger, db_queue)
    publishing.publish(db_queue, [publishing.prepare("create", {"i": i}) for i in range(10)])
    first = ledger.lease_deliveries(logger, limit=3)
    ledger.ack_deliveries(logger, [d["id"] for d in first])
    return logger


def leased_with_statements(subscriber, **kw):
    statements = Statements()
    with connection.execute_wrapper(statements):
        leased = ledger.lease_deliveries(subscriber, **kw)
    return leased, statements


@pytest.mark.django_db
def test_it_leases_through_the_partial_ready_index(backlog):
    # When: a lease of two
    leased, statements = leased_with_statements(backlog, limit=2, holder="test!a")

    # Then: it took the oldest pending ones, and its statement can use delivery_ready
    assert [d["seq"] for d in leased] == [4, 5]
    sql, params = statements.having("ORDER BY seq")
    assert PENDING_LITERAL in sql
    assert uses_a_pending_index(plan_of(sql, params))


@pytest.mark.django_db
def test_it_expires_overdue_leases_through_the_partial_overdue_index(backlog):
    # Given: two leases, and an hour later
    ledger.lease_deliveries(backlog, limit=2, holder="test!old")
    later = timezone.now() + timedelta(hours=1)

    # When: the sweeper's expiry
    statements = Statements()
    with connection.execute_wrapper(statements):
        expired = ledger.expire_overdue_leases(later)

    # Then: both are pending again, and the expiry's read can use delivery_overdue
    assert expired == 2
    assert set(Delivery.objects.filter(seq__in=[4, 5]).values_list("status", flat=True)) == {Status.PENDING}
    sql, params = statements.having("q.max_attempts")
    assert "delivery_overdue" in plan_of(sql, params)


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="PostgreSQL's generic plans: the PostgreSQL pass of make test runs it",
)
@pytest.mark.django_db
def test_it_could_not_use_the_index_were_the_status_a_parameter(backlog):
    """Why the ledger writes statuses as literals: the same lease with its status sent as a
    parameter, planned generically, cannot prove the partial index's condition."""
    _, statements = leased_with_statements(backlog, limit=2, holder="test!c")
    sql, params = statements.having("ORDER BY seq")

    as_parameter = sql.replace(PENDING_LITERAL, "p.status = %s")
    at = as_parameter[: as_parameter.index("p.status = %s")].count("%s")

    assert not uses_a_pending_index(plan_of(as_parameter, [*params[:at], Status.PENDING, *params[at:]]))


def index_names():
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, Delivery._meta.db_table))


def autovacuum_options():
    if connection.vendor != "postgresql":
        return []
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [Delivery._meta.db_table])
        return cursor.fetchone()[0] or []


@pytest.mark.django_db(transaction=True)
def test_it_migrates_to_the_partial_indexes_and_back(backlog):
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("delivery")
    try:
        # When: back to before the partial indexes
        executor.migrate([("delivery", "0007_attempt_permanent")])

        # Then: the old indexes, the table's own autovacuum settings gone
        assert {"delivery_lease", "delivery_due", "delivery_overdue"} <= index_names()
        assert "delivery_ready" not in index_names()
        assert autovacuum_options() == []

        # When: forward again
        executor.loader.build_graph()
        executor.migrate([("delivery", "0008_partial_status_indexes")])

        # Then: the partial ones, and (PostgreSQL) the autovacuum settings
        names = index_names()
        assert {"delivery_ready", "delivery_overdue", "delivery_due", "delivery_dead"} <= names
        assert "delivery_lease" not in names
        if connection.vendor == "postgresql":
            assert "autovacuum_vacuum_scale_factor=0.02" in autovacuum_options()
    finally:
        executor.loader.build_graph()
        executor.migrate(latest)
    # And the deliveries are all still there, and still leased right
    assert Delivery.objects.filter(subscriber=backlog).count() == 10
    assert [d["seq"] for d in ledger.lease_deliveries(backlog, limit=1)] == [4]
