"""The /ws/ consumer in the test's own process, through Channels' WebsocketCommunicator: open a
socket with a token, send a frame, read the next one; and the small world most socket tests
start from."""

import json

from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from mqsite.asgi import application
from queues.models import Queue
from subscribers.provisioning import create_subscriber


async def connect(token, headers=None, client=None):
    """A socket opened with `token` in its URL; `client` stands for the peer's (host, port)."""
    comm = WebsocketCommunicator(application, f"/ws/?token={token}", headers=headers or [])
    if client is not None:
        comm.scope["client"] = client
    connected, _ = await comm.connect(timeout=5)
    assert connected
    return comm


async def send(comm, frame):
    await comm.send_to(text_data=json.dumps(frame))


async def recv(comm, timeout=3):
    return json.loads(await comm.receive_from(timeout=timeout))


async def recv_messages(comm, n, timeout=3):
    frames = [await recv(comm, timeout) for _ in range(n)]
    assert all(f["type"] == "message" for f in frames), frames
    return frames


@database_sync_to_async
def db(fn, *args, **kwargs):
    """Run a sync database call from an async test."""
    return fn(*args, **kwargs)


@database_sync_to_async
def setup(ordered=False):
    """The `db` queue (and a `secret` one nobody may use), with `owner` and `peer`, each allowed
    to publish to and subscribe to db, neither subscribed yet."""
    queue = Queue.objects.create(name="db", ordered=ordered)
    Queue.objects.create(name="secret")
    owner, owner_token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    peer, peer_token = create_subscriber("peer", publish=["db"], subscribe=["db"])
    return queue, (owner, owner_token), (peer, peer_token)


async def messages_until_quiet(comm, quiet=0.5, first_within=10):
    """The message frames that come until the socket says nothing for `quiet` seconds (what a
    window, a lease or a publish let out), the first waited for up to `first_within` seconds:
    on a loaded machine the first may take longer than the quiet that ends the rest."""
    got = []
    wait = first_within
    while not await comm.receive_nothing(timeout=wait):
        frame = await recv(comm)
        assert frame["type"] == "message", frame
        got.append(frame)
        wait = quiet
    return got
