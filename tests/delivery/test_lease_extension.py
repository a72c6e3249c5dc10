"""Lease extension (API.md, Extensions): POST /api/deliveries/extend and the `extend` frame move
the ack deadline of the caller's in-flight deliveries to now + seconds, so a slow worker keeps
its delivery past the queue's ack timeout instead of seeing it handed out again."""

import asyncio
import time
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.db import connection
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from delivery import ledger, subscribing
from delivery.models import Delivery, Status
from mqsite import adb
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.conftest import client_for
from tests.support.publish import publish
from tests.support.rest import pull
from tests.support.sockets import connect, db, recv, send


def extend(who, body):
    return client_for(who).post("/api/deliveries/extend", body, format="json")


def rows(**filters):
    """(id, status, attempt, ack_deadline, lease_holder) of the deliveries, by id."""
    return sorted(
        Delivery.objects.filter(**filters).values_list(
            "id", "status", "attempt", "ack_deadline", "lease_holder"
        )
    )


MINE = object()  # in a parametrized body: the id of the caller's own in-flight delivery


# --- REST -----------------------------------------------------------------------------------------


def test_it_moves_the_deadline_of_the_callers_in_flight_deliveries(owner, db_queue):
    # given two deliveries the owner pulled, leased for the queue's 30 s
    publish(db_queue, 2)
    ids = [d["id"] for d in pull(owner)]
    # when it extends them by ten minutes
    before = timezone.now()
    r = extend(owner, {"ids": ids, "seconds": 600})
    # then both moved, to now + 600 s, still in flight, the attempt not counted again
    assert r.status_code == 200, r.content
    assert r.json() == {"extended": 2, "unknown": []}
    for d in Delivery.objects.filter(id__in=ids):
        assert d.status == Status.INFLIGHT and d.attempt == 1
        assert before + timedelta(seconds=600) <= d.ack_deadline <= timezone.now() + timedelta(seconds=600)


def test_it_may_shorten_a_lease_too(owner, db_queue):
    publish(db_queue, 1)
    (d,) = pull(owner)
    assert extend(owner, {"ids": [d["id"]], "seconds": 1}).json() == {"extended": 1, "unknown": []}
    deadline = Delivery.objects.get(pk=d["id"]).ack_deadline
    assert deadline <= timezone.now() + timedelta(seconds=1) < parse_datetime(d["ack_deadline"])


def test_ids_that_are_not_the_callers_in_flight_deliveries_are_unknown_and_stay_as_they_were(
    owner, peer, db_queue
):
    # given: the peer's in-flight delivery, and the owner's pending, acked and dead ones
    subscribing.subscribe(peer, db_queue)
    publish(db_queue, 4)
    peers = [d["id"] for d in pull(peer, "?limit=1")]
    acked, dead, mine = (d["id"] for d in pull(owner, "?limit=3"))
    assert client_for(owner).post("/api/deliveries/ack", {"ids": [acked]}, format="json").json()["acked"] == 1
    ledger.kill_deliveries(Delivery.objects.filter(pk=dead))
    pending = list(
        Delivery.objects.filter(subscriber=owner, status=Status.PENDING).values_list("id", flat=True)
    )
    assert len(pending) == 1
    before = rows()
    # when the owner extends them all, with ids of nothing at all among them
    asked = [*peers, *pending, acked, dead, 999999, 2**80, -1, mine]
    r = extend(owner, {"ids": asked, "seconds": 3600})
    # then only its own in-flight one moved; the rest are unknown, in the order given, and unchanged
    assert r.status_code == 200
    assert r.json() == {"extended": 1, "unknown": [*peers, *pending, acked, dead, 999999, 2**80, -1]}
    after = rows()
    assert [row for row in after if row[0] != mine] == [row for row in before if row[0] != mine]
    assert Delivery.objects.get(pk=mine).ack_deadline > timezone.now() + timedelta(seconds=3000)


