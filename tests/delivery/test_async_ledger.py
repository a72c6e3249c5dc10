"""The socket's hot operations from the event loop (mqsite/adb.py): publish, lease, ack and nack
give the same results as the sync ledger and publishing (each test runs both ways), a publish
is answered and its subscribers woken only after its commit, and a transaction that fails
leaves nothing. On PostgreSQL the async ones run on the async connection with no thread (the
`no_threads` fixture fails a test that takes one); on SQLite they run the sync ones in a
thread."""

import asyncio
from datetime import datetime, timedelta

import pytest
from channels.db import database_sync_to_async
from django.db import IntegrityError, NotSupportedError, connection
from django.utils import timezone

from delivery import group_commit, ledger, publishing, subscribing, wakeups
from delivery.models import Delivery, Status
from mqsite import adb, bus
from queues.models import Event, Message, Queue
from subscribers.models import Subscriber
from tests.support.queue_lock import QueueLock

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]
on_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason=(
        "the async connection is PostgreSQL's (SQLite takes a thread): "
        "the PostgreSQL pass of make test runs it"
    ),
)


@pytest.fixture(params=["sync", "async"])
def way(request):
    """Call a ledger or publishing operation by its sync name, the sync way (in a thread, as
    a REST view would) or the async way (its `a` twin, on the event loop)."""

    def call(module, name):
        if request.param == "sync":  # in a thread of its own, as the consumer's db() does
            return adb.thread(getattr(module, name))
        return getattr(module, f"a{name}")

    call.param = request.param
    return call


@pytest.fixture
def no_threads(monkeypatch, way):
    """On PostgreSQL the async way takes no thread."""
    if way.param == "async" and connection.vendor == "postgresql":
        real = adb.thread

        def thread(fn):
            # Except the other processes' wake-ups (Redis, webhook jobs), sent after the answer.
            if fn is bus._deliver:
                return real(fn)
            raise AssertionError(f"{fn} went to a thread")

        monkeypatch.setattr(adb, "thread", thread)


@pytest.fixture
def both_subscribed_warm(db_queue, logger, peer):
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    # The event is made (and remembered) once: a publish that makes one goes by the sync path.
    publishing.publish(db_queue, [publishing.prepare("warm", {})])
    Delivery.objects.all().delete()
    return db_queue, logger, peer


def messages(n, event="create", start=0):
    return [publishing.prepare(event, {"n": start + i}) for i in range(n)]


async def published(queue, n, publisher=None):
    return await database_sync_to_async(publishing.publish)(queue, messages(n, "warm"), publisher=publisher)


async def test_it_publishes_the_same_answers_and_rows(both_subscribed_warm, way, no_threads):
    queue, logger, _ = both_subscribed_warm
    publish = way(publishing, "publish")
    answers = await publish(queue, messages(2, "warm"), publisher=logger)
    assert [(a["queue"], a["event"], a["seq"], a["deliveries"], created) for a, created in answers] == [
        ("db", "warm", 2, 2, True),
        ("db", "warm", 3, 2, True),
    ]
    assert all(isinstance(a["created_at"], datetime) and a["created_at"].tzinfo for a, _ in answers)

    def stored():
        return list(
            Message.objects.filter(pk__in=[a["id"] for a, _ in answers])
            .order_by("seq")
            .values_list("seq", "payload_json", "publisher_id", "event__name")
        ), sorted(Delivery.objects.values_list("subscriber__name", "status", "seq"))

    assert await database_sync_to_async(stored)() == (
        [(2, '{"n":0}', logger.pk, "warm"), (3, '{"n":1}', logger.pk, "warm")],
        [("logger", "pending", 2), ("logger", "pending", 3), ("peer", "pending", 2), ("peer", "pending", 3)],
    )


