"""The snapshot of the hot tables (analytics.extract.hot_snapshot, write_snapshot): the columns
the analytics job reads, every hot row once with the values the database holds, both tables
from one instant, and never a payload read. No Spark here; DuckDB reads the files written."""

import threading
import time
from datetime import UTC, datetime, timedelta, timezone

import duckdb
import pytest
from django.db import close_old_connections, connection
from django.test.utils import CaptureQueriesContext

from analytics import archive, extract, layout
from delivery import publishing, subscribing
from delivery.models import Delivery, Status
from queues.models import Event, Message, Queue
from subscribers.models import Subscriber
from tests.support.history_rows import publish_at, settle

# Names the API would refuse but the tables can hold (set here by UPDATE): CSV's separators,
# quotes, a line break, and letters beyond ASCII must come back as they were.
ODD_QUEUE = 'q,"1"\nß'
ODD_EVENT = 'ev,"té"\''
ODD_SUBSCRIBER = 'ops, "night"\nshift — ü'


def snapshot_rows(table):
    return sorted(table.to_pylist(), key=lambda row: row["id"])


def orm_messages():
    """The hot messages as the models give them, one object at a time."""
    return [
        {"id": m.id, "queue": m.queue.name, "event": m.event.name, "created_at": m.created_at}
        for m in Message.objects.order_by("id")
    ]


def orm_deliveries():
    return [
        {
            "id": d.id,
            "message_id": d.message_id,
            "queue": d.message.queue.name,
            "event": d.message.event.name,
            "subscriber": d.subscriber.name,
            "status": d.status,
            "attempts": d.attempt,
            "created_at": d.created_at,
            "acked_at": d.acked_at,
        }
        for d in Delivery.objects.order_by("id")
    ]


@pytest.fixture
def history(db_queue, logger, peer, make_queue, make_subscriber):
    """Two queues: a message no one was subscribed to, and messages whose two deliveries are
    acked, pending, in flight or dead, at times with and without microseconds; then the
    names of a queue, an event and a subscriber made odd."""
    lonely = publish_at(db_queue, "audit", datetime(2026, 11, 20, 8, 30, 15, 123457, tzinfo=UTC))
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    # Given in another zone: stored, and read back, as the same instant.
    plus_two = timezone(timedelta(hours=2))
    at = {
        Status.ACKED: datetime(2026, 11, 21, 10, 0, 0, 1, tzinfo=plus_two),
        Status.PENDING: datetime(2026, 11, 22, 23, 59, 59, 999999, tzinfo=UTC),
        Status.INFLIGHT: datetime(2026, 11, 23, 0, 0, 0, tzinfo=UTC),
        Status.DEAD: datetime(2026, 11, 24, 12, 0, 0, 500000, tzinfo=UTC),
    }
    ids = {}
    for status, when in at.items():
        ids[status] = publish_at(db_queue, "create", when, {"big": "x" * 100})
        settle(ids[status], {logger: Status.ACKED, peer: status}, latency_ms=1.5, attempts=3)
    other = make_queue("other")
    night = make_subscriber("night")
    subscribing.subscribe(night, other)
    elsewhere = publish_at(other, "delete", datetime(2026, 11, 25, 1, 2, 3, 4, tzinfo=UTC))
    settle(elsewhere, {night: Status.ACKED}, latency_ms=250, attempts=1)

    Queue.objects.filter(id=other.id).update(name=ODD_QUEUE)
    Event.objects.filter(queue=db_queue, name="create").update(name=ODD_EVENT)
    Subscriber.objects.filter(id=peer.id).update(name=ODD_SUBSCRIBER)
    return {"lonely": lonely, "elsewhere": elsewhere, "at": at, **ids}


