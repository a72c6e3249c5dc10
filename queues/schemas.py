"""Event schemas: a JSON Schema (draft 2020-12) per event, which every payload published under
that event must satisfy.

Two well-kept libraries, each for what it does best: jsonschema-rs (compiled Rust) answers
whether a payload is valid, in microseconds; python-jsonschema (the reference implementation,
which the OpenAPI tooling already brings) checks schemas when they are set and, for a payload
the first refuses, says where and why. python-jsonschema alone took 0.4 ms a payload for an
order of a dozen fields, more than a publish's whole budget for schemas (bench/schema_cost.py).
Where the two could disagree (a payload jsonschema-rs refuses and python-jsonschema finds no
fault in), python-jsonschema's word is taken: the payload is published.

Every publish asks for its events' schemas, so they are kept in the process (mqsite.rows.Kept),
absent ones too: the usual event has none, and a publish of it must cost nothing more. A schema
set, changed or cleared is an Event saved, which delivery.revocation announces to every process
(forget()); what no announcement told of (a queryset update) holds once the kept answer is
MQ_REVOCATION_CHECK_SECS old. An event made by a publish (bulk_create, no signal) never has a
schema, so a kept "none" stays true for it. Each schema is compiled once per process, by its
text (not by the event's id and schema_version: SQLite may give a deleted event's id again, and
the tests' databases do), so a forget() costs one small read, not a compile.
"""

import json
import logging
import threading

import jsonschema_rs
from django.db import connection, transaction
from django.utils import timezone
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema_specifications import REGISTRY as SPECIFICATIONS
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from mqsite import adb, rows
from mqsite.names import clean_name

from .models import Event

log = logging.getLogger(__name__)

# Bounds of a refusal's `errors`: enough to fix a payload by, never a payload's worth of words.
MAX_ERRORS = 20
MAX_MESSAGE_CHARS = 200

NONE = "none"  # kept for an event without a schema (Kept keeps no None)


class BadSchema(ValueError):
    """A schema that is not a valid draft 2020-12 JSON Schema (never stored)."""


def check_schema(schema):
    """Raise BadSchema, saying where and why, unless `schema` is a valid draft 2020-12 schema."""
    if not isinstance(schema, dict | bool):
        raise BadSchema("a JSON Schema is an object (or true or false)")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = _pointer(exc.absolute_path)
        words = _short(exc.message)
        raise BadSchema(f"not a valid JSON Schema (draft 2020-12) at '{where}': {words}") from None
    _check_refs(schema)


# Values that are data, not subschemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
BASE_URI = "urn:mq:event-schema"


