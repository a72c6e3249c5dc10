"""Replay (API.md, Extensions): a new subscription `from` a point, and seek on an existing one.

Given messages published before a subscription existed, a subscription made `from` "all", a
seq or a time owes exactly those still in the hot tables from that point, in seq order; a seek
hands acked ones out again with the same delivery ids and a new attempt.
"""

from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.core.management import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from delivery import ledger, reports, subscribing
from delivery.models import Delivery, Status
from queues.models import Message
from subscribers import replay
from subscribers.models import Subscription
from tests.support.commands import listen
from tests.support.publish import publish
from tests.support.rest import ack, pull, seek, subscribe
from tests.support.sockets import recv, send


def pull_all(who, limit=1000):
    return pull(who, f"?limit={limit}")


def owed_seqs(subscription_id):
    return list(
        Delivery.objects.filter(subscription_id=subscription_id, status=Status.PENDING)
        .order_by("seq")
        .values_list("seq", flat=True)
    )


# --- a new subscription from a point --------------------------------------------------------------


def test_without_from_a_new_subscription_owes_only_what_comes_next(logger, db_queue):
    publish(db_queue, 3)
    r = subscribe(logger, {"queue": "db"})
    assert r.status_code == 201
    assert "replay" not in r.json()
    assert owed_seqs(r.json()["id"]) == []


def test_from_new_owes_nothing_old_and_says_where_it_starts(logger, db_queue):
    publish(db_queue, 3)
    r = subscribe(logger, {"queue": "db", "from": "new"})
    assert r.status_code == 201
    assert r.json()["replay"] == {"from_seq": 4, "deliveries": 0}
    assert owed_seqs(r.json()["id"]) == []


def test_from_all_owes_every_message_in_seq_order_and_a_pull_gives_them_oldest_first(logger, db_queue):
    publish(db_queue, 5)
    r = subscribe(logger, {"queue": "db", "from": "all"})
    assert r.status_code == 201
    body = r.json()
    assert body["replay"] == {"from_seq": 1, "deliveries": 5}
    assert owed_seqs(body["id"]) == [1, 2, 3, 4, 5]
    # the new deliveries are numbered in seq order too
    ids = list(
        Delivery.objects.filter(subscription_id=body["id"]).order_by("seq").values_list("id", flat=True)
    )
    assert ids == sorted(ids)
    publish(db_queue, 1, start=5)  # and it owes what comes next
    pulled = pull_all(logger)
    assert [d["seq"] for d in pulled] == [1, 2, 3, 4, 5, 6]
    assert [d["payload"] for d in pulled] == [{"n": i} for i in range(6)]
    assert all(d["attempt"] == 1 for d in pulled)


def test_from_a_seq_owes_that_message_and_those_after_it(logger, db_queue):
    publish(db_queue, 10)
    r = subscribe(logger, {"queue": "db", "from": {"seq": 7}})
    assert r.status_code == 201
    assert r.json()["replay"] == {"from_seq": 7, "deliveries": 4}
    assert [d["seq"] for d in pull_all(logger)] == [7, 8, 9, 10]


def test_from_a_time_owes_what_was_published_at_or_after_it(logger, db_queue):
    publish(db_queue, 3)
    hour_ago = timezone.now() - timedelta(hours=1)
    Message.objects.filter(seq__lte=2).update(created_at=hour_ago - timedelta(minutes=5))
    Message.objects.filter(seq=3).update(created_at=hour_ago + timedelta(minutes=5))
    publish(db_queue, 2, start=3)
    r = subscribe(logger, {"queue": "db", "from": {"time": hour_ago.isoformat()}})
    assert r.status_code == 201
    assert r.json()["replay"] == {"from_seq": 3, "deliveries": 3}
    assert [d["seq"] for d in pull_all(logger)] == [3, 4, 5]


def test_a_time_without_an_offset_is_utc_and_z_works_too(logger, peer, db_queue):
    publish(db_queue, 2)
    at = timezone.now() - timedelta(minutes=1)
    Message.objects.filter(seq=1).update(created_at=at - timedelta(seconds=10))
    naive = at.replace(tzinfo=None).isoformat()
    r = subscribe(logger, {"queue": "db", "from": {"time": naive}})
    assert r.json()["replay"] == {"from_seq": 2, "deliveries": 1}
    z = at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    r = subscribe(peer, {"queue": "db", "from": {"time": z}})
    assert r.json()["replay"] == {"from_seq": 2, "deliveries": 1}


