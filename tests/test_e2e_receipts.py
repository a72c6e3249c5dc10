"""Receipts end to end: real Daphne processes, a publisher's socket, subscribers acking over the
socket and over REST, in the same process and (services mode) in another one."""

import json
import time
import urllib.request

import pytest
from django.db import connection
from websockets.sync.client import connect

from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers import subscribing
from subscribers.provisioning import create_subscriber
from tests.servers import E2E_REDIS, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world():
    """A publisher without subscriptions, and two subscribers of db."""
    queue = Queue.objects.create(name="db")
    _, publisher = create_subscriber("publisher", publish=["db"], subscribe=[])
    tokens = []
    for name in ("first", "second"):
        subscriber, token = create_subscriber(name, publish=[], subscribe=["db"])
        subscribing.subscribe(subscriber, queue)
        tokens.append(token)
    return publisher, tokens


def rest(server, method, path, token, body=None):
    req = urllib.request.Request(
        f"{server.http}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def pull_and_ack(server, token):
    (d,) = rest(server, "GET", "/api/deliveries?limit=10", token)["deliveries"]
    assert rest(server, "POST", "/api/deliveries/ack", token, {"ids": [d["id"]]}) == {
        "acked": 1,
        "unknown": [],
    }
    return time.monotonic()


def publish_with_receipt(ws):
    ws.send(json.dumps({"type": "publish", "queue": "db", "event": "create", "payload": 1, "receipt": True}))
    published = json.loads(ws.recv(timeout=10))
    assert published["type"] == "published" and published["deliveries"] == 2
    return published["id"]


def test_a_receipt_after_a_socket_ack_and_a_rest_ack_on_the_server(world):
    publisher, (first, second) = world
    server = start_daphne()
    try:
        with connect(f"{server.ws}?token={publisher}") as ws, connect(f"{server.ws}?token={first}") as sub:
            message_id = publish_with_receipt(ws)
            held = json.loads(sub.recv(timeout=10))
            assert held["type"] == "message" and held["message_id"] == message_id
            sub.send(json.dumps({"type": "ack", "ids": [held["id"]]}))
            with pytest.raises(TimeoutError):
                ws.recv(timeout=1.0)  # the second subscriber's delivery is still pending

            pull_and_ack(server, second)

            receipt = json.loads(ws.recv(timeout=5))
            assert receipt == {
                "type": "receipt",
                "id": message_id,
                "deliveries": {"pending": 0, "inflight": 0, "acked": 2, "dead": 0},
            }
            assert rest(server, "GET", f"/api/messages/{message_id}", publisher)["deliveries"]["acked"] == 2
    finally:
        server.stop()
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_a_rest_ack_in_another_process_reaches_the_publishers_socket(world):
    if connection.vendor != "postgresql":
        pytest.skip(
            "two web processes are the services mode's (PostgreSQL and Redis): "
            "the PostgreSQL pass of make test runs it"
        )
    publisher, (first, second) = world
    servers = [start_daphne({"REDIS_URL": E2E_REDIS}), start_daphne({"REDIS_URL": E2E_REDIS})]
    try:
        with connect(f"{servers[0].ws}?token={publisher}") as ws:
            message_id = publish_with_receipt(ws)
            pull_and_ack(servers[1], first)
            with pytest.raises(TimeoutError):
                ws.recv(timeout=1.0)
            acked_at = pull_and_ack(servers[1], second)

            receipt = json.loads(ws.recv(timeout=5))
            waited = time.monotonic() - acked_at
            assert receipt["type"] == "receipt" and receipt["id"] == message_id
            assert receipt["deliveries"] == {"pending": 0, "inflight": 0, "acked": 2, "dead": 0}
            # The announcement over Redis, not the 2 s recheck (which could only make it later).
            assert waited < 1.0, waited
    finally:
        for s in servers:
            s.stop()
