"""/api/subscriptions: durable subscriptions, each subscriber seeing only its own."""

from delivery.models import Delivery, Status
from subscribers.models import Subscription
from tests.conftest import client_for
from tests.support.rest import subscribe


def test_it_subscribes_to_one_event_and_answers_201(logger):
    r = subscribe(logger, {"queue": "db", "event": "create"})
    assert r.status_code == 201
    body = r.json()
    assert set(body) == {"id", "queue", "event", "created_at", "paused", "filter"}
    assert body["paused"] is False
    assert body["queue"] == "db" and body["event"] == "create"
    assert Subscription.objects.get(pk=body["id"]).subscriber == logger


def test_no_event_or_null_means_every_event(logger):
    first = subscribe(logger, {"queue": "db"})
    assert first.status_code == 201 and first.json()["event"] is None
    again = subscribe(logger, {"queue": "db", "event": None})
    assert again.status_code == 200 and again.json() == first.json()


def test_the_same_subscription_again_answers_200_with_it(logger):
    first = subscribe(logger, {"queue": "db", "event": "create"})
    again = subscribe(logger, {"queue": "DB", "event": "Create"})
    assert again.status_code == 200
    assert again.json() == first.json()
    assert Subscription.objects.count() == 1


def test_the_list_holds_only_the_callers_own(logger, peer):
    mine = subscribe(logger, {"queue": "db", "event": "create"}).json()
    subscribe(peer, {"queue": "db"})
    r = client_for(logger).get("/api/subscriptions")
    assert r.status_code == 200
    assert r.json() == {"subscriptions": [mine]}


def test_unsubscribing_drops_what_was_owed_and_keeps_acked_history(logger):
    sub = subscribe(logger, {"queue": "db"}).json()
    c = client_for(logger)
    c.post(
        "/api/queues/db/messages",
        {"messages": [{"event": "e", "payload": i} for i in range(3)]},
        format="json",
    )
    leased = c.get("/api/deliveries?limit=1").json()["deliveries"]
    c.post("/api/deliveries/ack", {"ids": [leased[0]["id"]]}, format="json")
    r = c.delete(f"/api/subscriptions/{sub['id']}")
    assert r.status_code == 204
    assert not Subscription.objects.exists()
    assert list(Delivery.objects.values_list("status", flat=True)) == [Status.ACKED]
    assert c.get("/api/deliveries").json() == {"deliveries": []}


def test_another_subscribers_subscription_is_404_and_untouched(logger, peer):
    theirs = subscribe(peer, {"queue": "db"}).json()
    r = client_for(logger).delete(f"/api/subscriptions/{theirs['id']}")
    assert r.status_code == 404
    assert Subscription.objects.filter(pk=theirs["id"]).exists()
    assert client_for(logger).delete("/api/subscriptions/999999").status_code == 404
    assert client_for(logger).delete(f"/api/subscriptions/{2**70}").status_code == 404


def test_an_unknown_queue_is_404_and_a_forbidden_one_403(logger, outsider, make_queue):
    assert subscribe(logger, {"queue": "nope"}).status_code == 404
    assert subscribe(outsider, {"queue": "nope"}).status_code == 404
    assert subscribe(outsider, {"queue": "db"}).status_code == 403
    make_queue("other")
    assert subscribe(logger, {"queue": "other"}).status_code == 403
    assert not Subscription.objects.exists()


def test_malformed_bodies_get_400(logger):
    for body in ({}, {"queue": 5}, {"queue": "db", "event": "bad name"}, {"queue": "db", "event": 3}, [1]):
        r = subscribe(logger, body)
        assert r.status_code == 400, (body, r.content)
    assert not Subscription.objects.exists()


def test_operators_and_anonymous_callers_cannot_subscribe(operator_client, db_queue):
    assert operator_client.post("/api/subscriptions", {"queue": "db"}, format="json").status_code == 403
    assert client_for().post("/api/subscriptions", {"queue": "db"}, format="json").status_code == 401
    assert client_for().get("/api/subscriptions").status_code == 401
