"""A socket alone on its subscriber's stream leases the next window ahead while its client works
on the one it has (delivery.consumers, AHEAD_SECS): the next acks are answered from it with no
lease waited for. Its client still never holds more than its window unacked; what was leased
ahead and not sent goes back to pending with its attempt given back, when the client stops
acking and when the socket closes; a socket that asked for a smaller window leases nothing
ahead."""

import asyncio

import pytest
from django.test import override_settings

from delivery import consumers, ledger, subscribing
from delivery.models import Delivery, Status
from tests.support.publish import apublish
from tests.support.sockets import connect, db, messages_until_quiet, recv, send, setup

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

WINDOW = 3


async def window_of(comm, quiet=0.15):
    """What the window lets out: the message frames until the socket is quiet."""
    return await messages_until_quiet(comm, quiet)


def rows(subscriber):
    return {
        d.id: d
        for d in Delivery.objects.filter(subscriber=subscriber).only(
            "id", "status", "attempt", "lease_holder", "last_error"
        )
    }


async def caught_up_socket(backlog, prefetch=None):
    queue, (owner, token), _ = await setup()
    await db(subscribing.subscribe, owner, queue)
    await apublish(queue, backlog)
    comm = await connect(token)
    frame = {"type": "subscribe", "queue": "db", **({"prefetch": prefetch} if prefetch else {})}
    await send(comm, frame)
    assert (await recv(comm))["type"] == "subscribed"
    return owner, comm


async def ack(comm, frames):
    await send(comm, {"type": "ack", "ids": [f["id"] for f in frames]})


@override_settings(MQ_PREFETCH=WINDOW)
async def test_the_next_window_is_leased_ahead_while_the_client_holds_only_its_own():
    owner, comm = await caught_up_socket(20)
    first = await window_of(comm)
    assert len(first) == WINDOW
    await ack(comm, first)
    second = await window_of(comm)
    assert len(second) == WINDOW  # never more than the window at the client
    # Leased ahead: the next window is in flight to this socket, not sent.
    now = await db(rows, owner)
    inflight = [d for d in now.values() if d.status == Status.INFLIGHT]
    assert len(inflight) == 2 * WINDOW
    sent = {f["id"] for f in first + second}
    unsent = [d for d in inflight if d.id not in sent]
    assert len(unsent) == WINDOW
    # The next acks are answered from it: the same deliveries, in seq order.
    await ack(comm, second)
    third = await window_of(comm)
    assert sorted(f["id"] for f in third) == sorted(d.id for d in unsent)
    assert [f["seq"] for f in first + second + third] == list(range(1, 3 * WINDOW + 1))
    await comm.disconnect()


@override_settings(MQ_PREFETCH=WINDOW)
async def test_what_was_leased_ahead_goes_back_unspent_when_the_client_stops_acking_or_closes():
    owner, comm = await caught_up_socket(20)
    first = await window_of(comm)
    await ack(comm, first)
    second = await window_of(comm)
    assert len(second) == WINDOW
    # The client stops acking: what was leased ahead is given back, its attempt with it.
    await asyncio.sleep(consumers.AHEAD_SECS + 0.5)
    now = await db(rows, owner)
    sent = {f["id"] for f in second}
    assert {i for i, d in now.items() if d.status == Status.INFLIGHT} == sent
    given_back = [d for d in now.values() if d.last_error == ledger.NOT_SENT]
    assert len(given_back) == WINDOW
    assert all(d.status == Status.PENDING and d.attempt == 0 for d in given_back)
    # Acked again, the socket leases ahead again; closed now, what it had not sent is given back
    # unspent, and what its client had and did not ack spends its attempt (as before).
    await ack(comm, second)
    third = await window_of(comm)
    assert len(third) == WINDOW
    assert len([d for d in (await db(rows, owner)).values() if d.status == Status.INFLIGHT]) == 2 * WINDOW
    await comm.disconnect()
    after = await db(rows, owner)
    assert not [d for d in after.values() if d.status == Status.INFLIGHT]
    for i, d in after.items():
        if i in {f["id"] for f in first + second}:
            assert d.status == Status.ACKED
        elif i in {f["id"] for f in third}:
            assert (d.status, d.attempt) == (Status.PENDING, 1)  # the client had it: spent
        else:
            assert (d.status, d.attempt) == (Status.PENDING, 0)  # never sent, or never leased


@override_settings(MQ_PREFETCH=WINDOW)
async def test_a_socket_that_asked_for_a_smaller_window_leases_nothing_ahead():
    owner, comm = await caught_up_socket(20, prefetch=2)
    for _ in range(3):
        got = await window_of(comm)
        assert len(got) == 2
        inflight = [d for d in (await db(rows, owner)).values() if d.status == Status.INFLIGHT]
        assert len(inflight) == 2
        await ack(comm, got)
    await comm.disconnect()


@override_settings(MQ_PREFETCH=WINDOW)
async def test_nothing_leased_ahead_goes_out_after_unsubscribed():
    owner, comm = await caught_up_socket(20)
    first = await window_of(comm)
    await ack(comm, first)
    second = await window_of(comm)  # and the next window leased ahead
    await send(comm, {"type": "unsubscribe", "queue": "db"})
    assert (await recv(comm))["type"] == "unsubscribed"
    await ack(comm, second)  # room in the window: nothing of the subscription may fill it
    while not await comm.receive_nothing(timeout=0.3):
        frame = await recv(comm)
        assert frame["type"] == "error" and frame["code"] == "unknown_ids", frame
    left = await db(rows, owner)
    assert not [d for d in left.values() if d.status == Status.INFLIGHT]
    await comm.disconnect()
