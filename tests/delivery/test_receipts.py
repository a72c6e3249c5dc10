"""Receipts (API.md, Extensions): GET /api/messages/{id} for the publisher and operators, and the
socket's `"receipt": true`, answered once every delivery of the message is acked or dead, and
never before (delivery.receipts)."""

from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from dashboard import snapshot
from delivery import group_commit, ledger, publishing, receipts, subscribing
from delivery.models import Delivery, ReceiptMove, Status
from mqsite import adb
from queues.models import Message, Queue
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber
from tests.conftest import client_for
from tests.support.sockets import connect, recv, send

ZERO = {"pending": 0, "inflight": 0, "acked": 0, "dead": 0}
ONE = {"event": "create", "payload": 1}
ONE_WITH_RECEIPT = {"type": "publish", "queue": "db", **ONE, "receipt": True}


# --- REST: GET /api/messages/{id} -------------------------------------------------------------


@pytest.fixture
def fanned(db_queue, logger, peer, make_subscriber):
    """The logger publishes a message that three subscriptions are owed (peer, monitor, auditor)."""
    monitor = make_subscriber("monitor", publish=(), subscribe=("db",))
    auditor = make_subscriber("auditor", publish=(), subscribe=("db",))
    for s in (peer, monitor, auditor):
        subscribing.subscribe(s, db_queue, "create" if s is monitor else None)
    answer = client_for(logger).post(
        "/api/queues/db/messages", {"event": "create", "payload": 1}, format="json"
    )
    assert answer.status_code == 201 and answer.json()["deliveries"] == 3
    return answer.json()["id"], (peer, monitor, auditor)


def lease_one(subscriber):
    (d,) = ledger.lease_deliveries(subscriber, limit=1)
    return d["id"]


def test_it_answers_the_publisher_how_far_its_message_got(fanned, logger, db_queue):
    message_id, (peer, monitor, auditor) = fanned
    db_queue.max_attempts = 1
    db_queue.save()
    ledger.ack_deliveries(peer, [lease_one(peer)])
    ledger.nack_deliveries(monitor, [lease_one(monitor)])  # its last attempt: dead

    answer = client_for(logger).get(f"/api/messages/{message_id}")

    assert answer.status_code == 200
    body = answer.json()
    assert body["deliveries"] == {"pending": 1, "inflight": 0, "acked": 1, "dead": 1}
    assert {k: body[k] for k in ("id", "queue", "event", "seq")} == {
        "id": message_id,
        "queue": "db",
        "event": "create",
        "seq": 1,
    }
    assert body["created_at"] and "subscriptions" not in body
    statuses = dict(Delivery.objects.filter(message_id=message_id).values_list("subscriber__name", "status"))
    assert statuses == {"peer": Status.ACKED, "monitor": Status.DEAD, "auditor": Status.PENDING}


def test_it_is_a_404_to_anyone_but_the_publisher(fanned, peer, outsider, db_queue, logger):
    message_id, _ = fanned
    operators = publishing.publish(db_queue, [publishing.prepare("create", 2)])[0][0]["id"]

    assert client_for(peer).get(f"/api/messages/{message_id}").status_code == 404  # another subscriber
    assert client_for(outsider).get(f"/api/messages/{message_id}").status_code == 404
    assert client_for(logger).get(f"/api/messages/{operators}").status_code == 404  # an operator's
    assert client_for(logger).get(f"/api/messages/{operators + 100}").status_code == 404  # none
    assert client_for(logger).get(f"/api/messages/{2**63}").status_code == 404  # past bigint
    assert client_for().get(f"/api/messages/{message_id}").status_code == 401


