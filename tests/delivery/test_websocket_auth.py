"""Authentication after open (API.md, Extensions): a socket opened with no token in its URL or
headers sends `{"type": "auth", "token": ...}` first, so that a browser page need not put a
long-lived token in a URL that logs keep."""

import asyncio
import json

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from delivery import consumers, publishing, subscribing
from delivery.models import Delivery, Status
from mqsite.asgi import application
from queues.models import Queue
from subscribers.models import Connection
from subscribers.provisioning import create_subscriber
from tests.support.servers import start_daphne
from tests.support.sockets import recv, send

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def owner_with_a_message_waiting():
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    publishing.publish(queue, [publishing.prepare("create", {"n": 1})])
    return owner, token


async def open_without_token():
    comm = WebsocketCommunicator(application, "/ws/")
    connected, _ = await comm.connect(timeout=5)
    assert connected
    return comm


@pytest.mark.asyncio
async def test_it_authenticates_with_the_auth_frame_then_resumes():
    owner, token = await owner_with_a_message_waiting()
    comm = await open_without_token()
    await send(comm, {"type": "auth", "token": token})
    # `authenticated` first, then the automatic resume: the message that waited.
    assert await recv(comm) == {"type": "authenticated", "subscriber": "owner"}
    message = await recv(comm)
    assert message["type"] == "message" and message["payload"] == {"n": 1}
    await send(comm, {"type": "ack", "ids": [message["id"]]})
    # Acks are written a moment later, a burst of them together: wait for this one.
    for _ in range(50):
        status = await database_sync_to_async(lambda: Delivery.objects.get(pk=message["id"]).status)()
        if status == Status.ACKED:
            break
        await asyncio.sleep(0.1)
    assert status == Status.ACKED
    await comm.disconnect()


@pytest.mark.asyncio
async def test_any_other_frame_before_auth_is_an_unauthenticated_error_and_holds_nothing():
    owner, token = await owner_with_a_message_waiting()
    comm = await open_without_token()
    for frame in (
        {"type": "subscribe", "queue": "db", "ref": "s"},
        {"type": "ping", "ref": "p"},
        {"type": "ack", "ids": [1]},
    ):
        await send(comm, frame)
        answer = await recv(comm)
        assert answer["type"] == "error" and answer["code"] == "unauthenticated", answer
        assert answer.get("ref") == frame.get("ref")
    # Nothing was leased to it, and it is no connection of the subscriber's yet.
    assert await comm.receive_nothing(timeout=0.5)
    counts = await database_sync_to_async(
        lambda: (Connection.objects.count(), Delivery.objects.filter(status=Status.INFLIGHT).count())
    )()
    assert counts == (0, 0)
    # It may still authenticate.
    await send(comm, {"type": "auth", "token": token})
    assert (await recv(comm))["type"] == "authenticated"
    assert (await recv(comm))["type"] == "message"
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_bad_token_in_the_auth_frame_closes_with_4401():
    await owner_with_a_message_waiting()
    comm = await open_without_token()
    await send(comm, {"type": "auth", "token": "mq_wrong"})
    assert await comm.receive_output(timeout=3) == {"type": "websocket.close", "code": 4401}


@pytest.mark.asyncio
@pytest.mark.parametrize("token", [None, 5, "", ["t"]])
async def test_an_auth_frame_without_a_token_string_is_a_bad_frame(token):
    await owner_with_a_message_waiting()
    comm = await open_without_token()
    await send(comm, {"type": "auth", "token": token, "ref": "a"})
    answer = await recv(comm)
    assert (answer["type"], answer["code"], answer["ref"]) == ("error", "bad_frame", "a")
    await comm.disconnect()


@pytest.mark.asyncio
async def test_bad_auth_frames_count_against_the_address(settings):
    settings.MQ_AUTH_FAILURES_PER_MINUTE = 2
    await owner_with_a_message_waiting()
    codes = []
    for _ in range(4):
        comm = await open_without_token()
        await send(comm, {"type": "auth", "token": "mq_guess"})
        codes.append((await comm.receive_output(timeout=3))["code"])
    assert codes[:2] == [4401, 4401] and codes[-1] == 4429, codes


@pytest.mark.asyncio
async def test_a_second_auth_frame_is_refused(monkeypatch):
    owner, token = await owner_with_a_message_waiting()
    comm = await open_without_token()
    await send(comm, {"type": "auth", "token": token})
    assert (await recv(comm))["type"] == "authenticated"
    await recv(comm)  # the message
    await send(comm, {"type": "auth", "token": token, "ref": 2})
    answer = await recv(comm)
    assert (answer["type"], answer["code"], answer["ref"]) == ("error", "bad_frame", 2)
    await comm.disconnect()


@pytest.mark.asyncio
async def test_a_socket_that_never_authenticates_is_closed(monkeypatch):
    monkeypatch.setattr(consumers, "AUTH_WAIT_SECS", 0.3)
    await owner_with_a_message_waiting()
    comm = await open_without_token()
    assert await comm.receive_output(timeout=3) == {"type": "websocket.close", "code": 4401}


def test_it_authenticates_after_open_against_a_real_server():
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    server = start_daphne()
    try:
        with ws_connect(server.ws, close_timeout=1) as ws:
            ws.send(json.dumps({"type": "auth", "token": token}))
            assert json.loads(ws.recv(timeout=5)) == {"type": "authenticated", "subscriber": "owner"}
            ws.send(json.dumps({"type": "publish", "queue": "db", "event": "create", "payload": 7, "ref": 1}))
            # Its answer and its delivery to this same socket, in either order: both go after
            # the commit (the publish frame ended the resume grace, so the delivery need not wait).
            frames = {f["type"]: f for f in (json.loads(ws.recv(timeout=5)) for _ in range(2))}
            assert frames["published"]["ref"] == 1 and frames["message"]["payload"] == 7
        with ws_connect(server.ws, close_timeout=1) as ws, pytest.raises(ConnectionClosed) as closed:
            ws.send(json.dumps({"type": "auth", "token": token + "x"}))
            ws.recv(timeout=5)
        assert closed.value.rcvd.code == 4401
    finally:
        server.stop()
