"""Revocation over REST (issue 14, item 1): what a process keeps of a token, a queue or a
publish grant is forgotten at the change's announcement, so the next request after a change is
answered by the change; and failed token attempts are throttled per client address."""

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from delivery import ledger, publishing, revocation, subscribing
from delivery.models import Delivery, Status
from subscribers import auth
from subscribers.models import Subscriber
from subscribers.provisioning import provision_subscriber
from tests.conftest import client_for

pytestmark = pytest.mark.django_db


def get_deliveries(client):
    return client.get("/api/deliveries")


def test_a_rotated_token_is_refused_at_once_and_the_new_one_works(logger, db_queue):
    client = client_for(logger)
    assert get_deliveries(client).status_code == 200
    _, new_token, _, _ = provision_subscriber("logger", publish=["db"], subscribe=["db"], update=True)
    assert get_deliveries(client).status_code == 401
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {new_token}")
    assert get_deliveries(client).status_code == 200


@pytest.mark.parametrize("change", ["deactivate", "delete"])
def test_a_deactivated_or_deleted_subscriber_is_refused_at_once(logger, change):
    client = client_for(logger)
    assert get_deliveries(client).status_code == 200
    if change == "deactivate":
        logger.is_active = False
        logger.save()
    else:
        logger.delete()
    assert get_deliveries(client).status_code == 401


def test_a_withdrawn_publish_right_is_refused_at_once(logger, db_queue):
    client = client_for(logger)
    body = {"event": "create", "payload": 1}
    assert client.post("/api/queues/db/messages", body, format="json").status_code == 201
    logger.publish_queues.remove(db_queue)
    assert client.post("/api/queues/db/messages", body, format="json").status_code == 403


def test_a_publish_grant_is_read_once_then_kept_in_the_process(logger, db_queue, django_assert_num_queries):
    client = client_for(logger)
    body = {"event": "create", "payload": 1}
    grants = Subscriber.publish_queues.through._meta.db_table
    assert client.post("/api/queues/db/messages", body, format="json").status_code == 201
    with CaptureQueriesContext(connection) as second:
        assert client.post("/api/queues/db/messages", body, format="json").status_code == 201
    assert not [q["sql"] for q in second.captured_queries if grants in q["sql"]]
    with django_assert_num_queries(0):
        assert logger.may_publish(db_queue)


def test_a_grant_withdrawn_in_another_process_is_refused_once_announced(logger, db_queue):
    client = client_for(logger)
    body = {"event": "create", "payload": 1}
    assert client.post("/api/queues/db/messages", body, format="json").status_code == 201  # kept
    # Withdrawn by another process: its signals ran there; this one hears only its word.
    Subscriber.publish_queues.through.objects.filter(subscriber=logger, queue=db_queue).delete()
    revocation.announce(subscriber_ids=[logger.pk])
    assert client.post("/api/queues/db/messages", body, format="json").status_code == 403
    assert not logger.may_publish(db_queue)
    # Given back, with no announcement: a refusal is never kept, so the next publish goes in.
    Subscriber.publish_queues.through.objects.create(subscriber=logger, queue=db_queue)
    assert client.post("/api/queues/db/messages", body, format="json").status_code == 201


def test_a_withdrawn_subscribe_right_stops_its_pulls_and_keeps_what_is_owed(logger, db_queue):
    client = client_for(logger)
    subscription, _ = subscribing.subscribe(logger, db_queue)
    publishing.publish(db_queue, [publishing.prepare("create", i) for i in range(3)])
    [held] = ledger.lease_deliveries(logger, limit=1)
    logger.subscribe_queues.remove(db_queue)

    assert get_deliveries(client).json() == {"deliveries": []}
    answer = client.post("/api/subscriptions", {"queue": "db"}, format="json")
    assert answer.status_code == 403
    publishing.publish(db_queue, [publishing.prepare("create", 9)])  # no fan-out to it
    assert Delivery.objects.filter(subscription=subscription).count() == 3
    assert Delivery.objects.get(pk=held["id"]).status == Status.INFLIGHT  # until its deadline

    logger.subscribe_queues.add(db_queue)  # given back: what it is owed resumes
    assert len(get_deliveries(client).json()["deliveries"]) == 2


@pytest.fixture
def two_failures(settings):
    settings.MQ_AUTH_FAILURES_PER_MINUTE = 2


def bad(client, address="10.0.0.7", **extra):
    return client.get("/api/deliveries", HTTP_AUTHORIZATION="Bearer mq_wrong", REMOTE_ADDR=address, **extra)


def test_failed_token_attempts_from_an_address_are_throttled_429(two_failures, logger, monkeypatch):
    client = client_for()
    assert [bad(client).status_code for _ in range(2)] == [401, 401]
    answer = bad(client)
    assert answer.status_code == 429
    assert 1 <= int(answer["Retry-After"]) <= 60
    # Per address, read from the socket's peer: a forged X-Forwarded-For changes nothing.
    assert bad(client, HTTP_X_FORWARDED_FOR="10.9.9.9").status_code == 429
    assert bad(client, address="10.0.0.8").status_code == 401
    # A good token from the throttled address is never refused by this.
    assert client_for(logger).get("/api/deliveries", REMOTE_ADDR="10.0.0.7").status_code == 200


def test_the_throttle_ends_with_its_window(two_failures, monkeypatch):
    monkeypatch.setattr(auth, "FAILURE_WINDOW_SECS", 1)
    client = client_for()
    answer = bad(client)
    while answer.status_code != 429:
        answer = bad(client)
    assert answer["Retry-After"] == "1"
    time.sleep(1.05)
    assert bad(client).status_code == 401


def test_good_tokens_do_not_count_as_failures(two_failures, logger):
    client = client_for(logger)
    for _ in range(5):
        assert client.get("/api/deliveries", REMOTE_ADDR="10.0.0.7").status_code == 200
    assert bad(client_for()).status_code == 401
