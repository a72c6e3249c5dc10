"""Schemathesis against /api/schema/, with a real subscriber's token: every operation, with data
the schema allows and data it forbids. No server error; every answer is one the schema
describes (status, content type, body); what the schema forbids is refused with a 4xx; and what
the schema allows is accepted (issue 14: the schema says whatever the server refuses)."""

import json
import re
from datetime import UTC, datetime, timedelta

import jsonschema
import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance, status_code_conformance

from delivery import publishing
from mqsite.names import INPUT_RE
from tests.conftest import client_for


def map_query(ctx, query):
    # A long poll in range waits at most a moment: the test is about answers, not waiting.
    wait = query.get("wait") if query else None
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 < wait <= 30:
        query["wait"] = min(wait, 0.05)
    return query


def map_path_parameters(ctx, path_parameters):
    # Often the queue that exists and small ids that do, so that answers other than 404 come.
    # Only a name the schema allows becomes "db": one that breaks the pattern is negative data,
    # which must stay as generated and be refused.
    queue = (path_parameters or {}).get("queue")
    if isinstance(queue, str) and INPUT_RE.match(queue) and hash(str(path_parameters)) % 2:
        path_parameters["queue"] = "db"
    # Likewise only an id the schema allows (1 to bigint's top): one outside is negative data.
    id_ = (path_parameters or {}).get("id")
    if isinstance(id_, int) and 1 <= id_ <= 2**63 - 1 and hash(str(path_parameters)) % 3:
        path_parameters["id"] = id_ % 40 + 1
    return path_parameters


# RFC 3339's date-time, the schema's format: only such a string is given another time below; one
# that breaks the format is negative data, which must stay as generated and be refused.
DATE_TIME = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")


def map_body(ctx, body):
    # A message's deliver_at and expires_at are bounded by the clock (at most 7 days ahead; an
    # expiry after the message falls due, at most a year after), which no schema can state:
    # a time the schema allows becomes one the clock allows too, as `wait` above gets a short one.
    messages = body.get("messages") if isinstance(body, dict) else None
    now = datetime.now(UTC)
    for message in messages if isinstance(messages, list) else [body]:
        if not isinstance(message, dict):
            continue
        for field, at in (
            ("deliver_at", now + timedelta(minutes=1)),
            ("expires_at", now + timedelta(days=8)),
        ):
            value = message.get(field)
            if isinstance(value, str) and len(value) <= 64 and DATE_TIME.fullmatch(value):
                message[field] = at.isoformat()
    return body


# In process (WSGI): the schema view needs no database, so it loads at import.
schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
schema.hook(map_query)
schema.hook(map_path_parameters)
schema.hook(map_body)


@pytest.fixture(autouse=True)
def keep_the_test_connection(db):
    """In process, inside the test's transaction: as Django's test client does, keep the
    request signals from closing the test's database connection."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture(autouse=True)
def many_failed_tokens(settings):
    """Schemathesis sends a bad token to every operation, many times a minute from one address:
    past MQ_AUTH_FAILURES_PER_MINUTE those are 429s (tests/mqsite/test_attacks.py checks that), where
    this test checks that each is a 401."""
    settings.MQ_AUTH_FAILURES_PER_MINUTE = 1_000_000


@pytest.fixture
def owner_with_backlog(owner, db_queue):
    """The logger, subscribed to db, with deliveries waiting and some in flight: the ids the
    operations take exist, some of them the caller's."""
    publishing.publish(db_queue, [publishing.prepare("create", {"n": i}) for i in range(20)])
    return owner


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_answers_as_its_schema_says(case, owner_with_backlog):
    case.call_and_validate(headers={"Authorization": f"Bearer {owner_with_backlog.token}"})


# Only data the schema allows, and the check that such data is accepted: whatever the server
# refuses, the schema must say (issue 14). A 4xx is fine only where it is about who calls or what
# exists (401, 403, 404, 409, 429), never about the request's shape.
positive = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
positive.config.generation.update(modes=[GenerationMode.POSITIVE], allow_x00=True)
positive.hook(map_query)
positive.hook(map_path_parameters)
positive.hook(map_body)