@pytest.mark.django_db
def test_it_holds_every_hot_row_with_the_values_the_models_read(history, logger):
    # When
    snapshot = extract.hot_snapshot()

    # Then: the columns of the contract, and each row as the models read it
    assert snapshot.messages.schema == layout.HOT_MESSAGE_SCHEMA
    assert snapshot.deliveries.schema == layout.HOT_DELIVERY_SCHEMA
    assert snapshot_rows(snapshot.messages) == orm_messages()
    assert snapshot_rows(snapshot.deliveries) == orm_deliveries()
    assert snapshot.messages.num_rows == 6 and snapshot.deliveries.num_rows == 9

    # ... with the nulls, names and instants it was given, to the microsecond in UTC
    messages = {m["id"]: m for m in snapshot.messages.to_pylist()}
    assert messages[history["lonely"]]["created_at"] == datetime(2026, 11, 20, 8, 30, 15, 123457, tzinfo=UTC)
    assert messages[history[Status.ACKED]]["created_at"] == datetime(2026, 11, 21, 8, 0, 0, 1, tzinfo=UTC)
    assert messages[history["elsewhere"]]["queue"] == ODD_QUEUE
    assert messages[history[Status.DEAD]]["event"] == ODD_EVENT
    assert history["lonely"] not in {d["message_id"] for d in snapshot.deliveries.to_pylist()}
    peers = {d["message_id"]: d for d in snapshot.deliveries.to_pylist() if d["subscriber"] == ODD_SUBSCRIBER}
    for status in (Status.PENDING, Status.INFLIGHT, Status.DEAD):
        row = peers[history[status]]
        assert (row["status"], row["attempts"], row["acked_at"]) == (status.value, 3, None)
    acked = peers[history[Status.ACKED]]
    assert acked["status"] == "acked"
    assert acked["acked_at"] - acked["created_at"] == timedelta(microseconds=1500)
    assert acked["created_at"] == datetime(2026, 11, 21, 8, 0, 0, 1, tzinfo=UTC)
    (night,) = [d for d in snapshot.deliveries.to_pylist() if d["message_id"] == history["elsewhere"]]
    assert (night["queue"], night["event"], night["subscriber"]) == (ODD_QUEUE, "delete", "night")


@pytest.mark.django_db
def test_it_reads_rows_across_the_blocks_of_its_reader(history, monkeypatch):
    # Given blocks of a few rows each, so that rows and quoted line breaks meet their edges
    # (PostgreSQL: the CSV of COPY; SQLite: the fetches)
    monkeypatch.setattr(extract, "CSV_BLOCK_BYTES", 300)
    monkeypatch.setattr(extract, "CHUNK_ROWS", 2)

    # When
    snapshot = extract.hot_snapshot()

    # Then
    assert snapshot_rows(snapshot.messages) == orm_messages()
    assert snapshot_rows(snapshot.deliveries) == orm_deliveries()
    assert snapshot.deliveries.column("id").num_chunks > 1


@pytest.mark.django_db
def test_it_never_reads_a_payload_headers_or_errors(history):
    # Given every statement, seen two ways: Django's query log and its execute hooks
    hooked = []

    def hook(execute, sql, params, many, context):
        hooked.append(sql)
        return execute(sql, params, many, context)

    # When
    with CaptureQueriesContext(connection) as logged, connection.execute_wrapper(hook):
        extract.hot_snapshot()

    # Then both saw the statements that read the two tables (on PostgreSQL, the COPYs, which
    # psycopg runs outside a cursor's execute), and none of them names a payload
    logged = [q["sql"] for q in logged.captured_queries]
    for seen in (logged, hooked):
        readers = [sql for sql in seen if "FROM" in sql]
        assert len(readers) == 2, seen
        assert any('FROM "queues_message"' in sql for sql in readers)
        assert any('FROM "delivery_delivery"' in sql for sql in readers)
        if connection.vendor == "postgresql":
            assert all(sql.startswith("COPY (SELECT") for sql in readers)
        for sql in seen:
            assert "payload" not in sql and "headers" not in sql and "last_error" not in sql


@pytest.mark.django_db
def test_it_writes_both_tables_as_plain_parquet(history, tmp_path):
    # When
    snapshot = extract.hot_snapshot()
    paths = extract.write_snapshot(tmp_path / "recent", snapshot)

    # Then: one file per table, no partition folders, read by another engine as they were
    assert paths == [
        str(tmp_path / "recent" / "messages" / "part-0.parquet"),
        str(tmp_path / "recent" / "deliveries" / "part-0.parquet"),
    ]
    assert sorted(p.name for p in (tmp_path / "recent").rglob("*")) == [
        "deliveries",
        "messages",
        "part-0.parquet",
        "part-0.parquet",
    ]
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    for path, rows in zip(paths, (orm_messages(), orm_deliveries()), strict=True):
        read = db.sql(f"SELECT * FROM read_parquet('{path}') ORDER BY id").to_arrow_table()
        assert read.to_pylist() == rows


@pytest.mark.django_db
def test_it_snapshots_empty_tables_with_their_columns(tmp_path):
    snapshot = extract.hot_snapshot()
    assert snapshot.messages.num_rows == snapshot.deliveries.num_rows == 0
    assert snapshot.messages.schema == layout.HOT_MESSAGE_SCHEMA
    assert snapshot.deliveries.schema == layout.HOT_DELIVERY_SCHEMA

    paths = extract.write_snapshot(tmp_path, snapshot)
    columns = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{paths[1]}')").fetchall()
    assert [c[0] for c in columns] == layout.HOT_DELIVERY_SCHEMA.names