async def test_it_leases_the_same_deliveries(both_subscribed_warm, way, no_threads):
    queue, logger, _ = both_subscribed_warm
    await published(queue, 3)
    now = timezone.now()
    leased = await way(ledger, "lease_deliveries")(logger, limit=2, holder="h", now=now)
    assert [(d["queue"], d["event"], d["seq"], d["payload"], d["attempt"]) for d in leased] == [
        ("db", "warm", 2, {"n": 0}, 1),
        ("db", "warm", 3, {"n": 1}, 1),
    ]
    assert all(d["ack_deadline"] == now + timedelta(seconds=queue.ack_timeout) for d in leased)
    assert all(d["published_at"].tzinfo is not None for d in leased)
    held = await database_sync_to_async(
        lambda: sorted(Delivery.objects.filter(lease_holder="h").values_list("id", "status", "subscriber_id"))
    )()
    assert held == sorted((d["id"], Status.INFLIGHT, logger.pk) for d in leased)
    assert await way(ledger, "lease_deliveries")(logger, limit=0) == []


async def test_it_acks_the_same_way(both_subscribed_warm, way, no_threads):
    queue, logger, peer = both_subscribed_warm
    await published(queue, 3)
    mine = [d["id"] for d in await database_sync_to_async(ledger.lease_deliveries)(logger, limit=3)]
    theirs = await database_sync_to_async(lambda: Delivery.objects.filter(subscriber=peer).first().pk)()
    await database_sync_to_async(ledger.ack_deliveries)(logger, mine[:1])
    ack = way(ledger, "ack_deliveries")
    assert await ack(logger, [*mine, mine[1], theirs, 10**12]) == (2, [theirs, 10**12])
    assert await ack(logger, []) == (0, [])
    statuses = await database_sync_to_async(
        lambda: dict(Delivery.objects.filter(pk__in=[*mine, theirs]).values_list("pk", "status"))
    )()
    assert statuses == {**dict.fromkeys(mine, Status.ACKED), theirs: Status.PENDING}


async def test_it_nacks_the_same_way_and_wakes_after(both_subscribed_warm, way, no_threads):
    queue, logger, peer = both_subscribed_warm
    await database_sync_to_async(Queue.objects.filter(pk=queue.pk).update)(max_attempts=2)
    await published(queue, 3)
    first, second, third = [
        d["id"] for d in await database_sync_to_async(ledger.lease_deliveries)(logger, limit=3)
    ]
    # The second has had its last attempt: a nack kills it.
    await database_sync_to_async(Delivery.objects.filter(pk=second).update)(attempt=2)
    await database_sync_to_async(ledger.ack_deliveries)(logger, [third])
    theirs = await database_sync_to_async(lambda: Delivery.objects.filter(subscriber=peer).first().pk)()
    woken = wakeups.generation(logger.pk)
    now = timezone.now()
    nacked = await way(ledger, "nack_deliveries")(
        logger, [first, second, third, theirs, -1], retry_in=0, now=now, error="no"
    )
    assert nacked.done == {first: (Status.PENDING, 1, now), second: (Status.DEAD, 2, nacked.done[second][2])}
    assert nacked.unknown == [theirs, -1]
    assert nacked.settled == {third: Status.ACKED}
    assert wakeups.generation(logger.pk) > woken  # one ready now: its subscriber was woken
    rows = await database_sync_to_async(
        lambda: dict(Delivery.objects.filter(pk__in=[first, second]).values_list("pk", "last_error"))
    )()
    assert rows == {first: "no", second: "no; dead after 2 attempts"}


