"""Receipts end to end: real Daphne processes, a publisher's socket, subscribers acking over the
socket and over REST, in the same process and (services mode) in another one."""

import json
import time
import urllib.error
import urllib.request

import pytest
from django.db import connection
from websockets.sync.client import connect

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber
from tests.support.servers import E2E_REDIS, frames_within, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def publisher_and_two_subscribers():
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


def test_a_receipt_after_a_socket_ack_and_a_rest_ack_on_the_server(publisher_and_two_subscribers):
    publisher, (first, second) = publisher_and_two_subscribers
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


def test_a_rest_ack_in_another_process_reaches_the_publishers_socket(publisher_and_two_subscribers):
    if connection.vendor != "postgresql":
        pytest.skip(
            "two web processes are the services mode's (PostgreSQL and Redis): "
            "the PostgreSQL pass of make test runs it"
        )
    publisher, (first, second) = publisher_and_two_subscribers
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


# --- a repeated idempotency key is no way into another publisher's receipt (issue 26, S3) -------


@pytest.fixture
def two_publishers(publisher_and_two_subscribers):
    """The publisher of `world` and a second one, `intruder`, who may publish to db too."""
    publisher, tokens = publisher_and_two_subscribers
    _, intruder = create_subscriber("intruder", publish=["db"], subscribe=[])
    return publisher, intruder, tokens


@pytest.mark.parametrize("processes", [1, 2], ids=["one-process", "two-processes"])
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_repeated_key_does_not_take_the_publishers_receipt(two_publishers, batch, processes):
    if processes == 2 and connection.vendor != "postgresql":
        pytest.skip("two web processes are the services mode's: the PostgreSQL pass runs it")
    publisher, intruder, (first, second) = two_publishers
    servers = [start_daphne({"REDIS_URL": E2E_REDIS} if processes == 2 else {}) for _ in range(processes)]
    # The intruder on the other process, where an announcement over Redis reaches it too.
    server, elsewhere = servers[0], servers[-1]

    def frame(ref, payload):
        item = {"event": "create", "payload": payload, "key": "order-1"}
        body = {"messages": [item]} if batch else item
        return json.dumps({"type": "publish", "queue": "db", "receipt": True, "ref": ref, **body})

    try:
        with (
            connect(f"{server.ws}?token={publisher}") as ws,
            connect(f"{elsewhere.ws}?token={intruder}") as other,
        ):
            ws.send(frame("a", 1))
            published = json.loads(ws.recv(timeout=10))
            message_id = published["messages"][0]["id"] if batch else published["id"]

            other.send(frame("b", 2))  # the same key, a receipt asked for
            repeated = json.loads(other.recv(timeout=10))
            assert repeated["type"] == "published" and repeated["ref"] == "b"
            # The contract's answer to a repeated key (the first message, nothing new)...
            assert (repeated["messages"][0] if batch else repeated)["id"] == message_id
            # ...over REST too; and its progress stays its publisher's.
            again = rest(
                elsewhere,
                "POST",
                "/api/queues/db/messages",
                intruder,
                {"event": "create", "payload": 3, "key": "order-1"},
            )
            assert again["id"] == message_id
            with pytest.raises(urllib.error.HTTPError) as not_yours:
                rest(elsewhere, "GET", f"/api/messages/{message_id}", intruder)
            assert not_yours.value.code == 404

            pull_and_ack(elsewhere, first)
            pull_and_ack(elsewhere, second)

            receipt = json.loads(ws.recv(timeout=5))
            assert receipt == {
                "type": "receipt",
                "id": message_id,
                "deliveries": {"pending": 0, "inflight": 0, "acked": 2, "dead": 0},
                "ref": "a",
            }
            # Past the 2 s recheck too: the intruder hears nothing of the message.
            assert frames_within(other, 3.0) == []
    finally:
        for s in servers:
            s.stop()
    assert Delivery.objects.count() == 2  # one message, delivered once to each subscriber


# --- receipts awaited: a cap per subscriber, whatever its sockets (issue 26, S9) ---------------


def test_the_receipts_awaited_are_capped_per_subscriber_not_per_socket(publisher_and_two_subscribers):
    publisher, _ = publisher_and_two_subscribers
    server = start_daphne({"MQ_MAX_RECEIPTS_PER_SUBSCRIBER": "3"})
    items = [{"event": "create", "payload": i} for i in range(2)]
    publish = {"type": "publish", "queue": "db", "messages": items, "receipt": True}
    try:
        with (
            connect(f"{server.ws}?token={publisher}") as one,
            connect(f"{server.ws}?token={publisher}") as two,
            connect(f"{server.ws}?token={publisher}") as three,
        ):
            one.send(json.dumps({**publish, "ref": 1}))
            assert json.loads(one.recv(timeout=10))["type"] == "published"  # 2 of 3 awaited
            for ws in (two, three):  # another socket adds no room of its own
                ws.send(json.dumps({**publish, "ref": 2}))
                error = json.loads(ws.recv(timeout=10))
                assert error["type"] == "error" and error["code"] == "too_many_receipts"
                assert error["ref"] == 2 and "MQ_MAX_RECEIPTS_PER_SUBSCRIBER" in error["detail"]
            # Within the cap, still fine; and a publish without a receipt is not capped.
            two.send(json.dumps({**publish, "messages": items[:1], "ref": 3}))
            assert json.loads(two.recv(timeout=10))["type"] == "published"
            three.send(json.dumps({**publish, "receipt": False, "ref": 4}))
            assert json.loads(three.recv(timeout=10))["type"] == "published"
    finally:
        server.stop()
    assert Message.objects.count() == 2 + 1 + 2  # nothing of the refused frames


# --- another process's settle, in the embedded mode (no Redis): the log of moves (issue 26, S9) --


def test_a_settle_by_another_process_without_redis_reaches_the_socket_through_the_log(
    publisher_and_two_subscribers,
):
    """The server hears nothing from the process that acks (no Redis): its recheck reads the
    moves that process logged. The ack waits until the server's first pass of the receipt has
    run (that one probes all it awaits), so the receipt can only come through the log: the next
    full pass is FULL_RECHECK_SECS (30 s) away."""
    from delivery import ledger
    from subscribers.models import Subscriber

    publisher, _ = publisher_and_two_subscribers
    server = start_daphne({"REDIS_URL": None})
    try:
        with connect(f"{server.ws}?token={publisher}") as ws:
            message_id = publish_with_receipt(ws)
            with pytest.raises(TimeoutError):
                ws.recv(timeout=5.0)  # two or more recheck passes (every 2 s) with nothing settled
            for subscriber in Subscriber.objects.filter(name__in=["first", "second"]):
                (d,) = ledger.lease_deliveries(subscriber, limit=1)
                ledger.ack_deliveries(subscriber, [d["id"]])  # in this process, not the server's
            acked_at = time.monotonic()

            receipt = json.loads(ws.recv(timeout=15))
            waited = time.monotonic() - acked_at
            assert receipt == {
                "type": "receipt",
                "id": message_id,
                "deliveries": {"pending": 0, "inflight": 0, "acked": 2, "dead": 0},
            }
            assert waited < 10, waited  # a recheck pass or two, not a full one 30 s on
    finally:
        server.stop()