def test_an_operator_sees_any_message_with_its_subscriptions(fanned, operator_client, db_queue):
    message_id, (peer, _, _) = fanned
    ledger.ack_deliveries(peer, [lease_one(peer)])

    body = operator_client.get(f"/api/messages/{message_id}").json()

    assert body["deliveries"] == {"pending": 2, "inflight": 0, "acked": 1, "dead": 0}
    rows = {s["subscriber"]: s for s in body["subscriptions"]}
    assert set(rows) == {"peer", "monitor", "auditor"}
    assert rows["peer"]["status"] == "acked" and rows["peer"]["attempt"] == 1 and rows["peer"]["acked_at"]
    assert rows["monitor"] == {
        "subscriber": "monitor",
        "event": "create",
        "status": "pending",
        "attempt": 0,
        "acked_at": None,
    }
    assert rows["auditor"]["event"] is None  # every event of the queue


def test_a_message_nobody_was_owed_has_all_counts_zero(logger, db_queue):
    answer = client_for(logger).post(
        "/api/queues/db/messages", {"event": "create", "payload": 1}, format="json"
    )
    assert answer.json()["deliveries"] == 0
    assert client_for(logger).get(f"/api/messages/{answer.json()['id']}").json()["deliveries"] == ZERO


def test_the_answer_is_two_queries_whatever_the_fan_out(fanned, operator_client, logger):
    message_id, _ = fanned
    with CaptureQueriesContext(connection) as publisher_queries:
        client_for(logger).get(f"/api/messages/{message_id}")
    with CaptureQueriesContext(connection) as operator_queries:
        operator_client.get(f"/api/messages/{message_id}")
    # The token's subscriber may be looked up once; then one aggregate (and the list for operators).
    ours = [q for q in publisher_queries if "delivery_delivery" in q["sql"]]
    assert len(ours) == 1 and "GROUP BY" in ours[0]["sql"]
    assert len([q for q in operator_queries if "delivery_delivery" in q["sql"]]) == 2


# --- the ledger: who learns of a settled message, and what it costs ------------------------------


def test_an_ack_without_receipts_is_the_one_statement_it_was(logger, db_queue):
    subscribing.subscribe(logger, db_queue)
    publishing.publish(db_queue, [publishing.prepare("create", i) for i in range(3)])
    ids = [d["id"] for d in ledger.lease_deliveries(logger, limit=3)]
    with CaptureQueriesContext(connection) as queries:
        assert ledger.ack_deliveries(logger, ids) == (3, [])
    assert len(queries) == 1


def test_an_ack_that_settles_a_receipt_checks_once_after_its_commit(
    logger, db_queue, django_capture_on_commit_callbacks, monkeypatch
):
    subscribing.subscribe(logger, db_queue)
    [(answer, _)] = publishing.publish(db_queue, [publishing.Outgoing("create", "1", None, receipt=True)])
    assert Message.objects.get(pk=answer["id"]).receipt_wanted
    assert list(Delivery.objects.values_list("receipt", flat=True)) == [True]
    heard = []
    monkeypatch.setattr(receipts, "settled_here", heard.extend)  # what announce() hands the sockets
    (d,) = ledger.lease_deliveries(logger, limit=1)
    with (
        CaptureQueriesContext(connection) as queries,
        django_capture_on_commit_callbacks(execute=True) as after_commit,
    ):
        ledger.ack_deliveries(logger, [d["id"]])
        before_the_commit = len(queries)
    # The ack, and the log of the receipt rows it moved (the sockets' recheck reads it); the
    # check waits for the commit.
    assert before_the_commit == 2 and len(after_commit) == 1
    assert "INSERT INTO delivery_receiptmove" in queries[1]["sql"]
    assert len(queries) == 3 and "NOT EXISTS" in queries[2]["sql"]
    assert heard == [answer["id"]]


# --- the socket's receipt frame ------------------------------------------------------------------


@database_sync_to_async
def publisher_and_subscribers(subscribers=3, max_attempts=10):
    """The publisher (no subscription of its own) and `subscribers` subscribers of db."""
    queue = Queue.objects.create(name="db", max_attempts=max_attempts)
    publisher, token = create_subscriber("publisher", publish=["db"], subscribe=[])
    subs = []
    for i in range(subscribers):
        s, s_token = create_subscriber(f"sub{i}", publish=[], subscribe=["db"])
        s.token = s_token
        subscribing.subscribe(s, queue)
        subs.append(s)
    return queue, token, subs