@positive.parametrize()
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_request_the_schema_allows_is_accepted(case, owner_with_backlog):
    case.call_and_validate(
        headers={"Authorization": f"Bearer {owner_with_backlog.token}"},
        checks=[not_a_server_error, status_code_conformance, positive_data_acceptance],
    )


# Bodies the server refuses for their shape that the schema allowed before issue 14: each must
# now be forbidden by the schema too (checked with a JSON Schema validator, not by chance).
REFUSED = [
    ("/api/deliveries/{id}/nack", {"error": "a\x00b"}),
    ("/api/queues/{queue}/messages", {"event": "create", "payload": 1, "key": "k\x00"}),
    ("/api/queues/{queue}/messages", {"messages": [{"event": "create", "payload": 1}], "key": "k"}),
    ("/api/queues/{queue}/messages", {"event": "create", "payload": 1, "messages": 5}),
]
REFUSED += [
    (
        "/api/queues/{queue}/messages",
        {"event": "create", "payload": 1, "delay_secs": 5, "deliver_at": "2030-01-01"},
    ),
    (
        "/api/queues/{queue}/messages",
        {"event": "create", "payload": 1, "ttl_secs": 5, "expires_at": "2030-01-01"},
    ),
    ("/api/queues/{queue}/messages", {"event": "create", "payload": 1, "ttl_secs": 0}),
    ("/api/queues/{queue}/messages", {"messages": [{"event": "create", "payload": 1}], "delay_secs": 5}),
]
ACCEPTED = [
    ("/api/deliveries/{id}/nack", {"error": "caf\u00e9 \U0001f600"}),
    ("/api/queues/{queue}/messages", {"event": "create", "payload": 1, "key": "\U0001f600", "extra": 1}),
    ("/api/queues/{queue}/messages", {"messages": [{"event": "create", "payload": 1}], "extra": 1}),
    ("/api/queues/{queue}/messages", {"event": "create", "payload": 1, "delay_secs": 5, "ttl_secs": 60}),
    ("/api/queues/{queue}/messages", {"messages": [{"event": "create", "payload": 1, "ttl_secs": 0.5}]}),
]


def body_validator(path):
    document = positive.raw_schema
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft4Validator({**body, "components": document["components"]})


@pytest.mark.parametrize(("path", "body"), REFUSED)
def test_what_the_server_refuses_for_its_shape_the_schema_forbids(owner_with_backlog, path, body):
    assert not body_validator(path).is_valid(body)
    url = path.format(id=owner_with_backlog.deliveries.values_list("pk", flat=True).first(), queue="db")
    r = client_for(owner_with_backlog).generic("POST", url, json.dumps(body), content_type="application/json")
    assert r.status_code == 400, r.content


@pytest.mark.parametrize(("path", "body"), ACCEPTED)
def test_what_the_schema_allows_the_server_accepts(owner_with_backlog, path, body):
    assert body_validator(path).is_valid(body)
    url = path.format(id=owner_with_backlog.deliveries.values_list("pk", flat=True).first(), queue="db")
    r = client_for(owner_with_backlog).generic("POST", url, json.dumps(body), content_type="application/json")
    assert r.status_code in (200, 201), r.content


def test_path_ids_are_bigint_in_the_schema():
    for path in ("/api/deliveries/{id}/nack", "/api/subscriptions/{id}"):
        ops = positive.raw_schema["paths"][path]
        (param,) = next(iter(ops.values()))["parameters"]
        assert param["schema"]["minimum"] == 1 and param["schema"]["maximum"] == 2**63 - 1


def test_a_blank_error_is_allowed_by_the_schema_as_by_the_server(owner_with_backlog):
    # "" matches both the pattern and the "blank" alternative drf-spectacular adds: with `oneOf`
    # the schema refused what the server accepts.
    path = "/api/deliveries/{id}/nack"
    assert body_validator(path).is_valid({"error": ""})
    assert body_validator(path).is_valid({"error": "x", "other\x00": 1})
