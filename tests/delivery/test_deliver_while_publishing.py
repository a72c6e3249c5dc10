"""Deliver while publishing (delivery.inline): a socket's publish hands the new deliveries to
the sockets of its process that have room in its own statement, and only where a lease would
take them: within the window, not of a paused queue, nor of a subscription whose replay is under
way, nor of an ordered queue. Publisher and subscriber here are sockets of the test's process."""

import asyncio

import pytest
from django.db import connection
from django.utils import timezone

from delivery import consumers, liveness
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.models import Subscription
from tests.support.sockets import connect, db, messages_until_quiet, recv, recv_messages, send, setup

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]
on_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="the async connection's publish is PostgreSQL's (SQLite publishes in a thread)",
)


async def sockets(prefetch=10, ordered=False):
    """(queue, the publisher's socket, the subscriber's socket, subscribed with `prefetch`),
    after one message published and acked: the publisher's event is known to the process, so
    that its next publishes take the one-statement path. The subscriber's token is
    `sockets.token`."""
    queue, (_, owner_token), (_, peer_token) = await setup(ordered=ordered)
    sockets.token = peer_token
    publisher, subscriber = await connect(owner_token), await connect(peer_token)
    await send(subscriber, {"type": "subscribe", "queue": "db", "prefetch": prefetch})
    assert (await recv(subscriber))["type"] == "subscribed"
    await publish(publisher, 1)
    (first,) = await recv_messages(subscriber, 1)
    await ack(subscriber, [first])
    return queue, publisher, subscriber


async def publish(publisher, n):
    items = [{"event": "create", "payload": {"n": i}} for i in range(n)]
    await send(publisher, {"type": "publish", "queue": "db", "messages": items})
    answer = await recv(publisher)
    assert answer["type"] == "published", answer
    return [m["id"] for m in answer["messages"]]


async def ack(subscriber, frames):
    await send(subscriber, {"type": "ack", "ids": [f["id"] for f in frames]})
    await asyncio.sleep(0.1)  # written


def rows(**filters):
    return list(
        Delivery.objects.filter(**filters)
        .order_by("seq")
        .values("status", "attempt", "lease_holder", "created_at", "delivered_at", "ack_deadline")
    )


@on_postgres
async def test_a_socket_here_with_room_gets_its_delivery_in_flight_from_the_publish_itself():
    _, publisher, subscriber = await sockets()
    [message_id] = await publish(publisher, 1)
    (frame,) = await recv_messages(subscriber, 1)
    assert frame["message_id"] == message_id and frame["attempt"] == 1 and frame["payload"] == {"n": 0}
    [row] = await db(rows, message_id=message_id)
    # Made in flight by the publish's statement: no lease came after it (which would stamp a
    # later delivered_at). Held by the socket, a holder of this process, as a lease's is: its
    # close and the process's death hand it back as they hand back any lease.
    assert row["status"] == Status.INFLIGHT and row["attempt"] == 1
    assert row["delivered_at"] == row["created_at"]
    assert row["lease_holder"].startswith(liveness.holders_of(liveness.name()))
    assert (row["ack_deadline"] - row["created_at"]).total_seconds() == 30  # the queue's ack timeout
    await ack(subscriber, [frame])
    assert await db(lambda: Delivery.objects.get(message_id=message_id).status) == Status.ACKED
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_what_a_publish_hands_over_stays_within_the_sockets_window():
    _, publisher, subscriber = await sockets(prefetch=2)
    await publish(publisher, 5)
    frames = await recv_messages(subscriber, 2)
    assert await subscriber.receive_nothing(timeout=0.3)
    statuses = [r["status"] for r in await db(rows, seq__gt=1)]
    assert statuses == [Status.INFLIGHT] * 2 + [Status.PENDING] * 3
    await ack(subscriber, frames[:1])
    (third,) = await recv_messages(subscriber, 1)
    assert third["seq"] == 4
    assert await subscriber.receive_nothing(timeout=0.3)
    await publisher.disconnect()
    await subscriber.disconnect()


