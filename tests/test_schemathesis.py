"""Schemathesis against /api/schema/, with a real subscriber's token: every operation, with data
the schema allows and data it forbids. No server error; every answer is one the schema
describes (status, content type, body); what the schema forbids is refused with a 4xx."""

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings

from queues import publishing
from queues.names import INPUT_RE
from subscribers import subscribing


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
    if path_parameters and isinstance(path_parameters.get("id"), int) and hash(str(path_parameters)) % 3:
        path_parameters["id"] = abs(path_parameters["id"]) % 40 + 1
    return path_parameters


# In process (WSGI): the schema view needs no database, so it loads at import.
schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
schema.hook(map_query)
schema.hook(map_path_parameters)


@pytest.fixture(autouse=True)
def keep_the_test_connection(db):
    """In process, inside the test's transaction: as Django's test client does, keep the
    request signals from closing the test's database connection."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def owner(logger, db_queue):
    """The logger, subscribed to db, with deliveries waiting and some in flight: the ids the
    operations take exist, some of them the caller's."""
    subscribing.subscribe(logger, db_queue)
    publishing.publish(db_queue, [publishing.prepare("create", {"n": i}) for i in range(20)])
    return logger


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_answers_as_its_schema_says(case, owner):
    case.call_and_validate(headers={"Authorization": f"Bearer {owner.token}"})
