"""The REST API in the test's own process, through DRF's test client, as a subscriber calls it
(tests.conftest.client_for puts its token on the client)."""

from tests.conftest import client_for


def post_messages(who, body, queue="db"):
    """POST `body` (one message or a batch) to the queue's messages as `who`: the answer."""
    return client_for(who).post(f"/api/queues/{queue}/messages", body, format="json")


def pull(who, query=""):
    """GET /api/deliveries as `who` (query: "?limit=...&wait=..."): the deliveries leased."""
    r = client_for(who).get(f"/api/deliveries{query}")
    assert r.status_code == 200, r.content
    return r.json()["deliveries"]


def subscribe(who, body):
    """POST /api/subscriptions as `who`: the answer."""
    return client_for(who).post("/api/subscriptions", body, format="json")


def ack(who, ids):
    """POST /api/deliveries/ack as `who`; it must succeed."""
    r = client_for(who).post("/api/deliveries/ack", {"ids": list(ids)}, format="json")
    assert r.status_code == 200, r.content


def seek(who, subscription_id, body):
    """POST /api/subscriptions/{id}/seek as `who` (body: {"seq"} or {"time"}): the answer."""
    return client_for(who).post(f"/api/subscriptions/{subscription_id}/seek", body, format="json")