@database_sync_to_async
def lease_ids(subscriber):
    return [d["id"] for d in ledger.lease_deliveries(subscriber, limit=100)]


@database_sync_to_async
def ack_in_ledger(subscriber, ids):
    return ledger.ack_deliveries(subscriber, ids)


@database_sync_to_async
def counts_of(message_id):
    return adb.run_sync(receipts.counts_statement([message_id]))


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_receipt_comes_when_the_last_subscriber_acks_and_not_before():
    _, token, (a, b, c) = await publisher_and_subscribers()
    publisher = await connect(token)
    await send(
        publisher,
        {**ONE_WITH_RECEIPT, "ref": 7},
    )
    published = await recv(publisher)
    assert published["type"] == "published" and published["deliveries"] == 3 and published["ref"] == 7

    await ack_in_ledger(a, await lease_ids(a))  # a REST-like ack, in a thread
    c_socket = await connect(c.token)  # c takes its delivery on a socket, and holds it
    held = await recv(c_socket)
    assert held["type"] == "message"
    await ack_in_ledger(b, await lease_ids(b))
    # Two of three settled, one in flight: nothing, however long one waits.
    assert await publisher.receive_nothing(timeout=1.0)
    assert (await counts_of(published["id"]))[published["id"]] == {**ZERO, "acked": 2, "inflight": 1}

    await send(c_socket, {"type": "ack", "ids": [held["id"]]})  # the last one, over the socket

    receipt = await recv(publisher, timeout=2)
    assert receipt == {
        "type": "receipt",
        "id": published["id"],
        "deliveries": {**ZERO, "acked": 3},
        "ref": 7,
    }
    assert await publisher.receive_nothing(timeout=0.3)  # one receipt, once
    await c_socket.disconnect()
    await publisher.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_delivery_that_dies_settles_the_receipt_too():
    _, token, (a, b) = await publisher_and_subscribers(subscribers=2, max_attempts=1)
    publisher = await connect(token)
    await send(publisher, ONE_WITH_RECEIPT)
    published = await recv(publisher)
    await ack_in_ledger(a, await lease_ids(a))
    assert await publisher.receive_nothing(timeout=0.5)

    b_socket = await connect(b.token)
    held = await recv(b_socket)
    await send(b_socket, {"type": "nack", "ids": [held["id"]]})  # its one attempt: dead

    receipt = await recv(publisher, timeout=2)
    assert receipt == {
        "type": "receipt",
        "id": published["id"],
        "deliveries": {**ZERO, "acked": 1, "dead": 1},
    }
    await b_socket.disconnect()
    await publisher.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_batch_gets_one_receipt_per_message():
    _, token, (a,) = await publisher_and_subscribers(subscribers=1)
    publisher = await connect(token)
    items = [{"event": "create", "payload": i} for i in range(3)]
    await send(publisher, {"type": "publish", "queue": "db", "messages": items, "receipt": True, "ref": "b"})
    published = await recv(publisher)
    ids = [m["id"] for m in published["messages"]]
    leased = await lease_ids(a)
    await ack_in_ledger(a, leased[:2])
    got = [await recv(publisher), await recv(publisher)]
    assert await publisher.receive_nothing(timeout=0.5)  # the third is still in flight
    await ack_in_ledger(a, leased[2:])
    got.append(await recv(publisher))

    assert sorted(r["id"] for r in got) == ids
    assert all(
        r["type"] == "receipt" and r["ref"] == "b" and r["deliveries"] == {**ZERO, "acked": 1} for r in got
    )
    await publisher.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_no_receipt_is_sent_unless_asked():
    _, token, (a,) = await publisher_and_subscribers(subscribers=1)
    publisher = await connect(token)
    await send(publisher, {"type": "publish", "queue": "db", "event": "create", "payload": 1})
    published = await recv(publisher)
    await ack_in_ledger(a, await lease_ids(a))
    assert await publisher.receive_nothing(timeout=1.0)
    message = await database_sync_to_async(Message.objects.get)(pk=published["id"])
    assert not message.receipt_wanted
    assert receipts.waiting() == 0
    await publisher.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_message_owed_to_nobody_gets_its_receipt_right_after_published():
    _, token, _ = await publisher_and_subscribers(subscribers=0)
    publisher = await connect(token)
    await send(publisher, ONE_WITH_RECEIPT)
    published = await recv(publisher)
    assert published["type"] == "published" and published["deliveries"] == 0
    assert await recv(publisher) == {"type": "receipt", "id": published["id"], "deliveries": ZERO}
    await publisher.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_bad_receipt_flag_or_too_many_waiting_is_refused_and_nothing_published(settings):
    settings.MQ_MAX_RECEIPTS_PER_SUBSCRIBER = 2
    _, token, _ = await publisher_and_subscribers(subscribers=1)
    publisher = await connect(token)
    await send(publisher, {**ONE_WITH_RECEIPT, "receipt": "yes"})
    error = await recv(publisher)
    assert error["type"] == "error" and error["code"] == "bad_frame" and "receipt" in error["detail"]
    items = [{"event": "create", "payload": i} for i in range(3)]
    await send(publisher, {"type": "publish", "queue": "db", "messages": items, "receipt": True, "ref": 1})
    error = await recv(publisher)
    assert error["type"] == "error" and error["code"] == "too_many_receipts" and error["ref"] == 1
    assert await database_sync_to_async(Message.objects.count)() == 0
    await publisher.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_settlement_nobody_announced_is_found_by_the_recheck(monkeypatch):
    """A subscriber deleted with what it was owed settles nothing through the ledger (nor logs
    it): the sockets' periodic recheck finds the message settled in its full pass (every
    FULL_RECHECK_SECS, 3 s here)."""
    monkeypatch.setattr(receipts, "FULL_RECHECK_SECS", 3)
    _, token, (a,) = await publisher_and_subscribers(subscribers=1)
    publisher = await connect(token)
    await send(publisher, ONE_WITH_RECEIPT)
    published = await recv(publisher)
    await database_sync_to_async(lambda: Subscriber.objects.filter(pk=a.pk).delete())()
    receipt = await recv(publisher, timeout=10)
    assert receipt == {"type": "receipt", "id": published["id"], "deliveries": ZERO}
    await publisher.disconnect()
    assert receipts.waiting() == 0


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_closed_socket_forgets_the_receipts_it_waited_for():
    _, token, (a,) = await publisher_and_subscribers(subscribers=1)
    publisher = await connect(token)
    await send(publisher, ONE_WITH_RECEIPT)
    await recv(publisher)
    assert receipts.waiting() == 1
    await publisher.disconnect()
    assert receipts.waiting() == 0
    await ack_in_ledger(a, await lease_ids(a))  # announced to nobody, harmlessly