@pytest.mark.parametrize(
    ("time", "from_seq", "owed"),
    [("0001-01-01T00:00:00+23:59", 1, 2), ("9999-12-31T23:59:59.999999-23:59", 3, 0), ("2026-11-24", 1, 2)],
)
def test_a_time_at_the_ends_of_the_calendar_is_the_oldest_or_past_the_last(
    logger, db_queue, time, from_seq, owed
):
    publish(db_queue, 2)
    r = subscribe(logger, {"queue": "db", "from": {"time": time}})
    assert r.status_code == 201, r.content
    assert r.json()["replay"] == {"from_seq": from_seq, "deliveries": owed}


def test_a_point_past_the_last_seq_owes_nothing_and_says_that_point(logger, peer, db_queue):
    publish(db_queue, 3)
    r = subscribe(logger, {"queue": "db", "from": {"seq": 50}})
    assert r.json()["replay"] == {"from_seq": 50, "deliveries": 0}
    future = (timezone.now() + timedelta(days=1)).isoformat()
    r = subscribe(peer, {"queue": "db", "from": {"time": future}})
    assert r.json()["replay"] == {"from_seq": 4, "deliveries": 0}
    assert not Delivery.objects.exists()


def test_a_subscription_to_one_event_replays_only_that_event(logger, peer, db_queue):
    publish(db_queue, 2, event="create")
    publish(db_queue, 2, event="delete", start=2)
    publish(db_queue, 1, event="create", start=4)
    r = subscribe(logger, {"queue": "db", "event": "create", "from": "all"})
    assert r.json()["replay"] == {"from_seq": 1, "deliveries": 3}
    assert [(d["seq"], d["event"]) for d in pull_all(logger)] == [(1, "create"), (2, "create"), (5, "create")]
    # a subscription to every event replays them all
    r = subscribe(peer, {"queue": "db", "from": {"seq": 2}})
    assert r.json()["replay"] == {"from_seq": 2, "deliveries": 4}
    assert [d["seq"] for d in pull_all(peer)] == [2, 3, 4, 5]


def test_replay_reaches_back_as_far_as_the_hot_tables_and_says_from_where(logger, peer, db_queue):
    publish(db_queue, 10)
    Message.objects.filter(seq__lte=4).delete()  # archived (retention)
    r = subscribe(logger, {"queue": "db", "from": {"seq": 2}})
    assert r.json()["replay"] == {"from_seq": 5, "deliveries": 6}
    r = subscribe(peer, {"queue": "db", "from": "all"})
    assert r.json()["replay"] == {"from_seq": 5, "deliveries": 6}
    assert [d["seq"] for d in pull_all(logger)] == [5, 6, 7, 8, 9, 10]


def test_all_of_a_queue_with_nothing_left_starts_after_its_last_seq(logger, db_queue):
    publish(db_queue, 3)
    Message.objects.all().delete()
    r = subscribe(logger, {"queue": "db", "from": "all"})
    assert r.json()["replay"] == {"from_seq": 4, "deliveries": 0}


def test_the_same_subscription_again_with_from_replays_nothing(logger, db_queue):
    # A client sends its subscribe again at each reconnect: it must not get its history again.
    first = subscribe(logger, {"queue": "db", "from": "all"}).json()
    publish(db_queue, 3)
    ack(logger, [d["id"] for d in pull_all(logger)])
    again = subscribe(logger, {"queue": "db", "from": "all"})
    assert again.status_code == 200
    assert again.json() == {**first, "replay": {"from_seq": None, "deliveries": 0}}
    assert Subscription.objects.count() == 1
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_a_replay_that_overlaps_live_publishes_owes_each_message_once(logger, db_queue):
    publish(db_queue, 3)
    r = subscribe(logger, {"queue": "db", "from": "all"}).json()
    publish(db_queue, 2, start=3)
    replayed = subscribing.seek(Subscription.objects.get(pk=r["id"]), replay.Point("all"))
    assert replayed.deliveries == 0  # all owed already: nothing doubled
    assert owed_seqs(r["id"]) == [1, 2, 3, 4, 5]


