"""The /ws/ consumer, frame by frame, through Channels' WebsocketCommunicator."""

import time

import pytest
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from delivery import consumers, subscribing
from delivery.models import Delivery, Status
from mqsite.asgi import application
from queues.models import Queue
from subscribers.models import Connection
from subscribers.provisioning import create_subscriber
from tests.support.fields import MESSAGE_FRAME_FIELDS
from tests.support.publish import apublish
from tests.support.sockets import connect, db, recv, recv_messages, send, setup

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


async def test_a_bad_token_is_accepted_then_closed_with_4401():
    await setup()
    comm = WebsocketCommunicator(application, "/ws/?token=mq_wrong")
    connected, _ = await comm.connect(timeout=5)
    assert connected
    out = await comm.receive_output(timeout=3)
    assert out == {"type": "websocket.close", "code": 4401}
    assert await db(Connection.objects.count) == 0


async def test_the_token_may_come_in_the_authorization_header():
    _, (_, token), _ = await setup()
    comm = WebsocketCommunicator(
        application, "/ws/", headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    connected, _ = await comm.connect(timeout=5)
    assert connected
    await send(comm, {"type": "ping", "ref": 1})
    assert await recv(comm) == {"type": "pong", "ref": 1}
    await comm.disconnect()


async def test_subscribe_answers_then_catches_up_then_goes_live():
    queue, (_, token), _ = await setup()
    await apublish(queue, 2)  # before the subscription: not owed
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "event": "create"})
    answer = await recv(comm)
    assert answer["type"] == "subscribed" and answer["queue"] == "db" and answer["event"] == "create"
    assert isinstance(answer["subscription"], int)
    assert await comm.receive_nothing(timeout=0.3)
    await apublish(queue, 3)
    frames = await recv_messages(comm, 3)
    assert [f["seq"] for f in frames] == [3, 4, 5]
    f = frames[0]
    assert set(f) == MESSAGE_FRAME_FIELDS
    assert f["payload"] == {"n": 0} and f["attempt"] == 1 and f["queue"] == "db"
    await comm.disconnect()


async def test_a_reconnecting_subscriber_that_subscribes_again_gets_the_answer_before_the_catch_up(
    long_grace,
):
    # The long grace: on a loaded machine the subscribe frame could come after the real one
    # (0.2 s, a cap), and the catch-up rightly go first; here the frame itself must end it.
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue, "create"))
    await apublish(queue, 3)  # while away
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "event": "create"})
    answer = await recv(comm)
    assert answer["type"] == "subscribed"
    frames = await recv_messages(comm, 3)
    assert [f["seq"] for f in frames] == [1, 2, 3]
    await comm.disconnect()


async def test_a_reconnecting_subscriber_resumes_without_subscribing_again():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 3)  # while away
    comm = await connect(token)
    frames = await recv_messages(comm, 3)
    assert [f["seq"] for f in frames] == [1, 2, 3]
    await apublish(queue, 1, start=3)
    (live,) = await recv_messages(comm, 1)
    assert live["seq"] == 4
    await comm.disconnect()


@pytest.fixture
def long_grace(monkeypatch):
    """A resume grace far longer than a test waits: what comes promptly did not wait it out."""
    monkeypatch.setattr(consumers, "RESUME_GRACE_SECS", 30)


async def test_the_resume_waits_until_every_subscription_was_subscribed_again(long_grace):
    queue, (owner, token), _ = await setup()
    first = await db(lambda: subscribing.subscribe(owner, queue, "create")[0])
    second = await db(lambda: subscribing.subscribe(owner, queue, "update")[0])
    await apublish(queue, 2, event="create")  # while away
    await apublish(queue, 2, event="update", start=2)
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "event": "create"})
    assert (await recv(comm))["subscription"] == first.pk
    # One subscription is still to be named again: nothing yet, of either.
    assert await comm.receive_nothing(timeout=0.5)
    await send(comm, {"type": "subscribe", "queue": "db", "event": "update", "ref": 2})
    answer = await recv(comm)
    assert (answer["type"], answer["subscription"]) == ("subscribed", second.pk)
    frames = await recv_messages(comm, 4)  # then the catch-up, without waiting out the grace
    assert sorted(f["seq"] for f in frames) == [1, 2, 3, 4]
    await comm.disconnect()