async def test_a_publish_is_answered_and_wakes_only_after_its_commit(both_subscribed_warm, way):
    queue, logger, peer = both_subscribed_warm
    lock = QueueLock(queue)
    lock.start()
    assert lock.held.wait(10)
    woken = asyncio.Event()
    waiter = wakeups.watch(peer.pk, woken)
    try:
        publish = asyncio.ensure_future(
            way(group_commit, "publish")(queue, messages(1, "warm"), publisher=logger)
        )
        await asyncio.sleep(0.3)
        assert not publish.done() and not woken.is_set()
        assert (
            await database_sync_to_async(Message.objects.filter(event__name="warm", seq=2).exists)() is False
        )
    finally:
        lock.release.set()
        lock.join()
    [(answer, _)] = await asyncio.wait_for(publish, 10)
    # By the time it is answered, every other connection sees it, and its subscribers were woken.
    assert await database_sync_to_async(Message.objects.filter(pk=answer["id"]).exists)()
    assert woken.is_set()
    wakeups.unwatch(peer.pk, waiter)


async def test_publishes_waiting_together_share_a_commit_each_with_its_own_answer(both_subscribed_warm, way):
    queue, logger, _ = both_subscribed_warm
    lock = QueueLock(queue)
    lock.start()
    assert lock.held.wait(10)
    publish = way(group_commit, "publish")
    try:
        calls = [
            asyncio.ensure_future(publish(queue, messages(2, "warm", 2 * i), publisher=logger))
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        # One the database refuses (its publisher does not exist): it fails, alone.
        calls.insert(
            1, asyncio.ensure_future(publish(queue, messages(1, "warm"), publisher=Subscriber(pk=10**9)))
        )
        await asyncio.sleep(0.2)
    finally:
        lock.release.set()
        lock.join()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
    assert isinstance(results[1], IntegrityError), results[1]
    answered = [[(a["seq"], a["deliveries"]) for a, _ in r] for r in results[:1] + results[2:]]
    assert sorted(seq for r in answered for seq, _ in r) == [2, 3, 4, 5, 6, 7]
    assert all(a[0][0] + 1 == a[1][0] and a[0][1] == 2 for a in answered)
    assert await database_sync_to_async(Message.objects.count)() == 7


@on_postgres
async def test_a_failed_transaction_on_the_async_connection_leaves_nothing(both_subscribed_warm):
    queue, logger, _ = both_subscribed_warm
    await published(queue, 1)
    [leased] = await ledger.alease_deliveries(logger, limit=1)
    with pytest.raises(RuntimeError):
        async with adb.transaction() as conn:
            op = ledger._nack(logger.pk, [leased["id"]], 0, timezone.now(), "no")
            nacked, _, _ = await adb.run(op, conn)
            assert nacked.done
            raise RuntimeError("after the statement, before the commit")
    status = await database_sync_to_async(lambda: Delivery.objects.get(pk=leased["id"]).status)()
    assert status == Status.INFLIGHT
    # A publish whose statement fails (its event is gone) takes no seq and leaves no row.
    gone = Event(pk=10**9, queue=queue, name="gone")
    with pytest.raises(IntegrityError):
        await adb.run(
            publishing._publish_statement(queue, messages(1, "gone"), logger, timezone.now(), {"gone": gone})
        )
    assert await database_sync_to_async(lambda: Queue.objects.get(pk=queue.pk).last_seq)() == 2
    assert await database_sync_to_async(Message.objects.count)() == 2


@on_postgres
async def test_the_async_connection_reads_what_django_reads():
    """Same adapters: aware datetimes in UTC, text as text."""
    async with adb.connect() as conn:
        [(now, text)] = await adb.run(_select("SELECT now(), %s", ["ü"]), conn)
    assert now.utcoffset() == timedelta(0) and text == "ü"


def _select(sql, params):
    return (yield sql, params)


def _prepared(conn, text):
    """How many prepared statements of this connection hold `text`."""
    return adb.run(
        _select("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", [f"%{text}%"]), conn
    )


@on_postgres
async def test_an_ack_is_one_prepared_statement_whatever_its_number_of_ids(both_subscribed_warm):
    """The async connection prepares what it runs again, so PostgreSQL plans it once: an ack's
    text must not change with its number of ids (as an IN list of a placeholder each did)."""
    queue, logger, _ = both_subscribed_warm
    await published(queue, 9)
    ids = [d["id"] for d in await ledger.alease_deliveries(logger, limit=9)]
    async with adb.connect() as conn:
        for batch in (ids[:2], ids[2:5], ids[5:9]):
            acked, _, _ = await adb.run(ledger._ack(logger.pk, batch, timezone.now()), conn)
            assert acked == len(batch)
        assert await _prepared(conn, "acked_at") == [(1,)]
    statuses = await database_sync_to_async(
        lambda: set(Delivery.objects.filter(pk__in=ids).values_list("status", flat=True))
    )()
    assert statuses == {Status.ACKED}


@on_postgres
async def test_a_prepared_statement_survives_a_migration_that_changes_its_columns():
    """A statement prepared before a column's type changed fails in PostgreSQL ("cached plan
    must not change result type"): on its own it runs again unprepared; in a transaction, which
    the error aborted, the caller gets it once, and the connection runs it again after."""
    select = ("SELECT x FROM mq_test_scratch", [])

    def ddl(sql):
        with connection.cursor() as cursor:
            cursor.execute(sql)

    await database_sync_to_async(ddl)("CREATE TABLE mq_test_scratch (x integer)")
    try:
        await database_sync_to_async(ddl)("INSERT INTO mq_test_scratch VALUES (1)")
        async with adb.connect() as conn:
            for _ in range(3):
                assert await adb.run(_select(*select), conn) == [(1,)]
            assert await _prepared(conn, "mq_test_scratch") == [(1,)]
            await database_sync_to_async(ddl)("ALTER TABLE mq_test_scratch ALTER COLUMN x TYPE bigint")
            assert await adb.run(_select(*select), conn) == [(1,)]
            for _ in range(2):
                assert await adb.run(_select(*select), conn) == [(1,)]
            assert await _prepared(conn, "mq_test_scratch") == [(1,)]
            held = conn
        await database_sync_to_async(ddl)("ALTER TABLE mq_test_scratch ALTER COLUMN x TYPE integer")
        with pytest.raises(NotSupportedError, match="cached plan"):
            async with adb.transaction() as conn:
                assert conn is held
                await adb.run(_select(*select), conn)
        async with adb.connect() as conn:
            assert conn is held
            for _ in range(3):
                assert await adb.run(_select(*select), conn) == [(1,)]
    finally:
        await database_sync_to_async(ddl)("DROP TABLE mq_test_scratch")


def _acked_in_a_transaction(subscriber, ids, relaxed):
    """Ack inside a transaction (ledger.no_flush_wait()'s, or a caller's own) and say whether
    that transaction's commit was still to wait for the disk."""
    from django.db import transaction

    with ledger.no_flush_wait() if relaxed else transaction.atomic():
        ledger.ack_deliveries(subscriber, ids)
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            return cursor.fetchone()[0]


@on_postgres
async def test_acks_relax_only_their_own_transaction_never_a_callers(both_subscribed_warm):
    """Leases and acks commit without waiting for the WAL flush (a lost one is handed out
    again), but an ack made inside the caller's own transaction must leave that transaction's
    commit durable: the caller's other writes (a publish, its own rows) may need it. A webhook
    batch's transaction (no_flush_wait) is relaxed as a whole, and the session is not."""
    queue, logger, _ = both_subscribed_warm
    await published(queue, 2)
    ids = [d["id"] for d in await ledger.alease_deliveries(logger, limit=2)]
    in_callers = database_sync_to_async(_acked_in_a_transaction)
    assert await in_callers(logger, ids[:1], relaxed=False) == "on"
    assert await in_callers(logger, ids[1:], relaxed=True) == "off"
    after = await database_sync_to_async(lambda: adb.run_sync(_select("SHOW synchronous_commit", [])))()
    assert after == [("on",)]
    statuses = await database_sync_to_async(
        lambda: set(Delivery.objects.filter(pk__in=ids).values_list("status", flat=True))
    )()
    assert statuses == {Status.ACKED}