# --- seek ---------------------------------------------------------------------------------------


def test_a_seek_hands_acked_messages_out_again_with_the_same_ids_and_a_new_attempt(logger, db_queue):
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 5)
    first = pull_all(logger)
    ack(logger, [d["id"] for d in first])
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}

    r = seek(logger, sub["id"], {"seq": 3})
    assert r.status_code == 200
    assert r.json() == {**sub, "replay": {"from_seq": 3, "deliveries": 3}}
    reopened = Delivery.objects.filter(seq__gte=3)
    assert set(reopened.values_list("status", flat=True)) == {Status.PENDING}
    assert set(reopened.values_list("acked_at", flat=True)) == {None}
    assert set(Delivery.objects.filter(seq__lt=3).values_list("status", flat=True)) == {Status.ACKED}

    again = pull_all(logger)
    assert [(d["id"], d["seq"]) for d in again] == [(d["id"], d["seq"]) for d in first[2:]]
    assert [d["attempt"] for d in again] == [2, 2, 2]
    ack(logger, [d["id"] for d in again])
    assert Delivery.objects.filter(status=Status.ACKED).count() == 5


def test_a_seek_by_time_adds_what_the_subscription_never_had(logger, db_queue):
    publish(db_queue, 3)  # before the subscription
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 2, start=3)
    Message.objects.filter(seq=1).update(created_at=timezone.now() - timedelta(days=2))
    r = seek(logger, sub["id"], {"time": (timezone.now() - timedelta(days=1)).isoformat()})
    assert r.json()["replay"] == {"from_seq": 2, "deliveries": 2}
    assert [d["seq"] for d in pull_all(logger)] == [2, 3, 4, 5]


def test_a_seek_leaves_in_flight_ones_alone_and_makes_dead_ones_pending_with_a_fresh_count(logger, db_queue):
    db_queue.max_attempts = 1
    db_queue.save()
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 3)
    one, two, three = pull_all(logger)
    ack(logger, [one["id"]])
    ledger.nack_deliveries(logger, [two["id"]])  # its last attempt: dead
    assert Delivery.objects.get(pk=two["id"]).status == Status.DEAD
    r = seek(logger, sub["id"], {"seq": 1})
    assert r.json()["replay"] == {"from_seq": 1, "deliveries": 2}
    rows = {d.pk: d for d in Delivery.objects.all()}
    assert rows[one["id"]].status == Status.PENDING and rows[one["id"]].attempt == 1
    assert rows[two["id"]].status == Status.PENDING and rows[two["id"]].attempt == 0
    assert rows[three["id"]].status == Status.INFLIGHT  # left to be acked or to expire
    assert [(d["id"], d["attempt"]) for d in pull_all(logger)] == [(one["id"], 2), (two["id"], 1)]


def test_a_seek_of_another_subscribers_subscription_is_404_and_moves_nothing(logger, peer, db_queue):
    theirs = subscribe(peer, {"queue": "db"}).json()
    publish(db_queue, 2)
    ack(peer, [d["id"] for d in pull_all(peer)])
    for pk in (theirs["id"], 999999, 2**70):
        assert seek(logger, pk, {"seq": 1}).status_code == 404
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_a_seek_needs_the_right_to_subscribe_still(logger, db_queue):
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 2)
    ack(logger, [d["id"] for d in pull_all(logger)])
    logger.subscribe_queues.clear()
    assert seek(logger, sub["id"], {"seq": 1}).status_code == 403
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"seq": 0},
        {"seq": -1},
        {"seq": "3"},
        {"seq": 1.5},
        {"seq": True},
        {"seq": 2**63},
        {"time": "yesterday"},
        {"time": 5},
        {"time": "2026-13-01T00:00:00Z"},
        {"seq": 1, "time": "2026-11-24T14:00:00Z"},
        {"seq": 1, "x": 1},
        "all",
        [1],
        None,
    ],
)
def test_a_bad_seek_is_400_and_moves_nothing(logger, db_queue, body):
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 2)
    ack(logger, [d["id"] for d in pull_all(logger)])
    r = seek(logger, sub["id"], body)
    assert r.status_code == 400, (body, r.content)
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "point",
    [
        "ALL",
        "",
        "old",
        5,
        None,
        [],
        {},
        {"seq": 0},
        {"seq": -5},
        {"seq": "1"},
        {"seq": 1.0},
        {"seq": False},
        {"seq": 2**63},
        {"time": "not a time"},
        {"time": "2026-02-30T00:00:00"},
        {"time": 1732000000},
        {"time": "2026-11-24T14:00:00Z", "seq": 1},
        {"when": "2026-11-24T14:00:00Z"},
    ],
)
def test_a_bad_from_is_400_naming_it_and_no_subscription_is_made(logger, db_queue, point):
    publish(db_queue, 2)
    r = subscribe(logger, {"queue": "db", "from": point})
    assert r.status_code == 400, (point, r.content)
    assert "from" in r.json()
    assert not Subscription.objects.exists()
    assert not Delivery.objects.exists()


