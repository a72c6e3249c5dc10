"""Setting an event's schema (API.md, Extensions, Event schemas): `manage.py eventschema` and the
admin's event form, both refusing a schema that is not valid draft 2020-12 JSON Schema."""

import io
import json

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.urls import reverse

from queues import schemas
from queues.models import Event, Message
from tests.support.rest import post_messages

SCHEMA = {"type": "object", "required": ["id"]}


def eventschema(*args, stdin=None):
    out = io.StringIO()
    call_command("eventschema", *args, stdout=out, **({"stdin": io.StringIO(stdin)} if stdin else {}))
    return out.getvalue()


def test_the_command_sets_a_schema_from_a_file_making_the_event(owner, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert "set the schema of db/create" in eventschema("db", "CREATE", str(path))
    assert Event.objects.get(name="create").schema == SCHEMA
    assert post_messages(owner, {"event": "create", "payload": {}}).status_code == 400
    assert post_messages(owner, {"event": "create", "payload": {"id": 1}}).status_code == 201


def test_the_command_reads_stdin_and_clears(owner):
    eventschema("db", "create", "-", stdin=json.dumps(SCHEMA))
    assert post_messages(owner, {"event": "create", "payload": 1}).status_code == 400
    assert "cleared the schema of db/create" in eventschema("db", "create", "--clear")
    assert Event.objects.get(name="create").schema is None
    assert post_messages(owner, {"event": "create", "payload": 1}).status_code == 201


@pytest.mark.parametrize(
    ("stdin", "words"),
    [
        ('{"type": "nothing"}', "not a valid JSON Schema (draft 2020-12) at '/type'"),
        ('{"minLength": -1}', "at '/minLength'"),
        ("[1]", "a JSON Schema is an object"),
        ('{"properties": {"a": {"$ref": "#/$defs/nope"}}}', "leads nowhere"),
        ('{"$ref": "https://example.com/remote.json"}', "leads nowhere"),
        ("{", "not JSON"),
    ],
)
def test_the_command_refuses_an_invalid_schema_and_stores_nothing(db_queue, stdin, words):
    Event.objects.create(queue=db_queue, name="create")
    with pytest.raises(CommandError, match=words.replace("(", r"\(").replace(")", r"\)")):
        eventschema("db", "create", "-", stdin=stdin)
    assert Event.objects.get(name="create").schema is None


def test_a_schema_may_refer_within_itself(owner):
    schema = {"$defs": {"id": {"type": "integer"}}, "properties": {"id": {"$ref": "#/$defs/id"}}}
    eventschema("db", "create", "-", stdin=json.dumps(schema))
    r = post_messages(owner, {"event": "create", "payload": {"id": "x"}})
    assert r.status_code == 400 and r.json()["errors"][0]["path"] == "/id"


def test_the_command_needs_a_queue_and_one_of_file_or_clear(db_queue):
    with pytest.raises(CommandError, match="no queue named"):
        eventschema("nowhere", "create", "--clear")
    with pytest.raises(CommandError, match="either FILE"):
        eventschema("db", "create")


def test_the_publish_command_says_why_a_payload_is_refused(db_queue):
    eventschema("db", "create", "-", stdin=json.dumps(SCHEMA))
    with pytest.raises(CommandError, match="must have required property 'id'"):
        call_command("publish", "db", "create", "{}", stdout=io.StringIO())


# --- the admin ----------------------------------------------------------------------------------


def test_the_admin_sets_a_schema_in_the_event_form_and_records_it(staff, owner, db_queue):
    event = Event.objects.create(queue=db_queue, name="create")
    url = reverse("admin:queues_event_change", args=[event.pk])
    r = staff.post(url, {"schema": json.dumps(SCHEMA)})
    assert r.status_code == 302, r.content.decode()[:2000]
    event.refresh_from_db()
    assert event.schema == SCHEMA and event.schema_version == 1 and event.schema_updated_at
    assert LogEntry.objects.filter(object_id=str(event.pk), change_message__contains="schema").exists()
    assert post_messages(owner, {"event": "create", "payload": {}}).status_code == 400
    # Emptied: no schema.
    assert staff.post(url, {"schema": ""}).status_code == 302
    event.refresh_from_db()
    assert event.schema is None and event.schema_version == 2
    assert post_messages(owner, {"event": "create", "payload": {}}).status_code == 201


def test_the_admin_refuses_an_invalid_schema(staff, db_queue):
    event = Event.objects.create(queue=db_queue, name="create")
    r = staff.post(reverse("admin:queues_event_change", args=[event.pk]), {"schema": '{"type": 5}'})
    assert r.status_code == 200
    assert "not a valid JSON Schema (draft 2020-12) at &#x27;/type&#x27;" in r.content.decode()
    event.refresh_from_db()
    assert event.schema is None and event.schema_version == 0


def test_the_admins_test_publish_says_which_field_fails_the_schema(staff, db_queue):
    schemas.set_event_schema(db_queue, "create", SCHEMA)
    r = staff.post(reverse("mq-publish"), {"queue": db_queue.pk, "event": "create", "payload": '{"name": 1}'})
    assert r.status_code == 200
    assert "(the payload): must have required property &#x27;id&#x27;" in r.content.decode()
    assert not Message.objects.exists()