async def test_a_frame_other_than_subscribe_ends_the_resume_grace(long_grace):
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue, "create"))
    await db(lambda: subscribing.subscribe(owner, queue, "update"))
    await apublish(queue, 2)
    comm = await connect(token)
    await send(comm, {"type": "ping", "ref": 1})  # a client that subscribes again sends those first
    assert await recv(comm) == {"type": "pong", "ref": 1}
    frames = await recv_messages(comm, 2)
    assert [f["seq"] for f in frames] == [1, 2]
    await comm.disconnect()


async def test_a_subscriber_without_subscriptions_is_not_held_by_the_grace(long_grace):
    queue, (owner, token), _ = await setup()
    comm = WebsocketCommunicator(application, "/ws/")
    assert (await comm.connect(timeout=5))[0]
    await send(comm, {"type": "auth", "token": token})
    assert (await recv(comm))["type"] == "authenticated"  # it has looked its subscriptions up
    await db(lambda: subscribing.subscribe(owner, queue))  # made elsewhere (REST) meanwhile
    await apublish(queue, 1)
    (frame,) = await recv_messages(comm, 1)
    assert frame["seq"] == 1
    await comm.disconnect()


async def test_a_socket_that_sends_nothing_resumes_after_the_grace():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 1)
    comm = await connect(token)
    assert await comm.receive_nothing(timeout=consumers.RESUME_GRACE_SECS / 2)  # it may yet subscribe again
    (frame,) = await recv_messages(comm, 1)
    assert frame["seq"] == 1
    await comm.disconnect()


async def test_ack_frames_ack_and_unknown_ids_get_an_error_frame():
    queue, (owner, token), (peer, peer_token) = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await db(lambda: subscribing.subscribe(peer, queue))
    await apublish(queue, 1)
    comm = await connect(token)
    (mine,) = await recv_messages(comm, 1)
    peers = await db(lambda: list(Delivery.objects.filter(subscriber=peer).values_list("id", flat=True)))
    await send(comm, {"type": "ack", "ids": [mine["id"], *peers]})
    err = await recv(comm)
    assert err["type"] == "error" and err["code"] == "unknown_ids" and err["ids"] == peers
    statuses = await db(lambda: dict(Delivery.objects.values_list("subscriber__name", "status")))
    assert statuses == {"owner": Status.ACKED, "peer": Status.PENDING}
    await send(comm, {"type": "ack", "ids": [mine["id"]]})  # twice: harmless, no answer
    assert await comm.receive_nothing(timeout=0.3)
    await comm.disconnect()


async def test_a_nack_frame_gives_the_delivery_back_for_a_retry():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 1)
    comm = await connect(token)
    (first,) = await recv_messages(comm, 1)
    await send(comm, {"type": "nack", "ids": [first["id"]], "retry_in": 0, "error": "disk full"})
    (again,) = await recv_messages(comm, 1)
    assert again["id"] == first["id"] and again["attempt"] == 2
    row = await db(lambda: Delivery.objects.get(pk=first["id"]))
    assert row.last_error == "nacked by the client: disk full"
    await send(comm, {"type": "nack", "ids": [999999]})
    err = await recv(comm)
    assert err["code"] == "unknown_ids"
    await comm.disconnect()


@override_settings(MQ_PREFETCH=3)
async def test_no_more_than_the_prefetch_window_is_in_flight_on_a_connection():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 5)
    comm = await connect(token)
    frames = await recv_messages(comm, 3)
    assert await comm.receive_nothing(timeout=0.5)
    await send(comm, {"type": "ack", "ids": [frames[0]["id"]]})
    (fourth,) = await recv_messages(comm, 1)
    assert fourth["seq"] == 4
    await comm.disconnect()


async def test_an_ordered_queue_is_delivered_one_at_a_time_in_order():
    queue, (owner, token), _ = await setup(ordered=True)
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 4)
    comm = await connect(token)
    seqs = []
    for _ in range(4):
        (f,) = await recv_messages(comm, 1)
        assert await comm.receive_nothing(timeout=0.2)
        seqs.append(f["seq"])
        await send(comm, {"type": "ack", "ids": [f["id"]]})
    assert seqs == [1, 2, 3, 4]
    await comm.disconnect()


