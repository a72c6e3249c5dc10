from drf_spectacular.utils import extend_schema_field
from rest_framework import exceptions, serializers

from delivery import publishing
from mqsite.api import STORABLE_PATTERN, BoundedListField, NameField, StorableCharField, TooLarge
from queues import headers, timing


@extend_schema_field(
    {
        "type": "object",
        # The name rule as patternProperties, with no other name allowed: JSON Schema since draft
        # 4 (what Schemathesis and validators read an OpenAPI 3.0 schema as) and OpenAPI 3.1;
        # propertyNames would need draft 6, and additionalProperties alone cannot name them.
        "patternProperties": {
            headers.SCHEMA_NAME_PATTERN: {
                "type": "string",
                "pattern": STORABLE_PATTERN,
                "maxLength": headers.MAX_VALUE_CHARS,
            }
        },
        "additionalProperties": False,
        "maxProperties": headers.MAX_HEADERS,
        "description": (
            f"Optional headers beside the payload (e.g. traceparent), carried on every delivery: "
            f"{headers.NAME_HELP}; text values; at most {headers.MAX_HEADERS} of them and "
            f"{headers.MAX_HEADERS_BYTES} bytes in all (UTF-8 of names and values)."
        ),
    }
)
class HeadersField(serializers.JSONField):
    """A message's headers as sent: publishing.prepare() checks them (queues.headers), so that
    every way in refuses the same."""


def _timing_field(schema, description):
    """A field of queues.timing, taken as sent (publishing.prepare() checks it, as for every
    way in), with its schema for the OpenAPI description."""

    @extend_schema_field({**schema, "nullable": True, "description": description})
    class TimingField(serializers.JSONField):
        pass

    return TimingField(required=False, allow_null=True)


_TIME = {"type": "string", "format": "date-time", "maxLength": timing.MAX_TIME_CHARS}


class BadTiming(exceptions.APIException):
    """A 400 for a bad deliver_at / delay_secs / expires_at / ttl_secs, with its code
    (bad_delay, bad_expiry) and the field named as DRF names field errors (inside `messages`
    and the item's index for a batch)."""

    status_code = 400

    def __init__(self, exc, index=None):
        errors = {exc.field: [str(exc)]}
        where = "" if index is None else f"messages[{index}]: "
        body = {"detail": f"{where}{exc}", "code": exc.code}
        body.update(errors if index is None else {"messages": {str(index): errors}})
        super().__init__(body)


