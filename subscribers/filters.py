"""Subscription filters: which messages a subscription is owed, by the values of their
headers and payload fields (the API's Extensions, "Filters").

A filter is checked once, here, when it is set, and stored twice: as given (normalized) on the
subscription, for the answers, and as one FilterClause row per key, for the database. It is
never evaluated in Python: the fan-out statement (delivery.ledger) and the route
(delivery.routing) evaluate the clauses in SQL, with the pieces written below, so that a publish
stays one statement whose text is the same whatever filters exist (it is prepared on
PostgreSQL), and an unfiltered subscription costs one `filter IS NULL` more.

The rule: a message matches when, for every key, the value found there equals one of the
listed values as JSON values do (1 equals 1.0, true is not 1, "1" is not 1); a key that is
absent from the message (or holds JSON null) matches only where null is listed. A path goes
into objects only: an array or a scalar on the way leaves the key absent.
"""

import json
import math
import re

from django.db import connection, transaction

from mqsite.service_errors import ServiceError
from mqsite.values import storable_text
from queues.headers import NAME_HELP as HEADER_NAME_HELP
from queues.headers import NAME_RE as HEADER_NAME_RE

MAX_KEYS = 16
MAX_DEPTH = 4  # payload fields, nested
MAX_VALUES = 64
MAX_FIELD_CHARS = 128
MAX_TEXT_CHARS = 1024  # one allowed text value

PAYLOAD, HEADERS = "payload", "headers"
# What a payload field may not hold (a regex class): a quote or a backslash would need an
# escape in the JSON path, and control characters are refused as in names.
FIELD_FORBIDDEN = r'"\\\x00-\x1f\x7f-\x9f'

# The JSON schema of a filter, for OpenAPI and the AsyncAPI document.
FILTER_SCHEMA = {
    # OpenAPI 3.0, read as JSON Schema draft 4 (as Schemathesis and validators read it): the key
    # rule as patternProperties with no other key allowed (propertyNames would need draft 6),
    # bounds with boolean exclusives; the field's allow_null makes it nullable.
    "type": "object",
    "maxProperties": MAX_KEYS,
    "patternProperties": {
        rf"^(headers\.[A-Za-z0-9_.-]{{1,64}}|payload(\.[^.{FIELD_FORBIDDEN}]{{1,128}}){{1,{MAX_DEPTH}}})$": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_VALUES,
            "items": {
                "nullable": True,
                "anyOf": [
                    {"type": "string", "maxLength": MAX_TEXT_CHARS, "pattern": "^[^\\u0000]*$"},
                    {
                        "type": "number",
                        "minimum": -(2**63),
                        "maximum": 2**63,
                        "exclusiveMinimum": True,
                        "exclusiveMaximum": True,
                    },
                    {"type": "boolean"},
                ],
            },
        }
    },
    "additionalProperties": False,
    "description": f"At most {MAX_KEYS} keys, each `headers.<name>` or `payload.<field>[.<field>...]` "
    f"(at most {MAX_DEPTH} fields), each naming 1 to {MAX_VALUES} allowed values (strings, numbers, "
    "booleans, null). A message matches when every key's value equals one of its values; an absent "
    "key matches only where null is listed. Null or {}: no filter.",
}


class BadFilter(ServiceError):
    """A filter that breaks a rule: a 400 (`bad_filter`) whose words name the key."""

    status_code = 400
    code = "bad_filter"

    def __init__(self, key, words):
        self.key = key
        super().__init__(f"filter key {key!r}: {words}" if key is not None else f"filter: {words}")


