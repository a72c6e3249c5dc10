"""The ASGI handler's threads (mqsite/asgi_handler.RequestThreads): a request runs in a thread
of its own, one an earlier request left (starting a thread per request cost the event loop
about 1.7 ms each), and a request that blocks its thread (a long poll) never holds up another."""

import asyncio
import threading

import pytest
from channels.testing import HttpCommunicator
from django.core.signals import request_started

from mqsite.asgi_handler import SyncChainASGIHandler

pytestmark = pytest.mark.asyncio

MISSING = "/no-such-page"  # answered 404 by Django, with no database or Redis to ask


@pytest.fixture
def threads_of_requests():
    """The thread each request ran in, in order; a request can be held in its thread until
    `release` is set (hold: the first one)."""
    seen, hold, release = [], threading.Event(), threading.Event()

    def started(**kwargs):
        seen.append(threading.get_ident())
        if hold.is_set():
            hold.clear()
            release.wait(10)

    request_started.connect(started)
    yield seen, hold, release
    release.set()
    request_started.disconnect(started)


async def get(app, path=MISSING):
    # Django's test set-up allows the host "testserver".
    answer = await HttpCommunicator(app, "GET", path, headers=[(b"host", b"testserver")]).get_response(
        timeout=10
    )
    return answer["status"]


async def test_requests_one_after_another_use_one_thread(threads_of_requests):
    seen, _, _ = threads_of_requests
    app = SyncChainASGIHandler()
    for _ in range(3):
        assert await get(app) == 404
    assert len(seen) == 3 and len(set(seen)) == 1


async def test_a_request_that_holds_its_thread_never_holds_up_another(threads_of_requests):
    seen, hold, release = threads_of_requests
    app = SyncChainASGIHandler()
    assert await get(app) == 404  # a thread left idle
    hold.set()
    held = asyncio.ensure_future(get(app))
    while len(seen) < 2:  # the held request has started, in the idle thread
        await asyncio.sleep(0.01)
    assert await get(app) == 404  # answered meanwhile, in another thread
    assert seen[2] != seen[1]
    assert not held.done()
    release.set()
    assert await held == 404
