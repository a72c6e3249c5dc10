"""Event schemas (API.md, Extensions): a payload that fails its event's JSON Schema is refused
(`400` `schema_mismatch` with `errors`, an `error` frame on the socket), and a batch with one
such item publishes nothing."""

import pytest

from delivery import group_commit, publishing
from delivery.models import Delivery
from queues import schemas
from queues.models import Event, Message
from tests.conftest import client_for
from tests.support.rest import post_messages
from tests.support.sockets import connect, db, recv, send, setup

ORDER = {
    "type": "object",
    "required": ["id", "amount"],
    "properties": {"id": {"type": "integer"}, "amount": {"type": "number", "minimum": 0}},
    "additionalProperties": False,
}


@pytest.fixture
def order_schema(db_queue):
    return schemas.set_event_schema(db_queue, "create", ORDER)


def test_it_refuses_a_payload_that_fails_the_schema_and_writes_nothing(owner, peer, order_schema):
    r = post_messages(
        owner, {"event": "create", "payload": {"id": "seven", "amount": -1, "secret": "s3cr3t"}}
    )
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "schema_mismatch" and body["detail"]
    assert {(e["index"], e["path"]) for e in body["errors"]} == {(0, "/id"), (0, "/amount"), (0, "/secret")}
    assert all(set(e) == {"index", "path", "message"} for e in body["errors"])
    # The failures name the rule, never a value of the payload.
    assert "seven" not in r.content.decode() and "s3cr3t" not in r.content.decode()
    assert Message.objects.count() == 0 and Delivery.objects.count() == 0


def test_it_names_a_missing_required_property_at_its_object(owner, order_schema):
    r = post_messages(owner, {"event": "create", "payload": {"id": 1}})
    assert r.status_code == 400
    assert r.json()["errors"] == [{"index": 0, "path": "", "message": "must have required property 'amount'"}]


def test_a_payload_that_satisfies_the_schema_is_published(owner, order_schema):
    r = post_messages(owner, {"event": "create", "payload": {"id": 1, "amount": 2.5}})
    assert r.status_code == 201
    assert r.json()["deliveries"] == 1
    # Other events of the queue have no schema: anything goes.
    assert post_messages(owner, {"event": "delete", "payload": "anything"}).status_code == 201
    assert Message.objects.count() == 2


def test_a_batch_with_one_bad_item_publishes_nothing_and_names_the_item(owner, order_schema):
    good = {"event": "create", "payload": {"id": 1, "amount": 1}}
    bad = {"event": "create", "payload": {"id": 2}}
    r = post_messages(owner, {"messages": [good, {"event": "delete", "payload": 1}, bad, good]})
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "schema_mismatch"
    assert body["errors"] == [{"index": 2, "path": "", "message": "must have required property 'amount'"}]
    assert Message.objects.count() == 0 and Event.objects.filter(name="delete").count() == 0


def test_the_errors_are_bounded(owner, db_queue):
    schemas.set_event_schema(db_queue, "create", {"items": {"type": "string"}})
    r = post_messages(owner, {"messages": [{"event": "create", "payload": list(range(50))}] * 3})
    assert r.status_code == 400
    assert len(r.json()["errors"]) == schemas.MAX_ERRORS
    assert r.json()["errors"][0] == {"index": 0, "path": "/0", "message": "must be of type string"}


def test_a_cleared_schema_lets_any_payload_through(owner, db_queue, order_schema):
    assert post_messages(owner, {"event": "create", "payload": 1}).status_code == 400
    schemas.set_event_schema(db_queue, "create", None)
    assert post_messages(owner, {"event": "create", "payload": 1}).status_code == 201


def test_a_schema_change_holds_from_the_next_publish(owner, db_queue, order_schema):
    """The kept validator is forgotten at the change (delivery.revocation), not at its age."""
    assert post_messages(owner, {"event": "create", "payload": {"id": 1, "amount": 1}}).status_code == 201
    schemas.set_event_schema(db_queue, "create", {"type": "string"})
    r = post_messages(owner, {"event": "create", "payload": {"id": 1, "amount": 1}})
    assert r.status_code == 400 and r.json()["errors"][0]["message"] == "must be of type string"