def _check_refs(schema):
    """Refuse a $ref that leads nowhere: nothing is fetched, so only references within the
    schema (or to the JSON Schema metaschemas) resolve, and one that cannot would fail every
    publish. A schema with nested $ids is left to the check at publish (its bases change
    inside it)."""
    refs, nested_ids = [], []

    def walk(node, path):
        if isinstance(node, dict):
            if path and "$id" in node:
                nested_ids.append(path)
            if isinstance(node.get("$ref"), str):
                refs.append((node["$ref"], path))
            for k, v in node.items():
                if k not in _DATA_KEYWORDS:
                    walk(v, [*path, k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, [*path, i])

    walk(schema, [])
    if not refs or nested_ids or not isinstance(schema, dict):
        return
    base = schema.get("$id") if isinstance(schema.get("$id"), str) else BASE_URI
    # With the metaschemas, as the validator has them (a $ref to draft 2020-12's own resolves).
    registry = SPECIFICATIONS.with_resource(base, DRAFT202012.create_resource(schema))
    resolver = registry.resolver(base_uri=base)
    for ref, path in refs:
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise BadSchema(
                f"the $ref {_short(ref)!r} at '{_pointer(path)}' leads nowhere (only references "
                "within the schema resolve)"
            ) from None


def set_event_schema(queue, name, schema):
    """Give the event `name` of `queue` this schema (None: clear it), making the event if it
    does not exist yet. Checked first: an invalid schema raises BadSchema and nothing changes.
    Returns the Event. Announced to every process by its post_save (delivery.revocation).
    A name that breaks the naming rule raises mqsite.names.BadName."""
    name = clean_name(name, "event")
    if schema is not None:
        check_schema(schema)
    with transaction.atomic():
        event, _ = Event.objects.select_for_update().get_or_create(queue=queue, name=name)
        return save_schema(event, schema)


def save_schema(event, schema):
    """Store a checked schema on `event` (the admin's form and set_event_schema()), counting the
    change (schema_version, which the history and the catalog's readers can go by)."""
    event.schema = schema
    event.schema_version = (event.schema_version or 0) + 1
    event.schema_updated_at = timezone.now()
    event.save()
    return event


# --- at publish -----------------------------------------------------------------------------------

_kept = rows.Kept()  # (queue id, event name) -> (event id, version, validator) or NONE
_compiled = {}  # the schema's JSON text as stored -> Compiled
_compiled_lock = threading.Lock()
MAX_COMPILED = 1_000


def forget():
    """An event (or anything else) changed, here or in another process: ask again."""
    _kept.forget()


class Compiled:
    """One schema, compiled by both libraries (see the module's docstring)."""

    __slots__ = ("fast", "full")

    def __init__(self, schema):
        self.full = Draft202012Validator(schema)
        try:
            # offline: nothing is fetched (check_schema refuses a $ref that leads outside);
            # formats not checked, as python-jsonschema does not without a format checker.
            self.fast = jsonschema_rs.Draft202012Validator(schema, validate_formats=False, offline=True)
        except Exception:  # a schema it cannot compile (a regex it reads otherwise): the slow way
            log.warning("jsonschema-rs could not compile a schema; python-jsonschema alone checks it")
            self.fast = None

    def errors(self, payload):
        """payload_errors() of this schema."""
        if self.fast is not None and self.fast.is_valid(payload):
            return []
        return payload_errors(self.full, payload)


def validator_of(queue_id, name):
    """The compiled schema (Compiled) of the queue's event `name`, or None when it has no schema
    (or does not exist yet)."""
    key = (queue_id, name)
    kept, forgotten = _kept.kept(key)
    if kept is None:
        kept = _kept_value(adb.run_sync(_statement(queue_id, name)))
        _kept.keep(key, kept, forgotten)
    return None if kept is NONE else kept[2]


async def avalidator_of(queue_id, name):
    """validator_of() from the event loop (the async connection on a miss)."""
    key = (queue_id, name)
    kept, forgotten = _kept.kept(key)
    if kept is None:
        if adb.enabled():
            found = await adb.run(_statement(queue_id, name))
        else:
            found = await adb.thread(adb.run_sync)(_statement(queue_id, name))
        kept = _kept_value(found)
        _kept.keep(key, kept, forgotten)
    return None if kept is NONE else kept[2]


def _statement(queue_id, name):
    # The schema as text on both databases (jsonb's loader differs between the two drivers).
    cast = 'CAST("schema" AS text)' if connection.vendor != "postgresql" else '"schema"::text'
    rows_found = yield (
        f"SELECT id, schema_version, {cast} FROM {Event._meta.db_table} WHERE queue_id = %s AND name = %s",
        [queue_id, name],
    )
    return rows_found[0] if rows_found else None


def _kept_value(found):
    if found is None or found[2] is None:
        return NONE
    event_id, version, text = found
    validator = _compile(text)
    return NONE if validator is None else (event_id, version, validator)


def _compile(text):
    with _compiled_lock:
        validator = _compiled.get(text)
    if validator is None:
        schema = json.loads(text)
        if schema is None:  # a JSON null stored by hand: no schema
            return None
        validator = Compiled(schema)
        with _compiled_lock:
            if len(_compiled) >= MAX_COMPILED:
                _compiled.clear()
            _compiled[text] = validator
    return validator


def payload_errors(validator, payload):
    """The ways `payload` fails the schema, at most MAX_ERRORS, as [{"path": JSON pointer into
    the payload, "message"}]; [] when it satisfies it. Messages name the rule that failed,
    never the value found (a payload may hold what must not be echoed)."""
    found = []
    try:
        for error in validator.iter_errors(payload):
            found += _described(error)
            if len(found) >= MAX_ERRORS:
                break
    except Unresolvable as exc:
        words = f"the event's schema has a $ref that cannot be resolved: {exc.ref}"
        found.append({"path": "", "message": _short(words)})
    return found[:MAX_ERRORS]


def _described(error):
    """One jsonschema error as entries of `errors`, in words like ajv's (what JS users know)."""
    path, keyword, value = _pointer(error.absolute_path), error.validator, error.validator_value
    if keyword == "required" and isinstance(error.instance, dict):
        return [
            {"path": path, "message": _short(f"must have required property '{p}'")}
            for p in value
            if p not in error.instance
        ] or [{"path": path, "message": "must have its required properties"}]
    if keyword in ("additionalProperties", "unevaluatedProperties") and isinstance(error.instance, dict):
        # Each unexpected property by its own path (the name is in the path, as any key is).
        allowed = error.schema.get("properties", {}) if isinstance(error.schema, dict) else {}
        extra = [k for k in error.instance if k not in allowed] if keyword == "additionalProperties" else []
        if extra and value is False:
            words = f"is not allowed ({keyword})"
            return [{"path": _pointer([*error.absolute_path, k]), "message": words} for k in extra]
    return [{"path": path, "message": _short(_message(keyword, value))}]


_WORDS = {
    "minimum": "must be >= {}",
    "maximum": "must be <= {}",
    "exclusiveMinimum": "must be > {}",
    "exclusiveMaximum": "must be < {}",
    "multipleOf": "must be a multiple of {}",
    "minLength": "must have at least {} characters",
    "maxLength": "must have at most {} characters",
    "pattern": "must match the pattern {}",
    "format": "must be a valid {}",
    "minItems": "must have at least {} items",
    "maxItems": "must have at most {} items",
    "minProperties": "must have at least {} properties",
    "maxProperties": "must have at most {} properties",
    "minContains": "must contain at least {} matching items",
    "maxContains": "must contain at most {} matching items",
}


def _message(keyword, value):
    if keyword == "type":
        return "must be of type " + (" or ".join(value) if isinstance(value, list) else str(value))
    if keyword in _WORDS:
        return _WORDS[keyword].format(value)
    return {
        "enum": "must be one of the values the schema's enum allows",
        "const": "must equal the schema's const",
        "uniqueItems": "must not have duplicate items",
        "anyOf": "must match a schema in anyOf",
        "oneOf": "must match exactly one schema in oneOf",
        "not": "must not match the schema in not",
        "contains": "must contain an item that matches contains",
        "dependentRequired": "must have the properties dependentRequired names",
        "additionalProperties": "has a property additionalProperties refuses",
        "unevaluatedProperties": "has a property unevaluatedProperties refuses",
        "unevaluatedItems": "has an item unevaluatedItems refuses",
        "items": "has an item the schema's items refuses",
        "prefixItems": "has an item prefixItems refuses",
        "propertyNames": "has a property name propertyNames refuses",
        "if": "must match the schema in then or else",
        None: "is not allowed (the schema is false)",
        False: "is not allowed (the schema is false)",
    }.get(keyword, f"must satisfy {keyword}")


def _pointer(parts):
    """A JSON pointer (RFC 6901) of these keys and indexes: "" is the whole payload."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _short(text):
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"
