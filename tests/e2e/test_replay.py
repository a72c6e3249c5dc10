"""End to end: replay over a real Daphne, a real websocket and REST (API.md, Extensions)."""

import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from websockets.sync.client import connect

from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber
from tests.support.http import post, publish_over_http
from tests.support.servers import eventually, nothing_for

pytestmark = pytest.mark.django_db(transaction=True)


def frames(ws, n, timeout=10):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.append(json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.01))))
    return got


def test_a_new_subscription_replays_the_last_hours_messages_in_order_then_live_ones(server):
    Queue.objects.create(name="db")
    _, token = create_subscriber("analytics", publish=["db"], subscribe=["db"])
    publish_over_http(server, token, 30)
    # the first ten are older than an hour; the next twenty are of the last hour
    Message.objects.filter(seq__lte=10).update(created_at=timezone.now() - timedelta(hours=2))
    hour_ago = (timezone.now() - timedelta(hours=1)).isoformat()

    with connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "db", "from": {"time": hour_ago}}))
        subscribed = json.loads(ws.recv(timeout=10))
        assert subscribed["type"] == "subscribed"
        assert subscribed["replay"] == {"from_seq": 11, "deliveries": 20}
        history = frames(ws, 20)
        assert [f["type"] for f in history] == ["message"] * 20
        assert [f["seq"] for f in history] == list(range(11, 31))
        assert [f["payload"] for f in history] == [{"n": i} for i in range(10, 30)]
        ws.send(json.dumps({"type": "ack", "ids": [f["id"] for f in history]}))
        publish_over_http(server, token, 1, start=30)
        [live] = frames(ws, 1)
        assert (live["type"], live["seq"]) == ("message", 31)
        ws.send(json.dumps({"type": "ack", "ids": [live["id"]]}))
        assert eventually(lambda: Delivery.objects.filter(status=Status.ACKED).count() == 21)
    assert not Delivery.objects.filter(seq__lte=10).exists()


def test_a_seek_on_an_ordered_queue_waits_for_the_one_in_flight_then_goes_in_seq_order(server):
    Queue.objects.create(name="db", ordered=True)
    _, token = create_subscriber("worker", publish=["db"], subscribe=["db"])
    with connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "db"}))
        subscription = json.loads(ws.recv(timeout=10))["subscription"]
        publish_over_http(server, token, 3)
        first = []
        for _ in range(2):  # seq 1 and 2, one at a time, acked
            [frame] = frames(ws, 1)
            first.append(frame)
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
        [in_flight] = frames(ws, 1)
        assert [f["seq"] for f in first] + [in_flight["seq"]] == [1, 2, 3]

        status, answer = post(server, token, f"/api/subscriptions/{subscription}/seek", {"seq": 1})
        assert status == 200 and answer["replay"] == {"from_seq": 1, "deliveries": 2}
        assert nothing_for(ws, 0.8)  # seq 3 is still in flight: nothing else is handed out
        ws.send(json.dumps({"type": "ack", "ids": [in_flight["id"]]}))
        again = []
        for _ in range(2):
            [frame] = frames(ws, 1)
            assert nothing_for(ws, 0.3)  # one at a time
            again.append(frame)
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
        assert [(f["id"], f["seq"], f["attempt"]) for f in again] == [(f["id"], f["seq"], 2) for f in first]
        assert eventually(lambda: set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED})