def test_replay_needs_the_right_to_subscribe(outsider, logger, make_queue):
    publish(make_queue("other"), 2)
    assert subscribe(logger, {"queue": "other", "from": "all"}).status_code == 403
    assert not Subscription.objects.exists() and not Delivery.objects.exists()


# --- ordered queues -------------------------------------------------------------------------------


def test_a_replay_on_an_ordered_queue_goes_in_seq_order_one_at_a_time_behind_one_in_flight(logger, db_queue):
    db_queue.ordered = True
    db_queue.save()
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 3)
    for _ in range(2):  # seq 1 and 2 are processed
        (d,) = pull_all(logger)
        ack(logger, [d["id"]])
    (in_flight,) = pull_all(logger)  # seq 3 is in flight
    assert in_flight["seq"] == 3
    publish(db_queue, 1, start=3)

    r = seek(logger, sub["id"], {"seq": 1})
    assert r.json()["replay"] == {"from_seq": 1, "deliveries": 2}
    # nothing more while seq 3 is in flight, though seq 1 and 2 are owed again before it
    assert pull_all(logger) == []
    ack(logger, [in_flight["id"]])
    seen = []
    while leased := pull_all(logger):
        assert len(leased) == 1  # one at a time
        assert pull_all(logger) == []  # and nothing else while it is in flight
        seen.append(leased[0]["seq"])
        ack(logger, [leased[0]["id"]])
    assert seen == [1, 2, 4]


def test_the_head_of_line_is_the_one_in_flight_when_a_seek_reopened_seqs_behind_it(logger, db_queue):
    db_queue.ordered = True
    db_queue.save()
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(db_queue, 3)
    for _ in range(2):
        ack(logger, [d["id"] for d in pull_all(logger)])
    (in_flight,) = pull_all(logger)
    seek(logger, sub["id"], {"seq": 1})
    assert reports.head_of(sub["id"]).pk == in_flight["id"]
    (head,) = reports.blocked_heads()
    assert (head.delivery.pk, head.behind) == (in_flight["id"], 2)
    assert head.reason.startswith("in flight")


def test_a_new_subscription_from_all_on_an_ordered_queue_is_handed_out_in_seq_order(logger, db_queue):
    db_queue.ordered = True
    db_queue.save()
    publish(db_queue, 4)
    subscribe(logger, {"queue": "db", "from": "all"})
    publish(db_queue, 1, start=4)
    seen = []
    while leased := pull_all(logger):
        assert len(leased) == 1
        seen.append(leased[0]["seq"])
        ack(logger, [leased[0]["id"]])
    assert seen == [1, 2, 3, 4, 5]


# --- in sets ------------------------------------------------------------------------------------


