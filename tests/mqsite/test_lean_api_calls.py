"""What a bearer-token API call costs (issue 15, item 3): no session, CSRF or messages
middleware, and the subscriber and the queue kept by the process, so that a publish makes no
lookup of either; while the admin and the browsable API keep their session and CSRF check."""

import pytest
from django.test import Client

from mqsite import rows
from queues import lookup
from queues.models import Message, Queue
from subscribers import auth

pytestmark = pytest.mark.django_db

BODY = '{"event": "create", "payload": 1}'


def test_a_bearer_call_needs_no_csrf_token_and_sets_no_cookie(logger, operator):
    # A browser-like client that enforces CSRF and carries a staff session as well.
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    answer = client.post(
        "/api/queues/db/messages",
        BODY,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {logger.token}",
    )
    assert answer.status_code == 201
    assert answer.cookies == {}
    # It acted as the subscriber, not as the operator whose session it carried.
    assert Message.objects.get().publisher == logger


def test_a_session_post_without_a_csrf_token_is_still_refused(operator, db_queue):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    answer = client.post("/api/queues/db/messages", BODY, content_type="application/json")
    assert answer.status_code == 403
    assert "CSRF" in answer.json()["detail"]
    assert not Message.objects.exists()

    # With the token from the session's cookie, the same operator publishes.
    client.get("/admin/")
    token = client.cookies["csrftoken"].value
    answer = client.post(
        "/api/queues/db/messages", BODY, content_type="application/json", HTTP_X_CSRFTOKEN=token
    )
    assert answer.status_code == 201


def test_the_admin_keeps_its_session_and_csrf_check(operator):
    client = Client(enforce_csrf_checks=True)
    # A bearer header does not take the admin's middleware away (only /api/ calls skip it).
    answer = client.post(
        "/admin/login/", {"username": "op", "password": "op-password-1"}, HTTP_AUTHORIZATION="Bearer x"
    )
    assert answer.status_code == 403  # no CSRF token
    client.get("/admin/login/")
    answer = client.post(
        "/admin/login/",
        {
            "username": "op",
            "password": "op-password-1",
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
    )
    assert answer.status_code == 302 and "sessionid" in answer.cookies


def test_a_publish_looks_up_neither_its_subscriber_nor_its_queue_twice(
    logger, db_queue, django_assert_max_num_queries
):
    client = Client()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {logger.token}"}
    assert (
        client.post("/api/queues/db/messages", BODY, content_type="application/json", **headers).status_code
        == 201
    )
    with django_assert_max_num_queries(50) as second:
        client.post("/api/queues/db/messages", BODY, content_type="application/json", **headers)
    sql = [q["sql"] for q in second.captured_queries]
    assert [q for q in sql if "WHERE token_hash =" in q or "queues_queue WHERE name =" in q] == []


def test_a_change_is_seen_by_the_next_lookup(logger, db_queue):
    assert auth.subscriber_for_token(logger.token) is not None
    assert lookup.find_queue("db").ordered is False
    db_queue.ordered = True
    db_queue.save()
    assert lookup.find_queue("db").ordered is True
    logger.is_active = False
    logger.save()
    assert auth.subscriber_for_token(logger.token) is None


def test_kept_rows_are_instances_of_their_own(logger):
    a = auth.subscriber_for_token(logger.token)
    a.name = "changed here"
    assert auth.subscriber_for_token(logger.token).name == "logger"


def test_a_lookup_that_raced_a_forget_is_not_kept(db_queue):
    kept = rows.Cached(Queue, "name = %s")
    real = rows._first_values

    def read_then_changed(*args):
        values = real(*args)  # the row as it was...
        kept.forget()  # ...and a change announced before the lookup could keep it
        return values

    rows._first_values = read_then_changed
    try:
        assert kept.first("db").pk == db_queue.pk
    finally:
        rows._first_values = real
    assert kept._rows == {}
    kept.first("db")
    assert list(kept._rows) == ["db"]
