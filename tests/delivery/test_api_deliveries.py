"""/api/deliveries: pull with a lease, long-poll, ack and nack, and who may touch what."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from delivery.models import Delivery, Status
from tests.conftest import client_for
from tests.support.fields import DELIVERY_FIELDS
from tests.support.rest import pull


def post_batch(who, n, event="create", queue="db"):
    msgs = [{"event": event, "payload": {"n": i}} for i in range(n)]
    return client_for(who).post(f"/api/queues/{queue}/messages", {"messages": msgs}, format="json")


def test_it_leases_ready_deliveries_oldest_first_with_a_deadline(owner):
    post_batch(owner, 3)
    before = timezone.now()
    ds = pull(owner)
    assert [d["seq"] for d in ds] == [1, 2, 3]
    d = ds[0]
    assert set(d) == DELIVERY_FIELDS
    assert d["queue"] == "db" and d["event"] == "create" and d["payload"] == {"n": 0} and d["attempt"] == 1
    deadline = parse_datetime(d["ack_deadline"])
    assert before + timedelta(seconds=29) < deadline < timezone.now() + timedelta(seconds=31)
    assert Delivery.objects.filter(status=Status.INFLIGHT).count() == 3
    assert pull(owner) == []  # all are leased: nothing ready


def test_limit_caps_the_lease(owner):
    post_batch(owner, 5)
    assert [d["seq"] for d in pull(owner, "?limit=2")] == [1, 2]
    assert [d["seq"] for d in pull(owner, "?limit=2")] == [3, 4]
    assert [d["seq"] for d in pull(owner, "?limit=1000")] == [5]


@pytest.mark.parametrize(
    "query", ["?limit=0", "?limit=1001", "?limit=x", "?wait=-1", "?wait=31", "?wait=nan", "?event=bad%20name"]
)
def test_bad_parameters_get_400(owner, query):
    r = client_for(owner).get(f"/api/deliveries{query}")
    assert r.status_code == 400, r.content


def test_queue_and_event_filter_the_lease(owner, make_queue):
    make_queue("fs")
    owner.subscribe_all = owner.publish_all = True
    owner.save()
    client_for(owner).post("/api/subscriptions", {"queue": "fs"}, format="json")
    post_batch(owner, 2, event="create")
    post_batch(owner, 2, event="delete")
    post_batch(owner, 1, event="write", queue="fs")
    assert {d["event"] for d in pull(owner, "?queue=db&event=delete")} == {"delete"}
    assert [d["queue"] for d in pull(owner, "?queue=fs")] == ["fs"]
    assert len(pull(owner)) == 2
    assert client_for(owner).get("/api/deliveries?queue=nope").status_code == 404


def test_a_subscriber_never_sees_or_acks_another_subscribers_deliveries(owner, peer):
    post_batch(owner, 2)  # peer has no subscription yet: nothing owed to it
    assert pull(peer) == []
    mine = pull(owner)
    r = client_for(peer).post("/api/deliveries/ack", {"ids": [d["id"] for d in mine]}, format="json")
    assert r.json() == {"acked": 0, "unknown": [d["id"] for d in mine]}
    assert Delivery.objects.filter(status=Status.INFLIGHT).count() == 2
    r = client_for(peer).post(f"/api/deliveries/{mine[0]['id']}/nack", {}, format="json")
    assert r.status_code == 404
    assert Delivery.objects.get(pk=mine[0]["id"]).status == Status.INFLIGHT


def test_ack_counts_only_new_acks_and_names_unknown_ids(owner):
    post_batch(owner, 2)
    ids = [d["id"] for d in pull(owner)]
    c = client_for(owner)
    r = c.post("/api/deliveries/ack", {"ids": [ids[0], 999999, ids[0]]}, format="json")
    assert r.status_code == 200
    assert r.json() == {"acked": 1, "unknown": [999999]}
    r = c.post("/api/deliveries/ack", {"ids": ids + [2**80, -1]}, format="json")
    assert r.json() == {"acked": 1, "unknown": [2**80, -1]}
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}
    assert all(Delivery.objects.values_list("acked_at", flat=True))


@pytest.mark.parametrize(
    "body", [{}, {"ids": "1"}, {"ids": ["a"]}, {"ids": [1.5]}, {"ids": [{"id": 1}]}, [1]]
)
def test_a_malformed_ack_gets_400(owner, body):
    assert client_for(owner).post("/api/deliveries/ack", body, format="json").status_code == 400


def test_an_empty_ack_is_harmless(owner):
    r = client_for(owner).post("/api/deliveries/ack", {"ids": []}, format="json")
    assert r.json() == {"acked": 0, "unknown": []}


def test_nack_returns_the_delivery_after_its_backoff(owner):
    post_batch(owner, 1)
    (d,) = pull(owner)
    before = timezone.now()
    r = client_for(owner).post(f"/api/deliveries/{d['id']}/nack", {}, format="json")
    assert r.status_code == 200
    assert r.json()["status"] == "pending"
    row = Delivery.objects.get(pk=d["id"])
    assert row.status == Status.PENDING and row.ack_deadline is None
    # after the first attempt the backoff is 1 s
    assert before + timedelta(seconds=0.9) < row.next_attempt_at < timezone.now() + timedelta(seconds=1.1)
    assert pull(owner) == []


def test_nack_with_retry_in_zero_is_ready_at_once_and_keeps_the_id(owner):
    post_batch(owner, 1)
    (d,) = pull(owner)
    r = client_for(owner).post(f"/api/deliveries/{d['id']}/nack", {"retry_in": 0}, format="json")
    assert r.status_code == 200
    (again,) = pull(owner)
    assert again["id"] == d["id"] and again["attempt"] == 2


def test_a_nack_may_say_why_and_the_reason_is_kept_for_the_operator(owner, db_queue):
    db_queue.max_attempts = 1
    db_queue.save()
    post_batch(owner, 1)
    (d,) = pull(owner)
    r = client_for(owner).post(
        f"/api/deliveries/{d['id']}/nack", {"error": "no such customer"}, format="json"
    )
    assert r.status_code == 200 and r.json()["status"] == "dead"
    assert Delivery.objects.get(pk=d["id"]).last_error.startswith("nacked by the client: no such customer")


def test_nack_without_a_body_is_accepted(owner):
    post_batch(owner, 1)
    (d,) = pull(owner)
    r = client_for(owner).post(f"/api/deliveries/{d['id']}/nack")
    assert r.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"retry_in": -1},
        {"retry_in": "soon"},
        {"retry_in": 10**9},
        {"error": 5},
        {"error": "x" * 1001},
        {"error": "a\x00"},
    ],
)
def test_a_malformed_nack_gets_400(owner, body):
    post_batch(owner, 1)
    (d,) = pull(owner)
    assert client_for(owner).post(f"/api/deliveries/{d['id']}/nack", body, format="json").status_code == 400
    assert Delivery.objects.get(pk=d["id"]).status == Status.INFLIGHT


def test_nack_of_an_acked_delivery_is_409(owner):
    post_batch(owner, 1)
    (d,) = pull(owner)
    client_for(owner).post("/api/deliveries/ack", {"ids": [d["id"]]}, format="json")
    r = client_for(owner).post(f"/api/deliveries/{d['id']}/nack", {}, format="json")
    assert r.status_code == 409
    assert Delivery.objects.get(pk=d["id"]).status == Status.ACKED


def test_a_nack_of_the_last_attempt_kills_the_delivery(owner, db_queue):
    db_queue.max_attempts = 2
    db_queue.save()
    post_batch(owner, 1)
    c = client_for(owner)
    (d,) = pull(owner)
    c.post(f"/api/deliveries/{d['id']}/nack", {"retry_in": 0}, format="json")
    (d,) = pull(owner)
    assert d["attempt"] == 2
    r = c.post(f"/api/deliveries/{d['id']}/nack", {"retry_in": 0}, format="json")
    assert r.json()["status"] == "dead"
    row = Delivery.objects.get(pk=d["id"])
    assert row.status == Status.DEAD and "dead after 2 attempts" in row.last_error
    assert pull(owner) == []


def test_an_ordered_queue_hands_out_one_at_a_time_in_seq_order(owner, db_queue):
    db_queue.ordered = True
    db_queue.save()
    post_batch(owner, 3)
    c = client_for(owner)
    seen = []
    for _ in range(3):
        ds = pull(owner, "?limit=10")
        assert len(ds) == 1
        assert pull(owner) == []  # nothing while one is in flight
        seen.append(ds[0]["seq"])
        c.post("/api/deliveries/ack", {"ids": [ds[0]["id"]]}, format="json")
    assert seen == [1, 2, 3]


def test_an_ordered_queue_waits_for_a_nacked_head(owner, db_queue):
    db_queue.ordered = True
    db_queue.save()
    post_batch(owner, 2)
    (head,) = pull(owner)
    client_for(owner).post(f"/api/deliveries/{head['id']}/nack", {"retry_in": 60}, format="json")
    assert pull(owner) == []  # seq 2 must not jump ahead of the waiting seq 1
    client_for(owner).post(f"/api/deliveries/{head['id']}/nack", {"retry_in": 0}, format="json")
    assert [d["seq"] for d in pull(owner)] == [1]


def test_a_paused_queue_hands_out_nothing(owner, db_queue):
    post_batch(owner, 1)
    db_queue.paused = True
    db_queue.save()
    assert pull(owner) == []
    db_queue.paused = False
    db_queue.save()
    assert len(pull(owner)) == 1


def test_an_overdue_lease_is_handed_out_again_after_its_backoff(owner):
    post_batch(owner, 1)
    (d,) = pull(owner)
    Delivery.objects.filter(pk=d["id"]).update(ack_deadline=timezone.now() - timedelta(seconds=5))
    (again,) = pull(owner)
    assert again["id"] == d["id"] and again["attempt"] == 2


def test_an_overdue_lease_on_its_last_attempt_dies(owner, db_queue):
    db_queue.max_attempts = 1
    db_queue.save()
    post_batch(owner, 1)
    (d,) = pull(owner)
    Delivery.objects.filter(pk=d["id"]).update(ack_deadline=timezone.now() - timedelta(seconds=5))
    assert pull(owner) == []
    assert Delivery.objects.get(pk=d["id"]).status == Status.DEAD


def test_wait_returns_at_once_when_something_is_ready(owner):
    post_batch(owner, 1)
    start = time.monotonic()
    assert len(pull(owner, "?wait=5")) == 1
    assert time.monotonic() - start < 2


def test_wait_times_out_with_an_empty_list(owner):
    start = time.monotonic()
    assert pull(owner, "?wait=0.6") == []
    assert time.monotonic() - start >= 0.6


@pytest.mark.django_db(transaction=True)
def test_wait_wakes_when_a_message_is_published(make_queue, make_subscriber):
    make_queue("db")
    owner = make_subscriber("owner", publish=("db",), subscribe=("db",))
    client_for(owner).post("/api/subscriptions", {"queue": "db"}, format="json")
    got = {}

    def long_poll():
        try:
            got["deliveries"] = pull(owner, "?wait=10")
            got["at"] = time.monotonic()
        finally:
            connection.close()

    t = threading.Thread(target=long_poll)
    t.start()
    time.sleep(0.3)
    published_at = time.monotonic()
    post_batch(owner, 1)
    t.join(timeout=15)
    assert [d["seq"] for d in got["deliveries"]] == [1]
    assert got["at"] - published_at < 2


def test_operators_cannot_pull_as_a_subscriber(operator_client, db_queue):
    assert operator_client.get("/api/deliveries").status_code == 403
    assert operator_client.post("/api/deliveries/ack", {"ids": [1]}, format="json").status_code == 403