def test_a_repeated_id_is_extended_once_and_an_empty_list_is_harmless(owner, db_queue):
    publish(db_queue, 1)
    (d,) = pull(owner)
    assert extend(owner, {"ids": [d["id"], d["id"]], "seconds": 60}).json() == {"extended": 1, "unknown": []}
    assert extend(owner, {"ids": [], "seconds": 60}).json() == {"extended": 0, "unknown": []}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"ids": MINE, "seconds": 0}, "seconds"),
        ({"ids": MINE, "seconds": 43201}, "seconds"),
        ({"ids": MINE, "seconds": "5"}, "seconds"),
        ({"ids": MINE, "seconds": True}, "seconds"),
        ({"ids": MINE, "seconds": 1.5}, "seconds"),
        ({"ids": MINE, "seconds": None}, "seconds"),
        ({"ids": MINE, "seconds": -10}, "seconds"),
        ({"ids": MINE}, "seconds"),
        ({"seconds": 10}, "ids"),
        ({"ids": "1", "seconds": 10}, "ids"),
        ({"ids": [True], "seconds": 10}, "ids"),
        ({"ids": ["1"], "seconds": 10}, "ids"),
        ({"ids": list(range(1, 10002)), "seconds": 10}, "ids"),
    ],
)
def test_a_malformed_extension_is_a_400_naming_the_field_and_moves_nothing(owner, db_queue, body, field):
    publish(db_queue, 1)
    (d,) = pull(owner)
    before = rows()
    body = {**body, "ids": [d["id"]]} if body.get("ids") is MINE else body
    r = extend(owner, body)
    assert r.status_code == 400, r.content
    assert field in r.json(), r.json()
    assert rows() == before


def test_the_limits_of_seconds_are_accepted(owner, db_queue):
    publish(db_queue, 1)
    (d,) = pull(owner)
    assert extend(owner, {"ids": [d["id"]], "seconds": 1}).json()["extended"] == 1
    assert extend(owner, {"ids": [d["id"]], "seconds": 43200}).json()["extended"] == 1


def test_only_subscribers_extend(operator_client, outsider):
    assert (
        client_for().post("/api/deliveries/extend", {"ids": [], "seconds": 5}, format="json").status_code
        == 401
    )
    r = operator_client.post("/api/deliveries/extend", {"ids": [1], "seconds": 5}, format="json")
    assert r.status_code == 403
    assert extend(outsider, {"ids": [1], "seconds": 5}).json() == {"extended": 0, "unknown": [1]}


def test_the_schema_describes_the_route(client):
    schema = client.get("/api/schema/?format=json").json()
    op = schema["paths"]["/api/deliveries/extend"]["post"]
    assert {"200", "400", "401", "403", "429"} <= set(op["responses"])
    body = schema["components"]["schemas"]["ExtendRequest"]
    assert body["properties"]["seconds"]["minimum"] == 1 and body["properties"]["seconds"]["maximum"] == 43200
    assert set(body["required"]) == {"ids", "seconds"}


# --- the deadline the expiry reads ----------------------------------------------------------------


def test_the_sweep_and_the_next_lease_honour_the_moved_deadline(owner, make_queue):
    # given a delivery leased on a queue with a 1 s ack timeout, then extended by 30 s
    quick = make_queue("quick", ack_timeout=1)
    owner.subscribe_all = True
    owner.save()
    subscribing.subscribe(owner, quick)
    publish(quick, 1)
    t0 = timezone.now()
    (d,) = ledger.lease_deliveries(owner, limit=10, queue=quick, now=t0)
    assert ledger.extend_deliveries(owner, [d["id"]], 30, now=t0).ids == [d["id"]]
    # when the sweeper runs, and another lease looks, well past the first deadline and its backoff
    later = t0 + timedelta(seconds=10)
    assert ledger.expire_overdue_leases(now=later) == 0
    assert ledger.lease_deliveries(owner, limit=10, queue=quick, now=later) == []
    # then it is still the first lease's; once the new deadline passes, it expires as any lease
    row = Delivery.objects.get(pk=d["id"])
    assert (
        row.status == Status.INFLIGHT and row.attempt == 1 and row.ack_deadline == t0 + timedelta(seconds=30)
    )
    assert ledger.expire_overdue_leases(now=t0 + timedelta(seconds=31)) == 1
    row.refresh_from_db()
    assert row.status == Status.PENDING and row.next_attempt_at == t0 + timedelta(seconds=31)


def test_a_lease_past_its_deadline_that_nobody_expired_yet_can_still_be_extended(owner, make_queue):
    # given a lease whose 1 s deadline passed, not swept yet (Pub/Sub extends it too)
    quick = make_queue("quick", ack_timeout=1)
    owner.subscribe_all = True
    owner.save()
    subscribing.subscribe(owner, quick)
    publish(quick, 1)
    (d,) = pull(owner)
    time.sleep(1.1)
    assert Delivery.objects.get(pk=d["id"]).ack_deadline < timezone.now()
    # when its holder extends it
    assert extend(owner, {"ids": [d["id"]], "seconds": 60}).json() == {"extended": 1, "unknown": []}
    # then the sweep leaves it alone, and nobody else is handed it
    assert ledger.expire_overdue_leases() == 0
    assert pull(owner) == []
    assert Delivery.objects.get(pk=d["id"]).status == Status.INFLIGHT


