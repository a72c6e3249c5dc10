"""End to end: real Daphne processes, real websocket clients, the real database and Redis."""

import contextlib
import json
import random
import socket
import threading
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from delivery import subscribing
from delivery.models import Delivery, Status
from tests.support.http import publish_over_http
from tests.support.personas import subscribed_owner
from tests.support.servers import eventually, redis_db, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)
REDIS_TEST_URL = redis_db(7)


@pytest.fixture
def make_owner_on_db():
    def make(ordered=False):
        queue, _, token, _ = subscribed_owner(ordered)
        return queue, token

    return make


def receive(ws, n, timeout=10, ack=True):
    frames = []
    deadline = time.monotonic() + timeout
    while len(frames) < n and time.monotonic() < deadline:
        try:
            frame = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
        except TimeoutError:
            break
        assert frame["type"] == "message", frame
        frames.append(frame)
        if ack:
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
    return frames


def test_a_subscriber_that_reconnects_gets_what_it_missed_then_live(server, make_owner_on_db):
    _, token = make_owner_on_db()
    with connect(f"{server.ws}?token={token}") as ws:
        publish_over_http(server, token, 3)
        assert [f["seq"] for f in receive(ws, 3)] == [1, 2, 3]
    publish_over_http(server, token, 4, start=3)  # while away
    with connect(f"{server.ws}?token={token}") as ws:
        assert [f["seq"] for f in receive(ws, 4)] == [4, 5, 6, 7]
        publish_over_http(server, token, 1, start=7)
        assert [f["seq"] for f in receive(ws, 1)] == [8]
    assert eventually(lambda: set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED})


def test_an_ordered_queue_arrives_in_order_one_at_a_time(server, make_owner_on_db):
    _, token = make_owner_on_db(ordered=True)
    publish_over_http(server, token, 5)
    seqs = []
    with connect(f"{server.ws}?token={token}") as ws:
        for _ in range(5):
            (frame,) = receive(ws, 1, ack=False)
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.2)  # nothing else while it is in flight
            seqs.append(frame["seq"])
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
    assert seqs == [1, 2, 3, 4, 5]


def test_two_connections_share_one_subscribers_deliveries(server, make_owner_on_db):
    """Neither acks, so each can hold at most MQ_PREFETCH (100): 150 messages must be split,
    each to exactly one of them."""
    _, token = make_owner_on_db()
    with connect(f"{server.ws}?token={token}") as a, connect(f"{server.ws}?token={token}") as b:
        time.sleep(0.2)
        publish_over_http(server, token, 150)
        got = {}

        def drain(name, ws):
            got[name] = receive(ws, 150, timeout=3, ack=False)

        threads = [threading.Thread(target=drain, args=(n, w)) for n, w in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ids = [f["id"] for f in got["a"] + got["b"]]
    assert len(ids) == 150 and len(set(ids)) == 150
    assert 50 <= len(got["a"]) <= 100 and 50 <= len(got["b"]) <= 100


def test_a_killed_socket_returns_what_it_held_at_once(server, make_owner_on_db):
    _, token = make_owner_on_db()
    publish_over_http(server, token, 5)
    with contextlib.suppress(ConnectionClosed, OSError), connect(f"{server.ws}?token={token}") as ws:
        held = receive(ws, 5, ack=False)
        assert len(held) == 5
        ws.socket.shutdown(socket.SHUT_RDWR)  # no closing handshake: the peer just vanishes
        ws.socket.close()
    # long before the 30 s ack deadline:
    assert eventually(lambda: Delivery.objects.filter(status=Status.PENDING).count() == 5)
    with connect(f"{server.ws}?token={token}") as ws:
        assert sorted(f["id"] for f in receive(ws, 5)) == sorted(f["id"] for f in held)


def test_two_daphne_processes_on_one_redis_deliver_to_a_subscriber_on_either(make_owner_on_db):
    _, token = make_owner_on_db()
    env = {"REDIS_URL": REDIS_TEST_URL}
    one, two = start_daphne(env), start_daphne(env)
    try:
        with connect(f"{two.ws}?token={token}") as ws:
            time.sleep(6.5)  # idle past Redis's read timeout: the socket must stay open
            started = time.monotonic()
            publish_over_http(one, token, 1)  # published through the other process
            (frame,) = receive(ws, 1, timeout=5)
            assert frame["seq"] == 1
            # woken through Redis, not by the 2 s safety-net timer
            assert time.monotonic() - started < 1.5
    finally:
        one.stop()
        two.stop()


def test_a_burst_with_subscribers_dropping_mid_burst_loses_nothing(server, make_owner_on_db, make_subscriber):
    queue, token = make_owner_on_db()
    tokens = {"owner": token}
    for name in ("second", "third"):
        sub = make_subscriber(name, publish=(), subscribe=("db",))
        subscribing.subscribe(sub, queue)
        tokens[name] = sub.token
    total = 1000
    received = {name: set() for name in tokens}
    stop = threading.Event()

    def flaky_subscriber(name, seed):
        rnd = random.Random(seed)
        while not stop.is_set() or len(received[name]) < total:
            try:
                # close_timeout: a client that closes with frames still unread waits that long
                # for the server's close frame behind them.
                with connect(f"{server.ws}?token={tokens[name]}", close_timeout=0.5) as ws:
                    until = time.monotonic() + rnd.uniform(0.1, 0.6)
                    while time.monotonic() < until:
                        try:
                            frame = json.loads(ws.recv(timeout=0.1))
                        except TimeoutError:
                            if stop.is_set() and len(received[name]) >= total:
                                return
                            continue
                        received[name].add(frame["message_id"])
                        if rnd.random() < 0.9:  # some are never acked before the drop
                            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
                    if rnd.random() < 0.5:  # half the drops are abrupt: no closing handshake
                        ws.socket.shutdown(socket.SHUT_RDWR)
            except (ConnectionClosed, OSError):
                pass
            if time.monotonic() > deadline:
                return

    deadline = time.monotonic() + 60
    threads = [threading.Thread(target=flaky_subscriber, args=(n, i)) for i, n in enumerate(tokens)]
    for t in threads:
        t.start()
    published = []
    for start in range(0, total, 50):
        published += [m["id"] for m in publish_over_http(server, token, 50, start=start)]
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(timeout=100)
    for name, got in received.items():
        assert got == set(published), f"{name} missed {len(set(published) - got)}"
