"""Event schemas across processes (issue 29): two real Daphne processes on one Redis and the
test database. Each keeps what it learnt of an event's schema (queues.schemas); a schema set,
changed or cleared in a third process (this one, as the eventschema command or the admin would)
holds in both from their next publish, by REST and by socket.

The servers keep what they learnt for 30 s here (MQ_REVOCATION_CHECK_SECS), so what makes them
look again in time is the announcement over Redis."""

import json
import urllib.error
import urllib.request

import pytest
from websockets.sync.client import connect

from queues import schemas
from queues.models import Message
from subscribers.provisioning import create_subscriber
from tests.support.personas import subscribed_owner
from tests.support.servers import E2E_REDIS as REDIS
from tests.support.servers import separate_daphnes

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def servers():
    with separate_daphnes(2, {"REDIS_URL": REDIS, "MQ_REVOCATION_CHECK_SECS": "30"}) as started:
        yield started


def post(server, token, payload):
    """A REST publish of `payload` under db/create: (status, body)."""
    req = urllib.request.Request(
        f"{server.http}/api/queues/db/messages",
        data=json.dumps({"event": "create", "payload": payload}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def socket_publish(ws, payload, ref):
    ws.send(json.dumps({"type": "publish", "queue": "db", "event": "create", "payload": payload, "ref": ref}))
    return json.loads(ws.recv(timeout=5))


def test_a_schema_set_changed_and_cleared_elsewhere_holds_in_both_processes_at_once(servers, announcing):
    queue, *_ = subscribed_owner()
    _, token = create_subscriber("publisher", publish=["db"])  # subscribed to nothing: only answers come
    with (
        connect(f"{servers[0].ws}?token={token}", close_timeout=1) as ws0,
        connect(f"{servers[1].ws}?token={token}", close_timeout=1) as ws1,
    ):
        # Each process learns that the event has no schema, and keeps it.
        for s in servers:
            assert post(s, token, {})[0] == 201
        assert socket_publish(ws0, {}, 1)["type"] == "published"
        assert socket_publish(ws1, {}, 2)["type"] == "published"

        schemas.set_event_schema(queue, "create", {"type": "object", "required": ["id"]})
        for s in servers:
            status, body = post(s, token, {})
            assert status == 400 and body["code"] == "schema_mismatch"
            assert body["errors"] == [{"index": 0, "path": "", "message": "must have required property 'id'"}]
            assert post(s, token, {"id": 1})[0] == 201
        for ws, ref in ((ws0, 3), (ws1, 4)):
            refused = socket_publish(ws, {}, ref)
            assert (
                refused["type"] == "error" and refused["code"] == "schema_mismatch" and refused["ref"] == ref
            )

        schemas.set_event_schema(queue, "create", {"properties": {"id": {"type": "string"}}})
        for s in servers:
            status, body = post(s, token, {"id": 1})
            assert status == 400 and body["errors"][0]["path"] == "/id"

        schemas.set_event_schema(queue, "create", None)
        for s in servers:
            assert post(s, token, {"id": 1})[0] == 201
        assert socket_publish(ws0, 1, 5)["type"] == "published"
        assert socket_publish(ws1, 1, 6)["type"] == "published"
    # 2 + 2 before the schema, 2 that satisfied it, 2 + 2 after it was cleared.
    assert Message.objects.count() == 10
