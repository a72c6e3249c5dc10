"""Headers on the socket (API.md, Extensions): on `publish` frames, single and batch, and on
every `message` frame, alone or in a `messages` frame; through Channels' communicator, then
end to end over a real Daphne, its real websocket and the REST publish."""

import json
import re
import urllib.request

import pytest
from websockets.sync.client import connect as ws_connect

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber
from tests.support.fields import MESSAGE_FRAME_FIELDS
from tests.support.servers import eventually
from tests.support.sockets import connect, db, recv, send, setup
from tests.support.trace_context import TRACEPARENT, TRACESTATE

HEADERS = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "tenant": "acme"}


async def subscribed_socket(token, batch=False):
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "batch": batch})
    assert (await recv(comm))["type"] == "subscribed"
    return comm


@pytest.mark.parametrize("batch", [False, True], ids=["message frames", "messages frames"])
@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_headers_published_on_a_socket_come_back_on_the_subscribers_frames(batch):
    # Given the peer's socket subscribed to db, and the owner's socket publishing
    queue, (_, owner_token), (_, peer_token) = await setup()
    peer = await subscribed_socket(peer_token, batch=batch)
    owner = await connect(owner_token)

    # When the owner publishes one frame with headers, one without, and a batch of both
    await send(owner, {"type": "publish", "queue": "db", "event": "create", "payload": 1, "headers": HEADERS})
    assert (await recv(owner))["type"] == "published"
    await send(owner, {"type": "publish", "queue": "db", "event": "create", "payload": 2})
    assert (await recv(owner))["type"] == "published"
    items = [{"event": "create", "payload": 3, "headers": {"n": "3"}}, {"event": "create", "payload": 4}]
    await send(owner, {"type": "publish", "queue": "db", "messages": items, "ref": "b"})
    answer = await recv(owner)
    assert answer["type"] == "published" and len(answer["messages"]) == 2

    # Then every message frame carries its message's headers, and only those that have some
    got = []
    while len(got) < 4:
        frame = await recv(peer)
        if batch:
            assert frame["type"] == "messages"
            got += frame["messages"]
        else:
            got.append(frame)
    got.sort(key=lambda f: f["seq"])
    assert [f.get("headers") for f in got] == [HEADERS, None, {"n": "3"}, None]
    assert set(got[0]) == MESSAGE_FRAME_FIELDS | {"headers"} and set(got[1]) == MESSAGE_FRAME_FIELDS
    assert got[0]["headers"]["traceparent"] == TRACEPARENT
    stored = await db(lambda: list(Message.objects.order_by("seq").values_list("headers_json", flat=True)))
    assert [json.loads(h) if h else None for h in stored] == [HEADERS, None, {"n": "3"}, None]
    await peer.disconnect()
    await owner.disconnect()


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ({"bad name": "x"}, "is not valid"),
        ({f"h{i}": "v" for i in range(65)}, "65 headers"),
        ({"a": "x" * 8192}, "8192 bytes"),
        ({"a": 1}, "must be text"),
        ({"a": "x\x00"}, "NUL"),
        ("a=b", "must be an object"),
    ],
)
@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_bad_headers_on_a_socket_are_an_error_frame_and_nothing_is_published(headers, words):
    _, (_, token), _ = await setup()
    comm = await connect(token)

    await send(
        comm,
        {"type": "publish", "queue": "db", "event": "create", "payload": 1, "headers": headers, "ref": 1},
    )
    error = await recv(comm)
    assert (error["type"], error["code"], error["ref"]) == ("error", "bad_message", 1)
    assert error["detail"].startswith("headers: ") and words in error["detail"]

    good = {"event": "create", "payload": 1}
    batch = [good, {**good, "headers": headers}, good]
    await send(comm, {"type": "publish", "queue": "db", "messages": batch, "ref": 2})
    error = await recv(comm)
    assert (error["type"], error["code"], error["ref"], error["index"]) == ("error", "bad_message", 2, 1)
    assert error["detail"].startswith("messages[1]: headers: ") and words in error["detail"]

    assert await db(Message.objects.count) == 0
    await send(comm, {"type": "ping"})
    assert (await recv(comm))["type"] == "pong"  # the socket stays open
    await comm.disconnect()


# --- end to end: a real Daphne, its websocket and its REST API ------------------------------------


@pytest.mark.django_db(transaction=True)
def test_headers_travel_end_to_end_over_rest_and_a_real_socket(server):
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    body = {
        "messages": [
            {"event": "create", "payload": {"n": 1}, "headers": HEADERS},
            {"event": "create", "payload": {"n": 2}},
        ]
    }
    req = urllib.request.Request(
        f"{server.http}/api/queues/db/messages",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201

    with ws_connect(f"{server.ws}?token={token}") as ws:
        # the resume hands out what waits; then a socket publish with headers, delivered live
        raw = [ws.recv(timeout=10) for _ in range(2)]
        ws.send(
            json.dumps(
                {"type": "publish", "queue": "db", "event": "update", "payload": 3, "headers": {"x": "y"}}
            )
        )
        while len(raw) < 4:
            raw.append(ws.recv(timeout=10))
        frames = [json.loads(text) for text in raw]
        messages = sorted((f for f in frames if f["type"] == "message"), key=lambda f: f["seq"])
        assert [f.get("headers") for f in messages] == [HEADERS, None, {"x": "y"}]
        assert "headers" not in messages[1]
        # byte for byte (the frame's JSON as stored: with or without a space after the colon)
        assert any(re.search(f'"traceparent": ?"{re.escape(TRACEPARENT)}"', text) for text in raw)
        ws.send(json.dumps({"type": "ack", "ids": [f["id"] for f in messages]}))
        assert eventually(lambda: set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED})