def test_a_lease_that_expired_is_no_longer_extended(owner, db_queue):
    publish(db_queue, 1)
    t0 = timezone.now()
    (d,) = ledger.lease_deliveries(owner, limit=1, now=t0)
    assert ledger.expire_overdue_leases(now=t0 + timedelta(seconds=31)) == 1
    before = rows()
    assert extend(owner, {"ids": [d["id"]], "seconds": 60}).json() == {"extended": 0, "unknown": [d["id"]]}
    assert rows() == before


@pytest.mark.parametrize("extending", [True, False], ids=["extending", "not-extending"])
def test_a_slow_worker_that_extends_past_the_ack_timeout_gets_no_redelivery(
    make_queue, make_subscriber, extending
):
    """Real time, over REST: a worker pulls from a queue with a 1 s ack timeout and works for
    3 s, extending its lease every half second. Nothing is handed out again, and its ack counts
    its one attempt. The same worker that does not extend sees its delivery again (the check
    that this test can fail)."""
    quick = make_queue("quick", ack_timeout=1)
    worker = make_subscriber("worker", publish=("quick",), subscribe=("quick",))
    subscribing.subscribe(worker, quick)
    publish(quick, 1)
    (d,) = pull(worker)
    assert d["attempt"] == 1
    redelivered = []
    started = time.monotonic()
    while time.monotonic() - started < 3:
        if extending:
            assert extend(worker, {"ids": [d["id"]], "seconds": 2}).json() == {"extended": 1, "unknown": []}
        ledger.expire_overdue_leases()  # the sweeper, every half second here
        redelivered += pull(worker)  # another worker of the same service pulls meanwhile
        time.sleep(0.5)
    r = client_for(worker).post("/api/deliveries/ack", {"ids": [d["id"]]}, format="json")
    row = Delivery.objects.get(pk=d["id"])
    if extending:
        assert redelivered == []
        assert r.json() == {"acked": 1, "unknown": []}
        assert row.status == Status.ACKED and row.attempt == 1
    else:
        assert [x["id"] for x in redelivered] == [d["id"]] and redelivered[0]["attempt"] == 2


# --- the socket -----------------------------------------------------------------------------------