async def test_an_ordered_queues_next_message_follows_its_ack_not_a_recheck(monkeypatch):
    """With one delivery in flight, the ack is what makes the next one leasable: the socket
    must lease it once that ack commits. The pump woken before the commit found the head still
    in flight, and then nothing but the recheck (2 s, made far longer here) woke it again.
    Each ack is written a little late here, as on a loaded server, where the race was lost."""
    import asyncio

    from delivery import ledger, socket_loops

    monkeypatch.setattr(socket_loops, "RECHECK_SECS", 60)
    ack = ledger.aack_deliveries

    async def late_ack(*args, **kwargs):
        await asyncio.sleep(0.1)
        return await ack(*args, **kwargs)

    monkeypatch.setattr(ledger, "aack_deliveries", late_ack)
    queue, (owner, token), _ = await setup(ordered=True)
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 5)
    comm = await connect(token)
    seqs = []
    for _ in range(5):
        (f,) = await recv_messages(comm, 1, timeout=1.5)
        seqs.append(f["seq"])
        await send(comm, {"type": "ack", "ids": [f["id"]]})
    assert seqs == [1, 2, 3, 4, 5]
    await comm.disconnect()


async def test_two_connections_of_one_subscriber_share_its_deliveries():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    a, b = await connect(token), await connect(token)
    await apublish(queue, 40)
    got = {"a": [], "b": []}
    deadline = time.monotonic() + 15  # however slow the machine, not a fixed number of looks
    while len(got["a"] + got["b"]) < 40 and time.monotonic() < deadline:
        for name, comm in (("a", a), ("b", b)):  # a receive that times out would end the consumer: look first
            while not await comm.receive_nothing(timeout=0.05):
                got[name].append((await recv(comm))["id"])
    assert await a.receive_nothing(timeout=0.3) and await b.receive_nothing(timeout=0.3)  # no 41st
    everything = got["a"] + got["b"]
    assert len(everything) == 40 and len(set(everything)) == 40
    await a.disconnect()
    await b.disconnect()


async def test_a_closed_socket_hands_back_what_it_held_at_once_its_attempts_spent():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 3)
    comm = await connect(token)
    await recv_messages(comm, 3)
    assert await db(lambda: Delivery.objects.filter(status=Status.INFLIGHT).count()) == 3
    await comm.disconnect()
    assert await db(lambda: Delivery.objects.filter(status=Status.PENDING).count()) == 3
    comm = await connect(token)
    frames = await recv_messages(comm, 3)
    # The attempts were spent (API.md, Extensions): a message its client dies on must die.
    assert [f["attempt"] for f in frames] == [2, 2, 2]
    await comm.disconnect()


async def test_a_message_its_client_dies_on_is_dead_after_max_attempts_and_the_order_moves_on():
    """The poison message: an ordered queue's head that makes its client drop the socket,
    every time. It used to be handed out for ever, blocking the queue."""
    queue, (owner, token), _ = await setup(ordered=True)
    await db(lambda: Queue.objects.filter(pk=queue.pk).update(max_attempts=3))
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 2)
    for attempt in (1, 2, 3):
        comm = await connect(token)
        (poison,) = await recv_messages(comm, 1)
        assert (poison["payload"], poison["attempt"]) == ({"n": 0}, attempt)
        await comm.disconnect()  # the client crashed on it
    dead = await db(lambda: Delivery.objects.get(pk=poison["id"]))
    assert dead.status == Status.DEAD
    assert dead.last_error == "connection closed while in flight, 3 times"
    comm = await connect(token)
    (after,) = await recv_messages(comm, 1)
    assert (after["payload"], after["attempt"]) == ({"n": 1}, 1)
    await comm.disconnect()


async def test_the_servers_own_shutdown_gives_the_attempts_back():
    from delivery.socket_loops import release_open_sockets

    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 2)
    comm = await connect(token)
    await recv_messages(comm, 2)
    await release_open_sockets()
    held = await db(lambda: list(Delivery.objects.values_list("status", "attempt")))
    assert held == [(Status.PENDING, 0), (Status.PENDING, 0)]
    await comm.disconnect()


