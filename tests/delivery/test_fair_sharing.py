"""Competing consumers: the sockets of one subscriber (a service's workers) take turns, so
that N of them each get about 1/N of a stream or of a backlog (issue 15), as RabbitMQ deals
round-robin among the consumers of a queue that have room."""

import asyncio

import pytest

from delivery import publishing, subscribing
from tests.support.publish import apublish
from tests.support.sockets import connect, db, recv, setup

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


async def drain_sockets(comms, timeout=0.3):
    """{index: [frames]} of what each socket got until all were quiet for `timeout`."""
    got = {i: [] for i in range(len(comms))}
    quiet = False
    while not quiet:
        quiet = True
        for i, comm in enumerate(comms):
            while not await comm.receive_nothing(timeout=timeout / len(comms)):
                got[i].append(await recv(comm))
                quiet = False
    return got


async def test_a_stream_of_single_publishes_is_dealt_round_robin():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    comms = [await connect(token) for _ in range(2)]
    await asyncio.sleep(0.3)  # past the resume grace
    for i in range(40):  # nobody acks: each keeps what it got
        await apublish(queue, 1, start=i)
        await asyncio.sleep(0.01)
    got = await drain_sockets(comms)
    counts = sorted(len(frames) for frames in got.values())
    assert sum(counts) == 40 and len({f["id"] for fs in got.values() for f in fs}) == 40
    assert counts[0] >= 15, counts  # about half each (a wake-up that finds the other busy moves on)
    for comm in comms:
        await comm.disconnect()


async def test_a_backlog_is_dealt_in_shares_to_three_workers():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    comms = [await connect(token) for _ in range(3)]
    await asyncio.sleep(0.3)
    await apublish(queue, 60)  # one commit: one wake-up for all of it
    got = await drain_sockets(comms)
    counts = sorted(len(frames) for frames in got.values())
    assert sum(counts) == 60 and counts[0] >= 15, counts  # about a third each
    for comm in comms:
        await comm.disconnect()


async def test_workers_that_ack_share_a_steady_stream():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    comms = [await connect(token) for _ in range(2)]
    await asyncio.sleep(0.3)
    got = {0: 0, 1: 0}

    async def work(i, comm):
        while True:
            frame = await recv(comm, timeout=5)
            got[i] += 1
            await comm.send_json_to({"type": "ack", "ids": [frame["id"]]})

    workers = [asyncio.ensure_future(work(i, c)) for i, c in enumerate(comms)]
    for i in range(60):
        await db(lambda i=i: publishing.publish(queue, [publishing.prepare("create", {"n": i})]))
        await asyncio.sleep(0.005)
    for _ in range(100):
        if sum(got.values()) == 60:
            break
        await asyncio.sleep(0.05)
    for w in workers:
        w.cancel()
    assert sum(got.values()) == 60
    assert min(got.values()) >= 20, got  # about half each, not all to the first
    for comm in comms:
        await comm.disconnect()


async def test_a_lone_socket_still_fills_its_window_at_once():
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 50)
    comm = await connect(token)
    # The first frame however slow the machine (a loaded one passed the drain's 0.3 s of quiet
    # before the catch-up began); then the rest of the window, with no ack in between.
    first = await recv(comm, timeout=10)
    got = await drain_sockets([comm])
    assert len([first, *got[0]]) == 50
    await comm.disconnect()