@database_sync_to_async
def socket_world(ack_timeout=30):
    queue = Queue.objects.create(name="db", ack_timeout=ack_timeout)
    owner, owner_token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    peer, peer_token = create_subscriber("peer", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    subscribing.subscribe(peer, queue)
    return queue, owner, owner_token, peer


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_extend_frame_extends_what_the_socket_holds_and_answers_nothing():
    queue, owner, token, _ = await socket_world()
    await db(publish, queue, 2)
    comm = await connect(token)
    ids = [(await recv(comm))["id"] for _ in range(2)]
    before = timezone.now()
    await send(comm, {"type": "extend", "ids": ids, "seconds": 3600, "ref": "e1"})
    assert await comm.receive_nothing(timeout=0.3)
    for d in await db(lambda: list(Delivery.objects.filter(id__in=ids))):
        assert d.status == Status.INFLIGHT and d.attempt == 1
        assert d.ack_deadline >= before + timedelta(seconds=3600)
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_an_extend_frame_with_unknown_ids_gets_the_ack_frames_error_with_its_ref():
    queue, owner, token, peer = await socket_world()
    await db(publish, queue, 1)
    comm = await connect(token)
    mine = (await recv(comm))["id"]
    peers = await db(lambda: list(Delivery.objects.filter(subscriber=peer).values_list("id", flat=True)))
    before = await db(rows, subscriber=peer)
    await send(comm, {"type": "extend", "ids": [mine, *peers, 999999], "seconds": 60, "ref": 7})
    err = await recv(comm)
    assert err["type"] == "error" and err["code"] == "unknown_ids" and err["ref"] == 7
    assert err["ids"] == err["unknown"] == [*peers, 999999] and err["extended"] == 1
    assert err["detail"]
    assert await db(rows, subscriber=peer) == before
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "frame, field",
    [
        ({"type": "extend", "ids": MINE, "seconds": 0}, "seconds"),
        ({"type": "extend", "ids": MINE, "seconds": 43201}, "seconds"),
        ({"type": "extend", "ids": MINE, "seconds": "5"}, "seconds"),
        ({"type": "extend", "ids": MINE, "seconds": True}, "seconds"),
        ({"type": "extend", "ids": MINE, "seconds": 2.5}, "seconds"),
        ({"type": "extend", "ids": MINE}, "seconds"),
        ({"type": "extend", "seconds": 5}, "ids"),
        ({"type": "extend", "ids": [True], "seconds": 5}, "ids"),
        ({"type": "extend", "ids": "1", "seconds": 5}, "ids"),
    ],
)
async def test_a_malformed_extend_frame_gets_bad_frame_with_its_ref_and_the_socket_stays_open(frame, field):
    queue, owner, token, _ = await socket_world()
    await db(publish, queue, 1)
    comm = await connect(token)
    mine = (await recv(comm))["id"]
    before = await db(rows)
    if frame.get("ids") is MINE:
        frame = {**frame, "ids": [mine]}
    await send(comm, {**frame, "ref": "x"})
    err = await recv(comm)
    assert err["type"] == "error" and err["code"] == "bad_frame" and err["ref"] == "x", err
    assert f"'{field}'" in err["detail"], err
    assert await db(rows) == before
    await send(comm, {"type": "ping"})
    assert (await recv(comm))["type"] == "pong"
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("extending", [True, False], ids=["extending", "not-extending"])
async def test_an_extension_keeps_a_delivery_from_another_connection_after_the_first_deadline(extending):
    """Connection A holds a delivery of a queue with a 1 s ack timeout and extends it to 30 s.
    Past the first deadline and its retry backoff, with the sweep run, connection B of the same
    subscriber gets nothing (nor A again); A's ack then counts its one attempt. Without the
    extension, the delivery goes out again (the check that this test can fail)."""
    queue, owner, token, _ = await socket_world(ack_timeout=1)
    await db(publish, queue, 1)
    a = await connect(token)
    first = await recv(a)
    if extending:
        await send(a, {"type": "extend", "ids": [first["id"]], "seconds": 30})
    await asyncio.sleep(1.2)  # past the first deadline
    await db(ledger.expire_overdue_leases)
    b = await connect(token)  # its resume leases, expiring what is overdue first
    await asyncio.sleep(1.0)  # past the retry backoff of an expired lease
    await db(ledger.expire_overdue_leases)
    if extending:
        assert await b.receive_nothing(timeout=1.0)
        assert await a.receive_nothing(timeout=0.1)
        await send(a, {"type": "ack", "ids": [first["id"]]})
        assert await a.receive_nothing(timeout=0.3)  # no unknown_ids: it was still A's
        row = await db(Delivery.objects.get, pk=first["id"])
        assert row.status == Status.ACKED and row.attempt == 1
    else:
        again, deadline = [], time.monotonic() + 5  # the sockets' recheck finds it within 2 s
        while time.monotonic() < deadline and not again:
            for comm in (a, b):
                while not await comm.receive_nothing(timeout=0.2):
                    again.append(await recv(comm))
        assert [(f["id"], f["attempt"]) for f in again] == [(first["id"], 2)]
    await a.disconnect()
    await b.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_socket_extends_only_the_leases_it_holds():
    """A delivery keeps its id across attempts: a socket whose lease expired and went to
    another holder must not prolong that holder's lease, nor one of a sibling socket."""
    queue, owner, token, _ = await socket_world(ack_timeout=1)
    await db(publish, queue, 1)
    a = await connect(token)
    first = await recv(a)
    # its lease expires and, once its backoff has passed, another worker of the subscriber pulls it
    await asyncio.sleep(1.1)
    await db(ledger.expire_overdue_leases)
    later = timezone.now() + timedelta(seconds=1.5)
    (pulled,) = await db(ledger.lease_deliveries, owner, limit=1, holder="elsewhere/pull", now=later)
    assert pulled["id"] == first["id"] and pulled["attempt"] == 2
    before = await db(rows)
    # when A, late, extends it
    await send(a, {"type": "extend", "ids": [first["id"]], "seconds": 600})
    err = await recv(a)
    # then it is not A's: unknown, and the other holder's lease is as it was
    assert err["code"] == "unknown_ids" and err["ids"] == [first["id"]] and err["extended"] == 0
    assert await db(rows) == before
    await a.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="the async connection is PostgreSQL's")
async def test_the_socket_extends_on_the_async_connection_with_no_thread(monkeypatch):
    queue, owner, token, _ = await socket_world()
    await db(publish, queue, 1)
    (d,) = await db(ledger.lease_deliveries, owner, limit=1, holder="h")

    def no_thread(fn):
        raise AssertionError(f"{fn} went to a thread")

    monkeypatch.setattr(adb, "thread", no_thread)
    extended = await ledger.aextend_deliveries(owner, [d["id"], 999999], 120, holder="h")
    assert extended == ledger.Extended([d["id"]], [999999])
    monkeypatch.undo()
    row = await db(Delivery.objects.get, pk=d["id"])
    assert row.ack_deadline > timezone.now() + timedelta(seconds=100)
