"""Replay: where a subscription starts owing its queue's messages (API.md, Extensions).

A subscription owes, by default, what is published after it is made ("new"). Made with
`"from"` (`"all"`, `{"seq": N}`, `{"time": "<ISO 8601>"}`), or sought back later
(POST /api/subscriptions/{id}/seek), it also owes every message of its queue (and event) from
that point that is still in the hot tables. This module reads and checks such a point, the
same way for REST, the socket, `listen --from` and the admin; delivery.ledger.replay() makes
the deliveries owed.
"""

from datetime import UTC, datetime
from typing import NamedTuple

from mqsite import values
from mqsite.values import BIGINT_MAX, iso_time

NEW, ALL, SEQ, TIME = "new", "all", "seq", "time"
MAX_TIME_CHARS = values.MAX_TIME_CHARS
SHAPES = '"new", "all", {"seq": N} or {"time": "<ISO 8601>"}'

# What `from` may be, in the schema (drf-spectacular): the server refuses anything else, so
# the schema forbids it too (tests/mqsite/test_schemathesis.py). The objects are closed: {"seq": 1,
# "time": ...} would be ambiguous, and is refused.
SEQ_SCHEMA = {
    "type": "object",
    "properties": {
        "seq": {
            "type": "integer",
            "format": "int64",
            "minimum": 1,
            "maximum": BIGINT_MAX,
            "description": "From this seq of the queue on.",
        }
    },
    "required": ["seq"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {
        "time": {
            "type": "string",
            "format": "date-time",
            "maxLength": MAX_TIME_CHARS,
            "description": "From the first message of the queue published at or after this time "
            "(ISO 8601; without an offset, UTC).",
        }
    },
    "required": ["time"],
    "additionalProperties": False,
}
SEEK_SCHEMA = {"oneOf": [SEQ_SCHEMA, TIME_SCHEMA]}
FROM_SCHEMA = {
    "oneOf": [{"type": "string", "enum": [NEW, ALL]}, SEQ_SCHEMA, TIME_SCHEMA],
    "description": 'Where a new subscription starts: "new" (the default: what is published from '
    'now on), "all" (every message still in the hot tables), {"seq": N} or {"time": "<ISO 8601>"}. '
    "Only a new subscription replays; the same subscription again is answered as it is (seek "
    "replays an existing one).",
}
REPLAY_SCHEMA = {
    "type": "object",
    "properties": {
        "from_seq": {
            "type": "integer",
            "nullable": True,
            "description": "The seq the replay started from: the one asked, or the oldest still in "
            "the hot tables if that is later (older ones were archived). Past the queue's last seq, "
            "that point, and nothing owed. Null when nothing was replayed because the subscription "
            "existed already.",
        },
        "deliveries": {
            "type": "integer",
            "description": "How many deliveries the replay made owed (made new, or acked and dead "
            "ones handed out again by a seek).",
        },
    },
    "required": ["from_seq", "deliveries"],
}


class Point(NamedTuple):
    """A replay point: `kind` is new, all, seq or time; `value` the seq (int) or time (aware)."""

    kind: str
    value: int | datetime | None = None


class BadPoint(ValueError):
    """A replay point that is none of the shapes; `field` names what was wrong."""

    def __init__(self, field, detail):
        super().__init__(detail)
        self.field, self.detail = field, detail


def point_of(value, names=True):
    """The Point a client sent: `from` of a subscribe (`names`: "new" and "all" allowed too), or
    a seek's body. Raises BadPoint, naming `from` (or, for a seek, `seq` or `time`)."""
    field = "from" if names else None
    if names and value in (NEW, ALL):
        return Point(value)
    if not isinstance(value, dict) or len(value) != 1 or not value.keys() <= {SEQ, TIME}:
        if names:
            raise BadPoint(field, f"Must be {SHAPES}.")
        raise BadPoint(
            "non_field_errors", 'A seek is {"seq": N} or {"time": "<ISO 8601>"}, one of them alone.'
        )
    if SEQ in value:
        seq = value[SEQ]
        if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= BIGINT_MAX:
            raise BadPoint(field or SEQ, f"seq must be a whole number from 1 to {BIGINT_MAX}.")
        return Point(SEQ, seq)
    return Point(TIME, time_of(value[TIME], field or TIME))


def point_of_text(text):
    """A Point as an operator types it (`listen --from`, the admin): new, all, a seq, or an
    ISO 8601 time."""
    text = text.strip()
    if text.lower() in (NEW, ALL):
        return Point(text.lower())
    if text.isdigit():
        return point_of({SEQ: int(text)}, names=False)
    return point_of({TIME: text}, names=False)


def time_of(text, field=TIME):
    """An ISO 8601 time as an aware UTC datetime (none given: UTC). A time before or after what
    a datetime can hold in UTC (year 1 with a positive offset) is taken as its earliest or
    latest: a replay from it starts at the oldest message, or owes nothing."""
    when = iso_time(text)
    if when is None:
        raise BadPoint(field, 'time must be an ISO 8601 date and time, e.g. "2026-11-24T14:00:00Z".')
    try:
        return when.astimezone(UTC)
    except OverflowError:
        return datetime.min.replace(tzinfo=UTC) if when.year == 1 else datetime.max.replace(tzinfo=UTC)


def answer_of(replayed):
    """The `replay` field of an answer: {"from_seq", "deliveries"}."""
    if replayed is None:
        return {"from_seq": None, "deliveries": 0}
    return {"from_seq": replayed.from_seq, "deliveries": replayed.deliveries}
