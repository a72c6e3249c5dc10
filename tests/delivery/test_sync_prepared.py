"""The hot operations run the sync way (REST, Celery: mqsite.adb.run_sync) are prepared on
Django's PostgreSQL connection, as on the async pool: PostgreSQL plans a publish, a lease or an
ack once per connection, not at every call. A statement that another connection's schema change
made stale is run again. SQLite has no prepared statements to keep: there run_sync is Django's
cursor, which every other test of the ledger runs."""

import psycopg
import pytest
from django.db import NotSupportedError, connection, transaction

from delivery import ledger, publishing, subscribing
from mqsite import adb
from subscribers.models import Subscriber

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="prepared statements are PostgreSQL's"),
]


def _select(sql, params):
    return (yield sql, params)


def prepared(text):
    """How many prepared statements of Django's connection hold `text`."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", [f"%{text}%"])
        return cursor.fetchone()[0]


def cycle(queue, subscriber, n):
    publishing.publish(queue, [publishing.prepare("create", {"n": n})])
    leased = ledger.lease_deliveries(subscriber, limit=1)
    assert [d["payload"] for d in leased] == [{"n": n}]
    assert ledger.ack_deliveries(subscriber, [leased[0]["id"]])[0] == 1


def test_a_publish_lease_and_ack_run_again_are_prepared_once(db_queue, logger):
    subscribing.subscribe(logger, db_queue)
    for n in range(2):
        cycle(db_queue, logger, n)
    # The publish's one statement and the ack's are prepared (the connection comes from the
    # pool: an earlier test may have prepared others of them on it) ...
    counts = prepared("last_seq"), prepared("acked_at")
    assert min(counts) >= 1
    # ... and run again, they are used again, not prepared anew.
    for n in range(2, 5):
        cycle(db_queue, logger, n)
    assert (prepared("last_seq"), prepared("acked_at")) == counts


def test_a_statement_made_stale_by_another_connection_runs_again():
    """Another process's migration changes a column's type: PostgreSQL refuses the statement
    prepared before ("cached plan must not change result type"). On its own (autocommit) it runs
    again unprepared; in a transaction, which the error aborted, the caller gets the error."""
    select = ("SELECT x FROM mq_test_sync_scratch", [])
    own = ("context", "cursor_factory")  # Django's adapters and cursor, not needed here
    params = {k: v for k, v in connection.get_connection_params().items() if k not in own}

    def elsewhere(sql):
        with psycopg.connect(**params, autocommit=True) as other:
            other.execute(sql)

    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE mq_test_sync_scratch (x integer)")
        cursor.execute("INSERT INTO mq_test_sync_scratch VALUES (1)")
    try:
        for _ in range(3):
            assert adb.run_sync(_select(*select)) == [(1,)]
        assert prepared("mq_test_sync_scratch") == 1
        elsewhere("ALTER TABLE mq_test_sync_scratch ALTER COLUMN x TYPE bigint")
        assert adb.run_sync(_select(*select)) == [(1,)]
        for _ in range(2):
            assert adb.run_sync(_select(*select)) == [(1,)]
        assert prepared("mq_test_sync_scratch") == 1
        elsewhere("ALTER TABLE mq_test_sync_scratch ALTER COLUMN x TYPE integer")
        with pytest.raises(NotSupportedError, match="cached plan"), transaction.atomic():
            adb.run_sync(_select(*select))
        for _ in range(3):
            assert adb.run_sync(_select(*select)) == [(1,)]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE mq_test_sync_scratch")


def test_djangos_own_statements_are_not_prepared(logger):
    """Only the operations written for both drivers bind on the server: the ORM's statements
    (the admin's, a view's) stay as Django runs them, whatever the connection's threshold."""
    for _ in range(2):
        adb.run_sync(_select("SELECT 1 WHERE %s = 'prepared-here'", ["prepared-here"]))
    for _ in range(3):
        assert not Subscriber.objects.filter(name="not-prepared-here").exists()
    assert prepared("prepared-here") == 1
    assert prepared("not-prepared-here") == 0