def in_another_thread(work):
    """Run `work` on a connection of its own, committed, before going on."""
    failures = []

    def run():
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failures.append(e)
        finally:
            close_old_connections()
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if failures:
        raise failures[0]


def between_the_two_reads(work):
    """An execute hook that runs `work` in another thread, committed, once the snapshot has
    read the messages and before it reads the deliveries."""

    def hook(execute, sql, params, many, context):
        if 'FROM "delivery_delivery"' in sql and not hook.done:
            hook.done = True
            in_another_thread(work)
        return execute(sql, params, many, context)

    hook.done = False
    return hook


def assert_whole(snapshot):
    """Every delivery's message is in the snapshot, and every message with its fan-out."""
    message_ids = set(snapshot.messages.column("id").to_pylist())
    per_message = {}
    for d in snapshot.deliveries.to_pylist():
        per_message[d["message_id"]] = per_message.get(d["message_id"], 0) + 1
    assert set(per_message) <= message_ids
    return message_ids, per_message


def publish_numbered(queue, n):
    return publishing.publish(queue, [publishing.prepare("create", {"n": n})])[0][0]["id"]


@pytest.mark.django_db(transaction=True)
def test_a_publish_committed_during_the_snapshot_is_wholly_out(subscribed):
    # Given a message published before
    before = publish_numbered(subscribed, 1)
    published = []

    # When another one commits after the messages were read, before the deliveries are
    with connection.execute_wrapper(
        between_the_two_reads(lambda: published.append(publish_numbered(subscribed, 2)))
    ):
        snapshot = extract.hot_snapshot()

    # Then the snapshot holds the first with its two deliveries and nothing of the second
    assert published and Delivery.objects.filter(message_id=published[0]).count() == 2
    message_ids, per_message = assert_whole(snapshot)
    assert message_ids == {before}
    assert per_message == {before: 2}


@pytest.mark.django_db(transaction=True)
def test_a_message_archived_during_the_snapshot_is_wholly_in(subscribed, logger, peer, tmp_path):
    # Given two settled messages
    ids = [publish_numbered(subscribed, n) for n in (1, 2)]
    for message_id in ids:
        settle(message_id, {logger: Status.ACKED, peer: Status.ACKED})

    # When the archive moves the first out after the messages were read
    def move():
        assert archive.archive_batch(str(tmp_path), subscribed, [ids[0]]) == (1, 2)

    with connection.execute_wrapper(between_the_two_reads(move)):
        snapshot = extract.hot_snapshot()

    # Then the snapshot still holds it with both its deliveries, as at the instant it began
    assert not Message.objects.filter(id=ids[0]).exists()
    message_ids, per_message = assert_whole(snapshot)
    assert message_ids == set(ids)
    assert per_message == {ids[0]: 2, ids[1]: 2}


@pytest.mark.django_db(transaction=True)
def test_snapshots_beside_a_stream_of_publishes_are_each_whole(subscribed):
    # Given a publisher committing 300 messages one after another on its own connection, which
    # waits halfway until a snapshot has been taken, so one surely falls mid-stream however the
    # threads are scheduled (a slow machine once took every snapshot before the first commit)
    failures = []
    halfway, snapped = threading.Event(), threading.Event()

    def publish_some():
        try:
            for n in range(300):
                publish_numbered(subscribed, n)
                if n == 149:
                    halfway.set()
                    assert snapped.wait(30), "no snapshot was taken halfway"
                time.sleep(0.001)  # let the snapshots in between (the GIL)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failures.append(e)
        finally:
            halfway.set()
            connection.close()

    thread = threading.Thread(target=publish_some)
    thread.start()
    # When snapshots are taken meanwhile
    snapshots = []
    while thread.is_alive():
        after_half = halfway.is_set()
        snapshots.append(extract.hot_snapshot())
        if after_half:
            snapped.set()
    thread.join(30)
    assert not failures

    # Then each holds every message it holds with both deliveries, and nothing else, and
    # the ones taken mid-stream hold a prefix: at least the 150 before the pause
    for snapshot in snapshots:
        message_ids, per_message = assert_whole(snapshot)
        assert set(per_message) == message_ids
        assert set(per_message.values()) <= {2}
    counts = sorted({s.messages.num_rows for s in snapshots})
    assert any(150 <= count < 300 for count in counts), counts