async def test_a_connection_that_fails_under_it_stops_leasing_and_gives_back_what_it_held(monkeypatch):
    """An error under the consumer (here in handling a frame) ends it with an error, not a
    disconnect: its pump must not live on, leasing deliveries for a socket that is gone until
    they die."""
    import asyncio

    from delivery.consumers import DeliveryConsumer

    async def broken_transport(self, message):
        raise ConnectionError("the transport went away")

    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 3)
    comm = await connect(token)
    await recv_messages(comm, 3)
    monkeypatch.setattr(DeliveryConsumer, "websocket_receive", broken_transport)
    await send(comm, {"type": "ping"})
    with pytest.raises(ConnectionError):
        await comm.receive_output(timeout=3)
    assert await db(lambda: Delivery.objects.filter(status=Status.PENDING).count()) == 3
    assert await db(Connection.objects.count) == 0
    await apublish(queue, 2, start=3)
    await asyncio.sleep(2.5)  # longer than the pump's timer
    assert await db(lambda: Delivery.objects.filter(status=Status.INFLIGHT).count()) == 0


async def test_what_becomes_ready_without_a_wake_up_comes_within_the_recheck():
    """A nacked delivery's retry falls due with nobody publishing: no wake-up is sent, and the
    process's recheck loop (one query for all its sockets) must find it and wake the socket."""
    from delivery.socket_loops import RECHECK_SECS

    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    comm = await connect(token)
    await apublish(queue, 1)
    [first] = await recv_messages(comm, 1)
    await send(comm, {"type": "nack", "ids": [first["id"]], "retry_in": 0.3})
    [again] = await recv_messages(comm, 1, timeout=RECHECK_SECS * 2 + 1)
    assert (again["id"], again["attempt"]) == (first["id"], 2)
    await comm.disconnect()


async def test_publish_frames_publish_and_answer_with_the_ref():
    queue, (owner, token), (peer, _) = await setup()
    await db(lambda: subscribing.subscribe(peer, queue))
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": "db", "event": "create", "payload": {"x": 1}, "ref": "r1"})
    answer = await recv(comm)
    assert answer["type"] == "published" and answer["ref"] == "r1"
    assert answer["seq"] == 1 and answer["deliveries"] == 1 and isinstance(answer["id"], int)
    await send(
        comm, {"type": "publish", "queue": "db", "event": "create", "payload": 2, "key": "k", "ref": 2}
    )
    first = await recv(comm)
    await send(
        comm, {"type": "publish", "queue": "db", "event": "create", "payload": 3, "key": "k", "ref": 3}
    )
    second = await recv(comm)
    assert first["id"] == second["id"] and second["ref"] == 3
    await comm.disconnect()


async def test_publish_frames_in_flight_together_are_published_in_the_order_sent():
    """A client need not wait for each `published`: frames keep their order in seq, and a bad
    one among them (a queue it may not use) gets its own error without stopping the rest."""
    queue, (owner, token), _ = await setup()
    comm = await connect(token)
    for i in range(60):
        target = "secret" if i == 30 else "db"
        await send(comm, {"type": "publish", "queue": target, "event": "create", "payload": i, "ref": i})
    answers = [await recv(comm) for _ in range(60)]
    assert [a["ref"] for a in answers] == list(range(60))  # answered in the order sent
    assert answers[30]["type"] == "error" and answers[30]["code"] == "forbidden"
    published = [a for a in answers if a["type"] == "published"]
    assert [a["seq"] for a in published] == list(range(1, 60))
    stored = await db(lambda: list(queue.messages.order_by("seq").values_list("payload_json", flat=True)))
    assert stored == [str(i) for i in range(60) if i != 30]
    await comm.disconnect()


