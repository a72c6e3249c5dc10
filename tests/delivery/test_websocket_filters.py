"""A subscribe frame's `filter`: the socket receives only the messages that match, whichever way
they are published (on PostgreSQL a socket publish hands them to the sockets of this process in
the publish's own statement: that statement filters too)."""

import asyncio

import pytest

from delivery.models import Delivery
from subscribers.models import Subscription
from tests.support.sockets import connect, db, recv, recv_messages, send, setup

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


async def publish(publisher, payloads, headers=None):
    items = [{"event": "create", "payload": p} | ({"headers": headers} if headers else {}) for p in payloads]
    await send(publisher, {"type": "publish", "queue": "db", "messages": items})
    answer = await recv(publisher)
    assert answer["type"] == "published", answer
    return [m["deliveries"] for m in answer["messages"]]


async def test_a_socket_subscribed_with_a_filter_receives_only_what_matches():
    _, (_, owner_token), (_, peer_token) = await setup()
    publisher, subscriber = await connect(owner_token), await connect(peer_token)
    flt = {"payload.n": [1, 3], "headers.tenant": ["acme", None]}
    await send(subscriber, {"type": "subscribe", "queue": "db", "filter": flt, "ref": 1})
    answer = await recv(subscriber)
    assert answer["type"] == "subscribed" and answer["filter"] == flt and answer["ref"] == 1
    # Twice: the first publish makes the event, the next ones take the one-statement path.
    for _ in range(2):
        assert await publish(publisher, [{"n": i} for i in range(5)]) == [0, 1, 0, 1, 0]
        frames = await recv_messages(subscriber, 2)
        assert [f["payload"]["n"] for f in frames] == [1, 3]
        await send(subscriber, {"type": "ack", "ids": [f["id"] for f in frames]})
    assert await publish(publisher, [{"n": 1}, {"n": 3}], headers={"tenant": "other"}) == [0, 0]
    assert await publish(publisher, [{"n": 3}], headers={"tenant": "acme"}) == [1]
    (frame,) = await recv_messages(subscriber, 1)
    assert frame["payload"] == {"n": 3} and frame["headers"] == {"tenant": "acme"}
    assert await subscriber.receive_nothing(timeout=0.3)
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_subscribing_again_keeps_the_filter_unless_the_frame_names_one():
    _, _, (_, peer_token) = await setup()
    comm = await connect(peer_token)
    await send(comm, {"type": "subscribe", "queue": "db", "filter": {"payload.kind": ["a"]}})
    first = await recv(comm)
    await send(comm, {"type": "subscribe", "queue": "db"})  # a reconnect's subscribe, say
    again = await recv(comm)
    assert again["subscription"] == first["subscription"] and again["filter"] == {"payload.kind": ["a"]}
    await send(comm, {"type": "subscribe", "queue": "db", "filter": None})
    assert (await recv(comm))["filter"] is None
    assert (await db(Subscription.objects.get, pk=first["subscription"])).filter is None
    await comm.disconnect()


async def test_a_malformed_filter_is_an_error_frame_and_makes_nothing():
    _, _, (_, peer_token) = await setup()
    comm = await connect(peer_token)
    await send(comm, {"type": "subscribe", "queue": "db", "filter": {"payload.a.b.c.d.e": [1]}, "ref": 9})
    error = await recv(comm)
    assert (error["type"], error["code"], error["ref"]) == ("error", "bad_filter", 9)
    assert "payload.a.b.c.d.e" in error["detail"]
    await asyncio.sleep(0.05)
    assert await db(Subscription.objects.count) == 0
    assert await db(Delivery.objects.count) == 0
    await comm.disconnect()