# --- the dashboard -------------------------------------------------------------------------------


def test_the_dashboard_feed_shows_the_receipt_counts_of_the_messages_on_screen(fanned, db_queue):
    message_id, (peer, _, _) = fanned
    ledger.ack_deliveries(peer, [lease_one(peer)])
    [(wanted, _)] = publishing.publish(db_queue, [publishing.Outgoing("create", "2", None, receipt=True)])

    with CaptureQueriesContext(connection) as queries:
        status = snapshot.delivery_status_of([message_id, wanted["id"]])
    feed = {m["id"]: m for m in snapshot.newest_messages()}

    assert len(queries) == 1  # one grouped query for every message on screen
    assert status[message_id] == {**ZERO, "acked": 1, "pending": 2}  # "acked 1/3"
    assert status[wanted["id"]] == {**ZERO, "pending": 3}
    assert feed[wanted["id"]]["receipt"] is True and feed[message_id]["receipt"] is False


def test_a_retried_publish_with_a_receipt_flags_the_message_its_key_found(logger, peer, db_queue):
    subscribing.subscribe(peer, db_queue)
    keyed = publishing.prepare("create", 1, key="k")
    [(first, created)] = publishing.publish(db_queue, [keyed], publisher=logger)
    assert created and not Message.objects.get(pk=first["id"]).receipt_wanted

    again = publishing.Outgoing("create", "1", "k", receipt=True)
    [(answer, created)] = publishing.publish(db_queue, [again], publisher=logger)

    assert not created and answer["id"] == first["id"]
    assert Message.objects.get(pk=first["id"]).receipt_wanted
    assert list(Delivery.objects.values_list("receipt", flat=True)) == [True]


