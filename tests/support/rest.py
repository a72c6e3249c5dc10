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
