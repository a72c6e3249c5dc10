"""Every REST error carries a code a program can test beside its words: {"detail", "code", ...},
field errors kept beside them, the codes the socket's error frames use where the two mean the
same thing (docs/rest-api.md, "Errors")."""

import pytest
from django.test import override_settings

from delivery import ledger
from subscribers.models import Subscription
from tests.conftest import client_for
from tests.support.publish import publish


def error(response, status):
    assert response.status_code == status, response.content
    body = response.json()
    assert isinstance(body["detail"], str) and body["detail"], body
    return body


def test_a_caller_without_a_token_is_unauthenticated(db):
    assert error(client_for().get("/api/deliveries"), 401)["code"] == "unauthenticated"


def test_a_publish_to_a_queue_the_caller_may_not_use_is_forbidden(outsider, db_queue):
    r = client_for(outsider).post("/api/queues/db/messages", {"event": "x", "payload": 1}, format="json")
    assert error(r, 403)["code"] == "forbidden"


def test_an_unknown_queue_is_unknown_queue(logger):
    r = client_for(logger).get("/api/queues/nowhere/events")
    assert error(r, 404)["code"] == "unknown_queue"


def test_an_unknown_id_is_not_found(logger):
    assert error(client_for(logger).get("/api/messages/987654"), 404)["code"] == "not_found"


def test_a_path_that_names_nothing_is_not_found(db):
    assert error(client_for().get("/api/no-such-route"), 404)["code"] == "not_found"


def test_a_body_that_is_not_json_is_bad_json(logger):
    r = client_for(logger).generic(
        "POST", "/api/queues/db/messages", "{not json", content_type="application/json"
    )
    assert error(r, 400)["code"] == "bad_json"


def test_field_errors_keep_their_fields_beside_the_detail_and_code(logger):
    r = client_for(logger).post("/api/queues/db/messages", {"payload": 1}, format="json")
    body = error(r, 400)
    assert body["code"] == "bad_request"
    assert body["event"] and "event" in body["detail"]  # the field's own message, and words that name it


def test_a_settled_delivery_is_already_settled(owner, db_queue):
    publish(db_queue, 1)
    (delivery,) = ledger.lease_deliveries(owner, limit=1)
    ledger.ack_deliveries(owner, [delivery["id"]])
    r = client_for(owner).post(f"/api/deliveries/{delivery['id']}/nack", {}, format="json")
    assert error(r, 409)["code"] == "already_settled"


def test_a_wrong_method_is_method_not_allowed(logger):
    assert error(client_for(logger).delete("/api/deliveries"), 405)["code"] == "method_not_allowed"


def test_a_body_over_the_limit_is_payload_too_large(logger, settings):
    big = {"event": "x", "payload": "x" * (settings.MQ_MAX_BODY_BYTES + 1)}
    r = client_for(logger).post("/api/queues/db/messages", big, format="json")
    assert error(r, 413)["code"] == "payload_too_large"


@pytest.mark.django_db(transaction=True)
def test_a_throttled_caller_is_throttled(logger):
    with override_settings(MQ_THROTTLE_RATE="2/min"):
        client = client_for(logger)
        statuses = [client.get("/api/subscriptions").status_code for _ in range(4)]
        assert statuses[-1] == 429, statuses
        assert error(client.get("/api/subscriptions"), 429)["code"] == "throttled"


def test_a_subscription_to_a_queue_the_caller_may_not_use_is_forbidden(outsider, db_queue):
    r = client_for(outsider).post("/api/subscriptions", {"queue": "db"}, format="json")
    assert error(r, 403)["code"] == "forbidden"
    assert not Subscription.objects.exists()
