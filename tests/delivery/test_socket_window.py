"""Extensions of the socket for its clients (docs/websocket.md): a socket's own prefetch
window (`prefetch` on the auth or a subscribe frame), `subscribed` echoing the frame's `ref`,
and `Origin: null` let in on /ws/, which never authenticates by cookie."""

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from delivery.models import Delivery, Status
from mqsite.asgi import application
from queues.models import Queue
from subscribers.models import Subscription
from subscribers.provisioning import create_subscriber
from tests.support.publish import apublish
from tests.support.sockets import messages_until_quiet, recv, send

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


@database_sync_to_async
def logger_and_queue():
    queue = Queue.objects.create(name="db")
    Queue.objects.create(name="secret")
    logger, token = create_subscriber("logger", publish=["db"], subscribe=["db"])
    return queue, logger, token


@database_sync_to_async
def inflight(subscriber):
    return Delivery.objects.filter(subscriber=subscriber, status=Status.INFLIGHT).count()


async def open_socket(path="/ws/", headers=()):
    comm = WebsocketCommunicator(application, path, headers=list(headers))
    connected, _ = await comm.connect(timeout=5)
    assert connected
    return comm


async def test_it_holds_one_delivery_in_flight_on_a_socket_that_asked_for_a_prefetch_of_1():
    queue, logger, token = await logger_and_queue()
    comm = await open_socket(f"/ws/?token={token}")
    await send(comm, {"type": "subscribe", "queue": "db", "prefetch": 1, "ref": "s1"})
    assert (await recv(comm))["type"] == "subscribed"
    await apublish(queue, 5)
    seqs = []
    for _ in range(5):
        (one,) = await messages_until_quiet(comm)  # one, and nothing more until it is acked
        assert await inflight(logger) == 1
        seqs.append(one["seq"])
        await send(comm, {"type": "ack", "ids": [one["id"]]})
    assert sorted(seqs) == [1, 2, 3, 4, 5]
    await comm.disconnect()
    assert await database_sync_to_async(Delivery.objects.filter(status=Status.ACKED).count)() == 5


@override_settings(MQ_PREFETCH=3)
async def test_a_larger_prefetch_than_the_servers_is_capped_and_the_last_frame_wins():
    queue, logger, token = await logger_and_queue()
    await apublish(queue, 0)
    comm = await open_socket(f"/ws/?token={token}")
    await send(comm, {"type": "subscribe", "queue": "db", "event": "create", "prefetch": 1})
    await recv(comm)
    await send(comm, {"type": "subscribe", "queue": "db", "event": "delete", "prefetch": 50})
    await recv(comm)
    await apublish(queue, 6)
    got = await messages_until_quiet(comm)
    assert len(got) == 3 and await inflight(logger) == 3  # MQ_PREFETCH, not 50
    await comm.disconnect()


async def test_the_auth_frame_sets_the_window_before_the_resume():
    queue, logger, token = await logger_and_queue()
    await database_sync_to_async(lambda: Subscription.objects.create(subscriber=logger, queue=queue))()
    await apublish(queue, 4)  # waiting: the resume hands them out at once
    comm = await open_socket()
    await send(comm, {"type": "auth", "token": token, "prefetch": 2})
    assert (await recv(comm))["type"] == "authenticated"
    got = await messages_until_quiet(comm)
    assert len(got) == 2 and await inflight(logger) == 2
    await comm.disconnect()


@pytest.mark.parametrize("prefetch", [0, -1, True, 1.5, "10", [1]])
async def test_a_bad_prefetch_is_refused_naming_it_and_nothing_is_subscribed(prefetch):
    queue, logger, token = await logger_and_queue()
    comm = await open_socket(f"/ws/?token={token}")
    await send(comm, {"type": "subscribe", "queue": "db", "prefetch": prefetch, "ref": 7})
    error = await recv(comm)
    assert error["type"] == "error" and error["code"] == "bad_frame" and error["ref"] == 7
    assert "prefetch" in error["detail"]
    assert not await database_sync_to_async(Subscription.objects.exists)()
    await comm.disconnect()


async def test_subscribed_and_unsubscribed_echo_the_frames_ref():
    queue, logger, token = await logger_and_queue()
    comm = await open_socket(f"/ws/?token={token}")
    await send(comm, {"type": "subscribe", "queue": "db", "event": "create", "ref": "sub-1"})
    answer = await recv(comm)
    assert answer["type"] == "subscribed" and answer["ref"] == "sub-1" and answer["event"] == "create"
    await send(comm, {"type": "subscribe", "queue": "db"})  # no ref: none in the answer, as before
    assert "ref" not in await recv(comm)
    await send(comm, {"type": "unsubscribe", "queue": "db", "event": "create", "ref": 9})
    gone = await recv(comm)
    assert gone["type"] == "unsubscribed" and gone["ref"] == 9
    await comm.disconnect()


async def test_a_page_with_an_opaque_origin_connects_and_authenticates_with_the_auth_frame():
    """file://, about:blank, page.set_content() and sandboxed pages send `Origin: null`: the
    socket authenticates only by token, so such a page with a token of its own is let in."""
    queue, logger, token = await logger_and_queue()
    comm = await open_socket("/ws/", headers=[(b"origin", b"null")])
    await send(comm, {"type": "auth", "token": token})
    assert await recv(comm) == {"type": "authenticated", "subscriber": "logger"}
    await send(comm, {"type": "subscribe", "queue": "db"})
    assert (await recv(comm))["type"] == "subscribed"
    await comm.disconnect()


async def test_an_opaque_origin_without_a_token_gets_nothing():
    await logger_and_queue()
    comm = await open_socket("/ws/", headers=[(b"origin", b"null")])
    await send(comm, {"type": "subscribe", "queue": "db"})
    assert (await recv(comm))["code"] == "unauthenticated"
    await send(comm, {"type": "auth", "token": "mq_wrong"})
    assert await comm.receive_output(timeout=3) == {"type": "websocket.close", "code": 4401}


@pytest.mark.parametrize("origin", [b"http://evil.example", b"https://null", b"file://"])
async def test_a_named_foreign_origin_stays_refused(origin):
    _, _, token = await logger_and_queue()
    comm = WebsocketCommunicator(application, f"/ws/?token={token}", headers=[(b"origin", origin)])
    connected, _ = await comm.connect(timeout=5)
    assert not connected
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_socket_to_a_path_with_no_route_is_refused_cleanly():
    comm = WebsocketCommunicator(application, "/ws/nothing-here/")
    connected, _ = await comm.connect(timeout=5)
    assert not connected  # closed before accepted: Daphne answers the handshake 403
