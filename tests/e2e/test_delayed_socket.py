"""A delayed message end to end: published over REST to a real Daphne, it reaches a real
websocket that waits for it, at its deliver_at (within the socket's recheck of the ledger, the
safety net that finds deliveries falling due, as it finds retries), not before, as its first
attempt; and a message that expires unacked on that socket is dead with the reason expired."""

import json
import time
import urllib.request
from datetime import UTC, datetime

import pytest
from django.utils.dateparse import parse_datetime
from websockets.sync.client import connect as ws_connect

from delivery import ledger, subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.servers import eventually

pytestmark = pytest.mark.django_db(transaction=True)


def publish(server, token, body):
    req = urllib.request.Request(
        f"{server.http}/api/queues/db/messages",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201
        return json.loads(r.read())


def test_a_waiting_socket_gets_a_delayed_message_at_its_time(server):
    # Given a subscriber's socket, subscribed and idle
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    with ws_connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "db"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "subscribed"

        # When a message delayed by 2 s is published, and one that is not
        delayed = publish(server, token, {"event": "create", "payload": "later", "delay_secs": 2})
        publish(server, token, {"event": "create", "payload": "now"})

        # Then the undelayed one comes at once, and the delayed one only at its time
        first = json.loads(ws.recv(timeout=10))
        assert (first["payload"], first["deliver_at"]) == ("now", None)
        ws.send(json.dumps({"type": "ack", "ids": [first["id"]]}))
        second = json.loads(ws.recv(timeout=10))
        got_at = datetime.now(UTC)
        deliver_at = parse_datetime(second["deliver_at"])
        assert second["message_id"] == delayed["id"] and second["payload"] == "later"
        assert got_at >= deliver_at and second["attempt"] == 1
        ws.send(json.dumps({"type": "ack", "ids": [second["id"]]}))
        assert eventually(lambda: Delivery.objects.get(message_id=delayed["id"]).status == Status.ACKED)


def test_a_message_that_expires_on_a_closed_socket_is_dead_expired(server):
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    with ws_connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "db"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "subscribed"
        publish(server, token, {"event": "create", "payload": 1, "ttl_secs": 1})
        frame = json.loads(ws.recv(timeout=10))
        assert parse_datetime(frame["expires_at"]) > parse_datetime(frame["published_at"])
        time.sleep(1.2)  # its expiry passes while it is held, unacked
    # The socket closed holding it: its lease ended unacked after its expiry
    assert eventually(lambda: Delivery.objects.get().status == Status.DEAD, timeout=10)
    assert Delivery.objects.get().last_error == ledger.EXPIRED