@on_postgres
async def test_a_delayed_message_is_not_handed_over_by_its_publish_but_one_beside_it_is():
    """A lease would not take a delayed message before its deliver_at: nor does the publish
    statement, which hands the undelayed message of the same batch over as usual."""
    _, publisher, subscriber = await sockets()
    items = [
        {"event": "create", "payload": "later", "delay_secs": 3600},
        {"event": "create", "payload": "now"},
    ]
    await send(publisher, {"type": "publish", "queue": "db", "messages": items})
    answer = await recv(publisher)
    later_id, now_id = (m["id"] for m in answer["messages"])
    (frame,) = await recv_messages(subscriber, 1)
    assert frame["message_id"] == now_id and frame["deliver_at"] is None
    assert await subscriber.receive_nothing(timeout=0.3)
    [row] = await db(rows, message_id=later_id)
    assert (row["status"], row["attempt"], row["lease_holder"], row["delivered_at"]) == (
        Status.PENDING,
        0,
        "",
        None,
    )
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_a_paused_queue_hands_nothing_over():
    queue, publisher, subscriber = await sockets()
    await db(lambda: Queue.objects.filter(pk=queue.pk).update(paused=True))
    [message_id] = await publish(publisher, 1)
    assert await subscriber.receive_nothing(timeout=0.5)
    [row] = await db(rows, message_id=message_id)
    assert (row["status"], row["attempt"], row["delivered_at"]) == (Status.PENDING, 0, None)
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_a_paused_subscription_is_handed_nothing_and_its_resume_wakes_the_socket(monkeypatch):
    """Seated by no publish while paused (its deliveries made pending, owed); resumed, the
    socket gets them from the resume's wake-up, not the recheck (made far longer here)."""
    from delivery import socket_loops, subscribing

    monkeypatch.setattr(socket_loops, "RECHECK_SECS", 60)
    _, publisher, subscriber = await sockets()
    await db(lambda: subscribing.pause(Subscription.objects.all()))
    ids = await publish(publisher, 3)
    assert await subscriber.receive_nothing(timeout=0.5)
    made = await db(rows, message_id__in=ids)
    assert [(r["status"], r["attempt"], r["delivered_at"]) for r in made] == [(Status.PENDING, 0, None)] * 3
    await db(lambda: subscribing.resume(Subscription.objects.all()))
    frames = await recv_messages(subscriber, 3, timeout=2)
    assert [f["message_id"] for f in frames] == ids
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_a_subscription_whose_replay_is_under_way_is_handed_nothing():
    _, publisher, subscriber = await sockets()
    # What begin_replay() marks: its history is not all owed yet, so nothing may be leased.
    await db(lambda: Subscription.objects.update(busy_since=timezone.now()))
    [message_id] = await publish(publisher, 1)
    assert await subscriber.receive_nothing(timeout=0.5)
    [row] = await db(rows, message_id=message_id)
    assert (row["status"], row["delivered_at"]) == (Status.PENDING, None)
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_an_ordered_queues_line_is_not_jumped_by_a_publish():
    _, publisher, subscriber = await sockets(ordered=True)
    await publish(publisher, 1)
    (head,) = await recv_messages(subscriber, 1)
    await publish(publisher, 2)  # the window has room, but the head is still in flight
    assert await subscriber.receive_nothing(timeout=0.5)
    seqs = [head["seq"]]
    await ack(subscriber, [head])
    for _ in range(2):
        (frame,) = await recv_messages(subscriber, 1)
        seqs.append(frame["seq"])
        await ack(subscriber, [frame])
    assert seqs == [2, 3, 4]
    # Leased after their acks, never made in flight by the publish.
    assert all(r["delivered_at"] > r["created_at"] for r in await db(rows, seq__gt=1))
    await publisher.disconnect()
    await subscriber.disconnect()


async def test_a_socket_that_closes_while_a_publish_hands_it_deliveries_leaves_none_in_flight():
    _, publisher, subscriber = await sockets()
    items = [{"event": "create", "payload": {"n": i}} for i in range(5)]
    await send(publisher, {"type": "publish", "queue": "db", "messages": items})
    await subscriber.disconnect()  # at once: the publish may be under way
    assert (await recv(publisher))["type"] == "published"
    await asyncio.sleep(0.2)
    left = await db(lambda: Delivery.objects.filter(status=Status.INFLIGHT).count())
    assert left == 0
    await publisher.disconnect()


async def test_sockets_of_one_subscriber_here_still_share_what_a_publish_hands_over():
    """Handed over whole, a batch would all go to the socket whose turn it is: each takes a
    share (FAIR_SHARE), and the rest is dealt out in turns, as a wake-up's leases deal it."""
    _, publisher, first = await sockets(prefetch=100)
    second = await connect(sockets.token)
    await asyncio.sleep(0.3)  # past its resume grace
    await publish(publisher, 30)
    got = [await messages_until_quiet(first), await messages_until_quiet(second)]
    assert sorted(f["seq"] for frames in got for f in frames) == list(range(2, 32))
    assert all(len(frames) <= consumers.FAIR_SHARE * 2 for frames in got), [len(f) for f in got]
    await publisher.disconnect()
    await first.disconnect()
    await second.disconnect()