def test_one_callers_bad_payload_fails_no_other_callers_publish_in_a_group_commit(db_queue, order_schema):
    """group_commit checks each caller's messages before they join a batch."""
    with pytest.raises(publishing.SchemaMismatch):
        group_commit.publish(db_queue, [publishing.prepare("create", {"id": 1})])
    [(answer, created)] = group_commit.publish(
        db_queue, [publishing.prepare("create", {"id": 1, "amount": 0})]
    )
    assert created and answer["seq"] == 1


def test_an_outgoing_made_from_text_is_checked_too(db_queue, order_schema):
    with pytest.raises(publishing.SchemaMismatch):
        publishing.publish(db_queue, [publishing.Outgoing("create", '{"id": 1}', None)])
    assert Message.objects.count() == 0


# --- the socket ---------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_socket_publish_that_fails_the_schema_gets_an_error_frame():
    queue, (_, token), _ = await setup()
    await db(schemas.set_event_schema, queue, "create", ORDER)
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": "db", "event": "create", "payload": {"id": "x"}, "ref": 1})
    await send(
        comm,
        {"type": "publish", "queue": "db", "event": "create", "payload": {"id": 1, "amount": 1}, "ref": 2},
    )
    bad_batch = [{"event": "create", "payload": {"id": 2, "amount": 1}}, {"event": "create", "payload": []}]
    await send(comm, {"type": "publish", "queue": "db", "messages": bad_batch, "ref": 3})
    answers = [await recv(comm) for _ in range(3)]
    # Answered in the order sent; the good frame between two bad ones is published.
    assert [a["ref"] for a in answers] == [1, 2, 3]
    assert answers[0]["type"] == "error" and answers[0]["code"] == "schema_mismatch"
    assert {e["path"] for e in answers[0]["errors"]} == {"", "/id"}
    assert answers[1]["type"] == "published" and answers[1]["seq"] == 1
    assert answers[2]["type"] == "error" and answers[2]["code"] == "schema_mismatch"
    assert answers[2]["errors"] == [{"index": 1, "path": "", "message": "must be of type object"}]
    assert await db(lambda: list(Message.objects.values_list("seq", flat=True))) == [1]
    await comm.disconnect()


# --- the event catalog --------------------------------------------------------------------------


def test_the_catalog_lists_the_queues_events_with_their_schemas(owner, db_queue, order_schema):
    assert post_messages(owner, {"event": "delete", "payload": 1}).status_code == 201
    r = client_for(owner).get("/api/queues/db/events")
    assert r.status_code == 200
    body = r.json()
    assert body["queue"] == "db"
    assert [(e["name"], e["schema"]) for e in body["events"]] == [("create", ORDER), ("delete", None)]
    assert body["events"][0]["schema_updated_at"] and body["events"][1]["schema_updated_at"] is None


@pytest.mark.parametrize(
    ("publish", "subscribe", "status"), [(("db",), (), 200), ((), ("db",), 200), ((), (), 404)]
)
def test_the_catalog_is_for_callers_that_may_publish_or_subscribe(
    make_subscriber, db_queue, order_schema, publish, subscribe, status
):
    caller = make_subscriber("caller", publish=publish, subscribe=subscribe)
    r = client_for(caller).get("/api/queues/db/events")
    assert r.status_code == status
    if status == 404:
        assert "schema" not in r.content.decode()


def test_the_catalog_is_an_operators_and_nobody_elses(operator_client, db_queue, order_schema):
    assert operator_client.get("/api/queues/db/events").json()["events"][0]["schema"] == ORDER
    assert operator_client.get("/api/queues/nowhere/events").status_code == 404
    assert client_for(None).get("/api/queues/db/events").status_code == 401