def check_filter(value):
    """The filter as stored (keys in the order given, each with its list of values), or None
    for no filter (null, or an empty object). BadFilter says what is wrong, naming the key."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadFilter(None, "must be an object of keys to lists of allowed values, or null")
    if not value:
        return None
    checked = {}
    for n, (key, allowed) in enumerate(value.items(), start=1):
        if n > MAX_KEYS:
            raise BadFilter(key, f"a filter has at most {MAX_KEYS} keys")
        _source_and_path(key)
        checked[key] = _allowed(key, allowed)
    return checked


def _source_and_path(key):
    """(PAYLOAD or HEADERS, the JSON path of the key inside it) of a key: `headers.<name>` or
    `payload.<field>[.<field>...]`. The path, `$."a"."b"`, is one both databases read alike
    (SQLite's json functions; PostgreSQL's jsonpath, run strict): its fields hold no quote or
    backslash, so need no escape."""
    if not isinstance(key, str):
        raise BadFilter(str(key), "keys are text")
    source, dot, rest = key.partition(".")
    if source == HEADERS and dot:
        if not HEADER_NAME_RE.match(rest):
            raise BadFilter(key, HEADER_NAME_HELP)
        return HEADERS, f'$."{rest}"'
    if source == PAYLOAD and dot:
        fields = rest.split(".")
        if len(fields) > MAX_DEPTH:
            raise BadFilter(key, f"at most {MAX_DEPTH} levels into the payload")
        for field in fields:
            if not field or len(field) > MAX_FIELD_CHARS:
                raise BadFilter(key, f"each payload field is 1 to {MAX_FIELD_CHARS} characters")
            if re.search(f"[{FIELD_FORBIDDEN}]", field) or not storable_text(field):
                raise BadFilter(
                    key, "a payload field may not hold a quote, a backslash or a control character"
                )
        return PAYLOAD, "$" + "".join(f'."{f}"' for f in fields)
    raise BadFilter(key, 'keys are "headers.<name>" or "payload.<field>[.<field>...]"')


def _allowed(key, allowed):
    if not isinstance(allowed, list) or not allowed:
        raise BadFilter(key, "must name a list of 1 or more allowed values")
    if len(allowed) > MAX_VALUES:
        raise BadFilter(key, f"at most {MAX_VALUES} allowed values")
    for value in allowed:
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            # Beyond 2**63 SQLite reads an integer as a float: equal where PostgreSQL is not.
            if not (isinstance(value, int) or math.isfinite(value)) or not -(2**63) < value < 2**63:
                raise BadFilter(key, "numbers must be finite, and under 2**63 either way")
            continue
        if isinstance(value, str):
            if len(value) > MAX_TEXT_CHARS or not storable_text(value):
                raise BadFilter(key, f"text values are at most {MAX_TEXT_CHARS} characters, without NUL")
            continue
        raise BadFilter(
            key, f"allowed values are strings, numbers, booleans or null, not {_json_kind(value)}"
        )
    return list(allowed)


def _json_kind(value):
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def clauses_of(checked):
    """[(key, source, path, allowed)] of a checked filter, as FilterClause rows hold them."""
    return [(key, *_source_and_path(key), allowed) for key, allowed in (checked or {}).items()]


def set_filter(subscription, checked):
    """Store a checked filter (check_filter) on the subscription, replacing its clauses, in one
    transaction: publishes committed after it are owed by the new filter, those before by the
    old one (the subscription's deliveries already made stay)."""
    from .models import FilterClause, Subscription

    with transaction.atomic():
        FilterClause.objects.filter(subscription=subscription).delete()
        FilterClause.objects.bulk_create(
            FilterClause(subscription=subscription, key=key, source=source, path=path, allowed=allowed)
            for key, source, path, allowed in clauses_of(checked)
        )
        Subscription.objects.filter(pk=subscription.pk).update(filter=checked)
    subscription.filter = checked


# --- the rule in SQL: one spelling, for the fan-out, the replay and the route -------------------


def filter_source(messages, where):
    """A FROM item `m` of the messages `messages` (aliased m, with queue_id, payload_json and
    headers_json) where `where` holds, carrying what filter_holds() reads (the caller's
    parameters for `where` go here, at its place in the statement).

    PostgreSQL: each message's payload and headers are parsed into jsonb once per message (an
    OFFSET 0 subquery is not flattened into the join, so the parse is not redone per
    subscription row), and only when its queue has a filtered subscription (a probe of the
    partial index subscription_filtered): a queue without filters parses nothing. SQLite reads
    the JSON text where it is needed (its json functions keep recent parses).

    jsonb refuses the escape \\u0000 that a payload's JSON text may hold (a NUL in a string,
    which the text keeps as sent): the filters read it as U+FFFD instead, so that such a
    payload is published like any other (no allowed value holds a NUL, so it matched none)."""
    if connection.vendor != "postgresql":
        return f"(SELECT m.* FROM {messages} WHERE {where}) m"
    from .models import Subscription

    return f"""(SELECT m.*, CASE WHEN EXISTS (
                SELECT 1 FROM {Subscription._meta.db_table} f
                WHERE f.queue_id = m.queue_id AND f.filter IS NOT NULL
            ) THEN jsonb_build_object(
                '{PAYLOAD}', CAST(replace(m.payload_json, '\\u0000', '\\ufffd') AS jsonb),
                '{HEADERS}', CAST(m.headers_json AS jsonb)) END AS filter_docs
            FROM {messages} WHERE {where} OFFSET 0) m"""


def clause_holds(c, m="m"):
    """SQL: the clause `c` (a FilterClause row) holds for message `m` (of filter_source()).
    Never NULL: a NOT of it must not read as true."""
    if connection.vendor == "postgresql":
        # jsonb equality is JSON's (1 = 1.0, true <> 1); an absent key is SQL NULL, which
        # jsonb_build_array makes a JSON null, found only where null is listed.
        return f"""COALESCE({c}.allowed @> jsonb_build_array({_found_pg(c, m)}), FALSE)"""
    doc = _doc_sqlite(c, m)
    kind = f"json_type({doc}, {c}.path)"
    value = f"json_extract({doc}, {c}.path)"
    # json_extract makes true 1 and loses the kind: compare kinds first, then values (numbers
    # as numbers, so 1 = 1.0). Absent (no kind at all) is null. A text holding a NUL comes out
    # of json_extract cut at the NUL ("a\u0000" would equal "a"): its JSON text, which keeps
    # the escape, rules it out (no allowed value holds a NUL).
    return f"""EXISTS (SELECT 1 FROM json_each({c}.allowed) a WHERE CASE a.type
            WHEN 'null' THEN COALESCE({kind}, 'null') = 'null'
            WHEN 'true' THEN {kind} = 'true'
            WHEN 'false' THEN {kind} = 'false'
            WHEN 'text' THEN {kind} = 'text' AND {value} = a.atom AND instr({doc} -> {c}.path, '\\u0000') = 0
            ELSE {kind} IN ('integer', 'real') AND {value} = a.atom END)"""


def filter_holds(s, m="m"):
    """SQL: subscription `s` (with id and filter) is owed message `m` as far as its filter goes:
    it has none (the one test an unfiltered subscription pays), or every clause holds."""
    from .models import FilterClause

    return f"""({s}.filter IS NULL OR NOT EXISTS (
            SELECT 1 FROM {FilterClause._meta.db_table} c
            WHERE c.subscription_id = {s}.id AND NOT {clause_holds("c", m)}))"""


def found_value(c, m="m"):
    """SQL: the JSON text of the value clause `c` found in message `m`, NULL when absent (for
    the words of the route's reasons)."""
    if connection.vendor == "postgresql":
        return f"CAST({_found_pg(c, m)} AS text)"
    return f"({_doc_sqlite(c, m)} -> {c}.path)"


def _found_pg(c, m):
    # strict: a member accessor on an array or a scalar is an error (silenced: NULL), where lax
    # would look inside arrays, which SQLite's path does not.
    return f"""jsonb_path_query_first({m}.filter_docs -> {c}.source,
            CAST('strict ' || {c}.path AS jsonpath), '{{}}', TRUE)"""


def _doc_sqlite(c, m):
    return f"CASE {c}.source WHEN '{HEADERS}' THEN {m}.headers_json ELSE {m}.payload_json END"


def as_json(value):
    """A filter as the text an admin form shows."""
    return json.dumps(value, ensure_ascii=False, indent=2) if value is not None else ""