class PublishSerializer(serializers.Serializer):
    event = NameField()
    payload = serializers.JSONField(
        allow_null=True,
        help_text="Any JSON value, null included; its text valid Unicode (no lone surrogate).",
    )
    key = StorableCharField(
        required=False,
        allow_null=True,
        max_length=publishing.MAX_KEY_LENGTH,
        trim_whitespace=False,  # a key is compared as sent; trimming made " " a blank key (400)
        help_text="Idempotency key: the same key again in this queue answers with the first message.",
    )
    headers = HeadersField(required=False, allow_null=True)
    group = StorableCharField(
        required=False,
        allow_null=True,
        max_length=publishing.MAX_GROUP_LENGTH,
        trim_whitespace=False,  # compared as sent, as a key is
        help_text="Its message group: in an ordered queue, order holds within each group, and messages "
        "of different groups may be in flight at once. Absent or null: the queue's default group.",
    )
    deliver_at = _timing_field(
        _TIME,
        "A delayed message: no delivery of it is handed out before this time (ISO 8601; without an "
        "offset, UTC; at most 7 days ahead; a time past is now). Not with delay_secs.",
    )
    delay_secs = _timing_field(
        {"type": "number", "minimum": 0, "maximum": timing.MAX_DELAY_SECS},
        "A delayed message: handed out no sooner than this many seconds from now. Not with deliver_at.",
    )
    expires_at = _timing_field(
        _TIME,
        "Not acked by this time, its deliveries go no further (dead, reason expired). After the "
        "message falls due (its deliver_at, or now). Not with ttl_secs.",
    )
    ttl_secs = _timing_field(
        {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": timing.MAX_TTL_SECS},
        "Expires this many seconds after it falls due (its deliver_at, or now); without it and "
        "expires_at, the queue's default TTL, if any. Not with expires_at.",
    )

    def validate(self, attrs):
        try:
            return publishing.prepare(
                attrs["event"],
                attrs["payload"],
                attrs.get("key"),
                attrs.get("headers"),
                attrs.get("group"),
                **publishing.timing_fields(attrs),
            )
        except publishing.PayloadTooLarge as exc:
            raise TooLarge(str(exc)) from None
        except publishing.BadMessageTiming as exc:
            raise BadTiming(exc) from None
        except publishing.BadMessageHeaders as exc:
            raise serializers.ValidationError({"headers": [str(exc)]}) from None
        except publishing.BadMessageGroup as exc:
            raise serializers.ValidationError({"group": [str(exc)]}) from None
        except publishing.BadMessage as exc:
            raise serializers.ValidationError(str(exc)) from None


class PublishBatchSerializer(serializers.Serializer):
    # A ListField, not many=True: the schema then says how many (minItems, maxItems).
    messages = BoundedListField(child=PublishSerializer(), min_length=1, max_length=publishing.MAX_BATCH)

    def validate(self, attrs):
        # A body with a message's own fields beside "messages" fits both shapes the schema
        # allows (oneOf): it is a mistake, not a batch, and publishing it would drop them.
        mixed = sorted(set(MESSAGE_FIELDS) & set(self.initial_data))
        if mixed:
            raise serializers.ValidationError(
                {f: ["A batch has only 'messages': put this inside each message."] for f in mixed}
            )
        return attrs


MESSAGE_FIELDS = ("event", "payload", "key", "headers", "group", *timing.FIELDS)


def publish_body(data):
    """A publish body's prepared messages, and whether it was a batch.

    A message that is plainly valid goes straight to publishing.prepare() (which checks every
    rule the serializer's fields check, and more): DRF's serializer runs every field and
    validator of each message, 22 ms for a batch of 1,000 against 5 ms this way (this
    machine). Only a body with something wrong goes through the serializers, so that every
    error (400, 413) is answered exactly as they answer it."""
    batch = isinstance(data, dict) and "messages" in data
    messages = data.get("messages") if batch else [data]
    plain = (
        isinstance(messages, list)
        and 1 <= len(messages) <= publishing.MAX_BATCH
        and not (batch and data.keys() & set(MESSAGE_FIELDS))
    )
    outgoing = []
    for index, m in enumerate(messages if plain else ()):
        if not (isinstance(m, dict) and "event" in m and "payload" in m):
            break
        try:
            outgoing.append(
                publishing.prepare(
                    m["event"],
                    m["payload"],
                    m.get("key"),
                    m.get("headers"),
                    m.get("group"),
                    **publishing.timing_fields(m),
                )
            )
        except publishing.PayloadTooLarge as exc:
            raise TooLarge(str(exc)) from None
        except publishing.BadMessageTiming as exc:
            raise BadTiming(exc, index if batch else None) from None
        except publishing.BadMessage:
            break
    else:
        if plain:
            return outgoing, batch
    serializer = (PublishBatchSerializer if batch else PublishSerializer)(data=data)
    serializer.is_valid(raise_exception=True)
    return (serializer.validated_data["messages"] if batch else [serializer.validated_data]), batch


class PublishedSerializer(serializers.Serializer):
    """The answer to a publish (for the schema; views return dicts)."""

    id = serializers.IntegerField()
    queue = serializers.CharField()
    event = serializers.CharField()
    seq = serializers.IntegerField()
    deliveries = serializers.IntegerField(help_text="How many subscriptions it fanned out to.")
    created_at = serializers.DateTimeField()


class PublishedBatchSerializer(serializers.Serializer):
    messages = PublishedSerializer(many=True)


class QueueSerializer(serializers.Serializer):
    name = serializers.CharField()
    ordered = serializers.BooleanField()
    events = serializers.ListField(child=serializers.CharField())
    max_attempts = serializers.IntegerField()
    ack_timeout = serializers.IntegerField()
    retention_days = serializers.IntegerField()
    paused = serializers.BooleanField()
    ttl_secs = serializers.IntegerField(
        allow_null=True, help_text="The expiry of a message that names none, after it falls due; null: none."
    )
    may_publish = serializers.BooleanField()
    may_subscribe = serializers.BooleanField()


class QueueListSerializer(serializers.Serializer):
    queues = QueueSerializer(many=True)


class SchemaErrorSerializer(serializers.Serializer):
    index = serializers.IntegerField(help_text="The message's place in the batch (0 for one message).")
    path = serializers.CharField(help_text="A JSON pointer into that message's payload ('' is all of it).")
    message = serializers.CharField()


class SchemaMismatchSerializer(serializers.Serializer):
    """A 400: DRF's field errors, or a payload refused by its event's schema (code schema_mismatch)."""

    detail = serializers.CharField(required=False)
    code = serializers.CharField(required=False)
    errors = SchemaErrorSerializer(many=True, required=False, help_text="With schema_mismatch: at most 20.")


class CatalogEventSerializer(serializers.Serializer):
    name = serializers.CharField()
    schema = serializers.JSONField(
        allow_null=True, help_text="Its JSON Schema (draft 2020-12), or null: any payload."
    )
    schema_updated_at = serializers.DateTimeField(allow_null=True)


class EventCatalogSerializer(serializers.Serializer):
    queue = serializers.CharField()
    events = CatalogEventSerializer(many=True)


class RouteSerializer(PublishSerializer):
    """A route's candidate message: a publish's event, payload and headers (what the rule
    reads: the contract's body), without a key, a group or times."""

    key = group = deliver_at = delay_secs = expires_at = ttl_secs = None


class RoutedSubscriptionSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    subscriber = serializers.CharField()
    event = serializers.CharField(allow_null=True, help_text="The subscription's event; null: every event.")
    matches = serializers.BooleanField(help_text="A publish now would owe it the message (paused: held).")
    reason = serializers.CharField()


class RouteAnswerSerializer(serializers.Serializer):
    subscriptions = RoutedSubscriptionSerializer(many=True)