@pytest.mark.parametrize(
    "frame, code",
    [
        ("not json", "bad_json"),
        ("[1, 2]", "bad_frame"),
        ('{"type": "dance"}', "unknown_type"),
        ('{"no": "type"}', "unknown_type"),
        ('{"type": "subscribe"}', "bad_frame"),
        ('{"type": "subscribe", "queue": "nope"}', "not_found"),
        ('{"type": "subscribe", "queue": "no way"}', "bad_name"),
        ('{"type": "publish", "queue": "nope", "event": "x", "payload": 1}', "not_found"),
        ('{"type": "publish", "queue": "no way", "event": "x", "payload": 1}', "bad_name"),
        ('{"type": "nack", "ids": [987654321]}', "unknown_ids"),
        ('{"type": "subscribe", "queue": "secret"}', "forbidden"),
        ('{"type": "subscribe", "queue": "db", "event": "bad name"}', "bad_name"),
        ('{"type": "unsubscribe", "queue": "db", "event": "never"}', "not_subscribed"),
        ('{"type": "ack", "ids": "1"}', "bad_frame"),
        ('{"type": "ack", "ids": [true]}', "bad_frame"),
        ('{"type": "nack", "ids": [1], "retry_in": -5}', "bad_frame"),
        ('{"type": "nack", "ids": [1], "error": 7}', "bad_frame"),
        ('{"type": "nack", "ids": [1], "error": "a\\ud800"}', "bad_frame"),
        ('{"type": "publish", "queue": "db", "event": "create"}', "bad_frame"),
        ('{"type": "publish", "queue": "db", "event": "no way", "payload": 1}', "bad_message"),
        ('{"type": "publish", "queue": "secret", "event": "x", "payload": 1, "ref": "q"}', "forbidden"),
        ('{"type": "publish", "queue": "db", "event": "x", "payload": NaN}', "bad_json"),
        (
            '{"type": "publish", "queue": "db", "event": "x", "payload": ' + "[" * 100 + "]" * 100 + "}",
            "bad_json",
        ),
    ],
)
async def test_a_bad_frame_gets_an_error_frame_and_the_socket_stays_open(frame, code):
    await setup()
    _, (_, token), _ = await db(
        lambda: (None, (None, create_subscriber("x", publish=["db"], subscribe=["db"])[1]), None)
    )
    comm = await connect(token)
    await comm.send_to(text_data=frame)
    err = await recv(comm)
    assert err["type"] == "error" and err["code"] == code, err
    assert err["detail"]
    if '"ref"' in frame:
        assert err["ref"] == "q"
    await send(comm, {"type": "ping"})
    assert (await recv(comm))["type"] == "pong"
    await comm.disconnect()


@override_settings(MQ_MAX_PAYLOAD_BYTES=10)
async def test_a_payload_over_the_limit_gets_too_large():
    _, (_, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": "db", "event": "x", "payload": "x" * 20})
    assert (await recv(comm))["code"] == "too_large"
    await comm.disconnect()


@override_settings(MQ_MAX_BODY_BYTES=1000)
async def test_an_oversized_frame_closes_the_socket():
    _, (_, token), _ = await setup()
    comm = await connect(token)
    await comm.send_to(text_data="x" * 2000)
    assert await comm.receive_output(timeout=3) == {"type": "websocket.close", "code": 4413}


async def test_unsubscribe_answers_and_stops_deliveries():
    queue, (_, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db"})
    sub = await recv(comm)
    await send(comm, {"type": "unsubscribe", "queue": "db"})
    answer = await recv(comm)
    assert answer == {
        "type": "unsubscribed",
        "subscription": sub["subscription"],
        "queue": "db",
        "event": None,
    }
    await apublish(queue, 1)
    assert await comm.receive_nothing(timeout=0.5)
    await comm.disconnect()


async def test_presence_lists_an_open_connection_and_forgets_it_on_close():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    comm = await connect(token)
    await send(comm, {"type": "ping"})
    await recv(comm)
    rows = await db(lambda: list(Connection.objects.values_list("subscriber__name", flat=True)))
    assert rows == ["owner"]
    await comm.disconnect()
    assert await db(Connection.objects.count) == 0


@pytest.mark.parametrize(
    "origin, allowed",
    [
        (None, True),
        (b"http://127.0.0.1:8000", True),
        (b"http://localhost", True),
        (b"http://evil.example", False),
    ],
)
async def test_a_cross_origin_handshake_is_refused(origin, allowed):
    _, (_, token), _ = await setup()
    headers = [(b"origin", origin)] if origin else []
    comm = WebsocketCommunicator(application, f"/ws/?token={token}", headers=headers)
    connected, _ = await comm.connect(timeout=5)
    assert connected is allowed
    if connected:
        await comm.disconnect()