def test_another_publishers_repeat_of_a_key_marks_nothing(logger, peer, make_subscriber, db_queue):
    """Issue 26, S3: the repeat answers with the first message (the contract), but asks no receipt
    of it: that message's progress is its publisher's alone."""
    subscribing.subscribe(make_subscriber("worker", publish=(), subscribe=("db",)), db_queue)
    [(first, _)] = publishing.publish(db_queue, [publishing.prepare("create", 1, key="k")], publisher=logger)

    again = publishing.Outgoing("create", "2", "k", receipt=True)
    [(answer, created)] = group_commit.publish(db_queue, [again], publisher=peer)

    assert not created and answer["id"] == first["id"]
    assert not Message.objects.get(pk=first["id"]).receipt_wanted
    assert list(Delivery.objects.values_list("receipt", flat=True)) == [False]


def test_a_repeat_inside_a_batch_asks_the_receipt_of_the_message_it_names(logger, make_subscriber, db_queue):
    subscribing.subscribe(make_subscriber("worker", publish=(), subscribe=("db",)), db_queue)
    batch = [publishing.Outgoing("create", "1", "k"), publishing.Outgoing("create", "1", "k", receipt=True)]
    [(a, _), (b, _)] = publishing.publish(db_queue, batch, publisher=logger)
    assert a["id"] == b["id"] and Message.objects.get(pk=a["id"]).receipt_wanted
    assert list(Delivery.objects.values_list("receipt", flat=True)) == [True]


def _kill(d, _):
    ledger.kill_deliveries(Delivery.objects.filter(pk=d.pk))


def _skip(d, _):
    ledger.skip_deliveries(Delivery.objects.filter(pk=d.pk), "op")


def _expire(d, _):
    ledger.expire_overdue_leases(now=timezone.now() + timedelta(hours=1))


def _close_the_socket(d, _):
    ledger.release_held(["ws.gone"], spend=True)


def _fail_the_webhook(d, _):
    ledger.fail_delivery(d.pk, "ws.gone", "HTTP 500")


def _unsubscribe(d, _):
    subscribing.unsubscribe(d.subscription)


def _ack(d, worker):
    ledger.ack_deliveries(worker, [d.pk])


def _nack(d, worker):
    ledger.nack_deliveries(worker, [d.pk])


SETTLERS = [_kill, _skip, _expire, _close_the_socket, _fail_the_webhook, _unsubscribe, _ack, _nack]


@pytest.mark.parametrize("settle", SETTLERS, ids=lambda f: f.__name__.strip("_"))
def test_every_way_a_delivery_settles_announces_its_receipt(
    settle, make_queue, make_subscriber, django_capture_on_commit_callbacks, monkeypatch
):
    queue = make_queue("jobs", max_attempts=1)
    worker = make_subscriber("worker", publish=(), subscribe=("jobs",))
    subscribing.subscribe(worker, queue)
    [(answer, _)] = publishing.publish(queue, [publishing.Outgoing("create", "1", None, receipt=True)])
    ledger.lease_deliveries(worker, limit=1, holder="ws.gone")
    heard = []
    monkeypatch.setattr(receipts, "settled_here", heard.extend)

    with django_capture_on_commit_callbacks(execute=True):
        settle(Delivery.objects.get(message_id=answer["id"]), worker)

    assert heard == [answer["id"]]
    assert not Delivery.objects.filter(message_id=answer["id"], status__in=ledger.OPEN).exists()
    # Logged in the same transaction, for the sockets' recheck in other processes.
    assert list(ReceiptMove.objects.values_list("message_id", flat=True)) == [answer["id"]]
