from tests.conftest import client_for


def test_it_publishes_pulls_and_acks(logger, db_queue, django_capture_on_commit_callbacks):
    c = client_for(logger)
    r = c.post("/api/subscriptions", {"queue": "db", "event": "create"}, format="json")
    assert r.status_code == 201, r.content
    with django_capture_on_commit_callbacks(execute=True):
        r = c.post("/api/queues/db/messages", {"event": "create", "payload": {"a": 1}}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["deliveries"] == 1
    r = c.get("/api/deliveries")
    assert r.status_code == 200
    ds = r.json()["deliveries"]
    assert [d["payload"] for d in ds] == [{"a": 1}]
    r = c.post("/api/deliveries/ack", {"ids": [ds[0]["id"]]}, format="json")
    assert r.json() == {"acked": 1, "unknown": []}
