"""Competing consumers across server processes (the services mode): workers of one
subscriber on two Daphne processes share a stream published through one of them."""

import json
import threading
import time

import pytest
from websockets.sync.client import connect as ws_connect

from delivery import subscribing
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.servers import redis_db, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)
REDIS = {"REDIS_URL": redis_db(7)}


def worker_and_api():
    """(the workers' token, the publisher's token): a subscriber "worker" of queue db, whose
    sockets are the workers, and "api", which only publishes (its socket gets nothing)."""
    queue = Queue.objects.create(name="db")
    worker, token = create_subscriber("worker", publish=["db"], subscribe=["db"])
    subscribing.subscribe(worker, queue)
    return token, create_subscriber("api", publish=["db"])[1]


def test_workers_on_two_daphne_processes_share_a_stream_published_on_one():
    """The publisher's own process wakes its socket at the commit, before Redis carries the
    word to the other: unless it waits for its echo, its worker takes everything."""
    token, api_token = worker_and_api()
    one, two = start_daphne(REDIS), start_daphne(REDIS)
    got = {"one": 0, "two": 0}
    stop = threading.Event()

    def work(name, url):
        with ws_connect(f"{url}?token={token}") as ws:
            ready.release()
            while not stop.is_set():
                try:
                    frame = json.loads(ws.recv(timeout=0.2))
                except TimeoutError:
                    continue
                got[name] += 1
                time.sleep(0.005)  # some work
                ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))

    ready = threading.Semaphore(0)
    threads = [threading.Thread(target=work, args=(n, s.ws)) for n, s in (("one", one), ("two", two))]
    try:
        for t in threads:
            t.start()
        for _ in threads:
            assert ready.acquire(timeout=10)
        time.sleep(0.3)  # past the resume grace: each process knows of the other's socket at once
        with ws_connect(f"{one.ws}?token={api_token}") as publisher:
            for i in range(100):
                publisher.send(json.dumps({"type": "publish", "queue": "db", "event": "e", "payload": i}))
                assert json.loads(publisher.recv(timeout=10))["type"] == "published"
                time.sleep(0.01)
        deadline = time.monotonic() + 20
        while sum(got.values()) < 100 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        one.stop()
        two.stop()
    assert sum(got.values()) == 100
    assert min(got.values()) >= 25, got  # about half each


def test_a_burst_published_right_after_two_workers_connected_to_two_processes_is_split():
    """The held-out check of issue 15: 40 messages, two connections, and nothing waits for a
    periodic loop to learn that the subscriber is shared."""
    token, api_token = worker_and_api()
    one, two = start_daphne(REDIS), start_daphne(REDIS)
    try:
        with ws_connect(f"{one.ws}?token={token}") as a, ws_connect(f"{two.ws}?token={token}") as b:
            time.sleep(0.3)
            with ws_connect(f"{one.ws}?token={api_token}") as publisher:
                batch = [{"event": "e", "payload": i} for i in range(40)]
                publisher.send(json.dumps({"type": "publish", "queue": "db", "messages": batch}))
                assert json.loads(publisher.recv(timeout=10))["type"] == "published"
            got = {"a": [], "b": []}
            deadline = time.monotonic() + 15  # all 40, however slow the machine; then 1 s of quiet
            while sum(map(len, got.values())) < 40 and time.monotonic() < deadline:
                for name, ws in (("a", a), ("b", b)):
                    while True:
                        try:
                            got[name].append(json.loads(ws.recv(timeout=1)))
                        except TimeoutError:
                            break
    finally:
        one.stop()
        two.stop()
    ids = [f["id"] for frames in got.values() for f in frames]
    assert len(ids) == 40 and len(set(ids)) == 40
    assert min(len(frames) for frames in got.values()) >= 10, {k: len(v) for k, v in got.items()}
