"""Wake-ups between server processes: one Redis PUBLISH per commit, one listener per process
(mqsite.bus, its `wake` word; delivery.wakeups, its waiters)."""

import asyncio
import json

import pytest
import redis

from delivery import wakeups
from mqsite import bus
from tests.support.servers import redis_db

pytestmark = pytest.mark.asyncio

REDIS_TEST_URL = redis_db(7)


@pytest.fixture
def services(settings):
    settings.REDIS_URL = REDIS_TEST_URL
    bus.client.cache_clear()
    yield
    bus.client.cache_clear()


def word(sender, *ids):
    """A wake-up as a process says it on the bus."""
    return json.dumps({"from": sender, "kind": bus.WAKE, "ids": list(ids)})


async def listening():
    """The listener task, once its subscription is in place."""
    task = asyncio.ensure_future(bus.listen())
    client = redis.Redis.from_url(REDIS_TEST_URL)
    for _ in range(100):
        if client.pubsub_numsub(bus.channel())[0][1]:
            return task, client
        await asyncio.sleep(0.02)
    raise AssertionError("the listener never subscribed")


async def test_another_processs_wake_up_wakes_this_processs_sockets_of_that_subscriber(services):
    mine, other = asyncio.Event(), asyncio.Event()
    watching = [wakeups.watch(41, mine), wakeups.watch(42, other)]
    task, client = await listening()
    try:
        before = wakeups.generation(41)
        client.publish(bus.channel(), word("another-process", 41, 43))
        await asyncio.wait_for(mine.wait(), 2)
        assert not other.is_set()
        assert wakeups.generation(41) == before + 1  # its long polls too
    finally:
        task.cancel()
        wakeups.unwatch(41, watching[0])
        wakeups.unwatch(42, watching[1])


async def test_a_processs_own_wake_up_wakes_its_sockets_once_without_the_round_trip(services):
    event = asyncio.Event()
    waiter = wakeups.watch(51, event)
    task, _ = await listening()
    try:
        before = wakeups.generation(51)
        await asyncio.get_running_loop().run_in_executor(None, bus.send, bus.WAKE, [51])
        await asyncio.wait_for(event.wait(), 1)  # set from a thread, onto this loop
        bus.client().publish(bus.channel(), word(bus.PROCESS, 51))  # its own echo, again
        await asyncio.sleep(0.3)
        assert wakeups.generation(51) == before + 1  # the echo is not counted again
    finally:
        task.cancel()
        wakeups.unwatch(51, waiter)


async def test_the_channel_names_the_redis_database(settings):
    settings.REDIS_URL = redis_db(7)
    seven = bus.channel()
    settings.REDIS_URL = redis_db(8)
    assert bus.channel() != seven


async def test_a_server_process_answers_without_waiting_for_the_hints_to_other_processes(monkeypatch):
    """send() wakes this process's own at once; the PUBLISH and the listeners (the webhook
    jobs' query) follow from a thread, all that arrived meanwhile together."""
    import threading

    heard, slow = [], threading.Event()

    def listener(ids, source):
        slow.wait(5)  # a slow query: the publisher must not wait for it
        heard.append(list(ids))

    monkeypatch.setitem(bus._listeners, bus.WAKE, [*bus._listeners[bus.WAKE], (listener, True)])
    monkeypatch.setattr(bus, "_outbox", None)
    bus.send_from_a_thread()
    try:
        before = wakeups.generation(61)
        bus.send(bus.WAKE, [61])  # returns at once, though the listener blocks
        assert wakeups.generation(61) == before + 1  # this process's waiters were woken
        bus.send(bus.WAKE, [62])
        bus.send(bus.WAKE, [61, 63])
        slow.set()
        for _ in range(100):
            if sum(map(len, heard)) >= 3:
                break
            await asyncio.sleep(0.02)
        assert sorted({i for ids in heard for i in ids}) == [61, 62, 63]
    finally:
        slow.set()