def test_a_replay_of_many_messages_is_a_few_statements_per_chunk(logger, peer, db_queue, settings):
    """Chunks of MQ_REPLAY_CHUNK seqs, each its own transaction of a fixed few statements (a
    set operation on at most that many rows), so that no replay holds the writer for long."""
    settings.MQ_REPLAY_CHUNK = chunk = 1000
    n = 20_000
    for start in range(0, n, 1000):
        publish(db_queue, 1000, start=start)

    def statements(who, point, seek=None):
        with CaptureQueriesContext(connection) as made:
            if seek is None:
                _, created, replayed = subscribing.subscribe_from(who, db_queue, None, point, limited=True)
                assert created
            else:
                replayed = subscribing.seek(seek, point)
        return replayed, [q["sql"] for q in made if "SAVEPOINT" not in q["sql"]]

    few, few_made = statements(peer, replay.Point("seq", n - 9))
    many, many_made = statements(logger, replay.Point("all"))
    assert (few, many) == (ledger.Replayed(n - 9, 10), ledger.Replayed(1, n))
    # each further chunk: read and hold the subscription row, the INSERT, move its cursor
    assert len(many_made) - len(few_made) == (n // chunk - 1) * 3, many_made
    assert Delivery.objects.filter(subscriber=logger, status=Status.PENDING).count() == n

    # a seek that hands 10,000 acked ones out again: the chunk's UPDATE too
    ack(logger, Delivery.objects.filter(subscriber=logger, seq__lte=n // 2).values_list("id", flat=True))
    ack(peer, Delivery.objects.filter(subscriber=peer).values_list("id", flat=True))
    few, few_made = statements(
        peer, replay.Point("seq", n - 9), seek=Subscription.objects.get(subscriber=peer)
    )
    many, many_made = statements(
        logger, replay.Point("seq", 1), seek=Subscription.objects.get(subscriber=logger)
    )
    assert (few, many) == (ledger.Replayed(n - 9, 10), ledger.Replayed(1, n // 2))
    assert len(many_made) - len(few_made) == (n // chunk - 1) * 4, many_made
    assert Delivery.objects.filter(subscriber=logger, status=Status.PENDING).count() == n


# --- the socket ---------------------------------------------------------------------------------


async def _socket(token):
    from channels.testing import WebsocketCommunicator

    from mqsite.asgi import application

    comm = WebsocketCommunicator(application, f"/ws/?token={token}")
    connected, _ = await comm.connect(timeout=5)
    assert connected
    return comm


def _setup_socket_world(ordered=False, n=3):
    from queues.models import Queue
    from subscribers.provisioning import create_subscriber

    queue = Queue.objects.create(name="db", ordered=ordered)
    subscriber, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    publish(queue, n)
    return queue, subscriber, token


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_subscribe_frame_from_all_is_answered_with_the_replay_then_the_history_in_order():
    queue, _, token = await database_sync_to_async(_setup_socket_world)(n=3)
    comm = await _socket(token)
    await send(comm, {"type": "subscribe", "queue": "db", "from": "all"})
    subscribed = await recv(comm)
    assert subscribed["type"] == "subscribed"
    assert subscribed["replay"] == {"from_seq": 1, "deliveries": 3}
    frames = [await recv(comm) for _ in range(3)]
    assert [(f["type"], f["seq"], f["payload"]) for f in frames] == [
        ("message", i + 1, {"n": i}) for i in range(3)
    ]
    await send(comm, {"type": "ack", "ids": [f["id"] for f in frames]})
    # sent again (a reconnecting client does): the same subscription, nothing replayed again
    await send(comm, {"type": "subscribe", "queue": "db", "from": "all"})
    again = await recv(comm)
    assert again == {**subscribed, "replay": {"from_seq": None, "deliveries": 0}}
    assert await comm.receive_nothing(0.3)
    # without "from", the answer is as it always was
    await send(comm, {"type": "subscribe", "queue": "db"})
    assert "replay" not in await recv(comm)
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("point", ["everything", {"seq": 0}, {"time": "soon"}, {"seq": 1, "time": "x"}, None])
async def test_a_subscribe_frame_with_a_bad_from_is_an_error_frame_and_makes_nothing(point):
    _, _, token = await database_sync_to_async(_setup_socket_world)()
    comm = await _socket(token)
    await send(comm, {"type": "subscribe", "queue": "db", "from": point, "ref": 7})
    error = await recv(comm)
    assert error["type"] == "error" and error["code"] == "bad_frame" and error["ref"] == 7
    assert error["detail"].startswith("from: ")
    assert not await database_sync_to_async(Subscription.objects.exists)()
    await send(comm, {"type": "ping"})  # the socket stays open
    assert (await recv(comm))["type"] == "pong"
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_replay_on_an_ordered_queue_comes_over_the_socket_one_at_a_time_in_seq_order():
    queue, subscriber, token = await database_sync_to_async(_setup_socket_world)(ordered=True, n=4)
    comm = await _socket(token)
    await send(comm, {"type": "subscribe", "queue": "db", "from": {"seq": 2}})
    assert (await recv(comm))["replay"] == {"from_seq": 2, "deliveries": 3}
    seen = []
    for _ in range(3):
        frame = await recv(comm)
        assert await comm.receive_nothing(0.2)  # nothing else while it is in flight
        seen.append(frame["seq"])
        await send(comm, {"type": "ack", "ids": [frame["id"]]})
    assert seen == [2, 3, 4]
    await comm.disconnect()


# --- manage.py listen --from --------------------------------------------------------------------


def test_listen_from_all_makes_the_subscription_and_prints_the_history_oldest_first(logger, db_queue):
    publish(db_queue, 4)
    got = listen("logger", "db", "--from", "all", "--count", "4")
    assert [d["seq"] for d in got] == [1, 2, 3, 4]
    assert Subscription.objects.get(subscriber=logger).event is None
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_listen_from_a_seq_seeks_an_existing_subscription_back(logger, db_queue):
    subscribing.subscribe(logger, db_queue)
    publish(db_queue, 3)
    first = listen("logger", "db", "--count", "3")
    again = listen("logger", "db", "--from", "2", "--count", "2")
    assert [(d["id"], d["seq"], d["attempt"]) for d in again] == [(d["id"], d["seq"], 2) for d in first[1:]]


def test_listen_from_a_time_of_one_event_replays_only_that_event(logger, db_queue):
    subscribing.subscribe(logger, db_queue)  # to every event
    publish(db_queue, 2, event="create")
    publish(db_queue, 2, event="delete", start=2)
    listen("logger", "db", "--count", "4")
    got = listen(
        "logger", "db", "create", "--from", (timezone.now() - timedelta(hours=1)).isoformat(), "--count", "2"
    )
    assert [(d["seq"], d["event"]) for d in got] == [(1, "create"), (2, "create")]
    # the other event's history was not handed out again
    assert set(Delivery.objects.filter(event__name="delete").values_list("status", flat=True)) == {
        Status.ACKED
    }


@pytest.mark.parametrize("start", ["yesterday", "0", "-3", "2026-13-01T00:00:00"])
def test_listen_refuses_a_bad_from(logger, db_queue, start):
    with pytest.raises(CommandError, match="--from"):
        listen("logger", "db", "--from", start)
    assert not Subscription.objects.exists()


# --- the admin ----------------------------------------------------------------------------------


def _replay_action(client, subscriptions, **form):
    return client.post(
        reverse("admin:subscribers_subscription_changelist"),
        {"action": "replay_from", "_selected_action": [s.pk for s in subscriptions], **form},
        follow=True,
    )


def test_the_admin_asks_where_from_then_replays_the_selected_subscriptions(staff, operator, logger, db_queue):
    sub, _ = subscribing.subscribe(logger, db_queue)
    publish(db_queue, 4)
    first = pull_all(logger)
    ack(logger, [d["id"] for d in first])

    asked = _replay_action(staff, [sub])
    assert asked.status_code == 200
    assert "Replay from" in asked.content.decode() and 'name="start"' in asked.content.decode()
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}  # nothing yet

    bad = _replay_action(staff, [sub], start="someday")
    assert "time must be an ISO 8601" in bad.content.decode()
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}

    done = _replay_action(staff, [sub], start="3")
    assert "replayed from seq 3: 2 deliveries owed again" in done.content.decode()
    assert [(d["id"], d["attempt"]) for d in pull_all(logger)] == [(d["id"], 2) for d in first[2:]]
    entry = LogEntry.objects.get(object_id=str(sub.pk))
    assert entry.user == operator and "replayed from seq 3" in entry.get_change_message()


def test_the_admin_replay_needs_the_right_to_change_deliveries(django_user_model, logger, db_queue):
    sub, _ = subscribing.subscribe(logger, db_queue)
    publish(db_queue, 1)
    ack(logger, [d["id"] for d in pull_all(logger)])
    viewer = django_user_model.objects.create_user("viewer", password="pw-viewer-1", is_staff=True)
    viewer.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_subscription", "view_delivery"])
    )
    client = Client()
    client.force_login(viewer)
    page = client.get(reverse("admin:subscribers_subscription_changelist"))
    assert page.status_code == 200 and "replay_from" not in page.content.decode()
    _replay_action(client, [sub], start="all")
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}
