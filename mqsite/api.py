"""What every API view shares: one base class (the names rule, ids, the services' errors as
status codes), the strict fields, and errors with the contract's status codes. It imports no
app: the views of every layer build on it."""

from django.core.validators import ProhibitNullCharactersValidator, RegexValidator
from drf_spectacular.openapi import AutoSchema
from rest_framework import exceptions, serializers, status
from rest_framework.views import APIView

from .names import INPUT_RE, NAME_HELP, BadName, clean_name
from .service_errors import ServiceError
from .values import BIGINT_MAX, is_db_id


class TooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Too large."
    default_code = "too_large"


# Text a database can store (storable_text) has no NUL, as a pattern the schema publishes, so
# that the schema forbids what the server refuses. Nor may it hold a lone surrogate (DRF refuses
# those too), but no pattern can say so portably: ECMA reads surrogates as halves of pairs, and
# Rust-based validators (Schemathesis's) cannot compile them; clients that send UTF-8 never do.
STORABLE_PATTERN = r"^[^\u0000]*$"
storable = RegexValidator(STORABLE_PATTERN, "Text may not contain NUL.")


class StrictCharField(serializers.CharField):
    """A CharField that refuses numbers and booleans instead of turning them into text."""

    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StorableCharField(StrictCharField):
    """Free text a database can store, its rule (no NUL) shown in the schema as a pattern."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # DRF's own NUL check says the same as `storable`, which is the one the schema shows.
        self.validators = [v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)]
        self.validators.append(storable)


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer: not a string of digits, not a boolean, not 2.0."""

    default_error_messages = {"invalid": "Must be a whole number."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A JSON number: not a string of digits, not a boolean."""

    default_error_messages = {"invalid": "Must be a number."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class NameField(StrictCharField):
    """A queue or event name; its rule (mqsite.names) is checked here and shown in the schema."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", 64)
        kwargs.setdefault("trim_whitespace", False)  # " db" is not a name
        super().__init__(**kwargs)
        self.validators.append(RegexValidator(INPUT_RE, NAME_HELP))


def schema_says_what_the_server_refuses(result, generator, request, public):
    """drf-spectacular postprocessing hook: the rules of the server that serializers cannot
    show. Every authenticated call can be a 406 (an Accept header naming no JSON type). Row
    ids in a path are bigint (past it nothing exists: 404). A publish body is one
    message or a batch, never both: "messages" makes it a batch, and a batch with a message's
    own fields beside it is refused (delivery.api.queue_serializers.PublishBatchSerializer).
    A message names at most one of deliver_at and delay_secs, and of expires_at and ttl_secs
    (queues.timing; null is not naming it)."""
    for ops in result.get("paths", {}).values():
        for op in ops.values():
            if isinstance(op, dict) and "401" in op.get("responses", {}):
                # Any call may send an Accept header naming no JSON type (DRF's negotiation).
                op["responses"].setdefault("406", {**op["responses"]["401"], "description": ERRORS[406]})
            if isinstance(op, dict) and "requestBody" in op and "400" in op.get("responses", {}):
                # Every body has a limit (mqsite/bodies.py): past it, 413 before it is read.
                op["responses"].setdefault("413", {**op["responses"]["400"], "description": ERRORS[413]})
            for param in op.get("parameters", []) if isinstance(op, dict) else ():
                if param["in"] == "path" and param["schema"].get("type") == "integer":
                    param["schema"].update(format="int64", minimum=1, maximum=BIGINT_MAX)
    schemas = result.get("components", {}).get("schemas", {})
    for component in schemas.values():
        for field in component.get("properties", {}).values():
            blank_too(field)
    message = schemas.get("PublishRequest")
    if message is not None:
        message["not"] = {"anyOf": [_both(*TIMING_PAIRS[0]), _both(*TIMING_PAIRS[1])]}
    body = schemas.get("PublishRequestRequest")
    if body is not None:
        one, batch = body["oneOf"]
        body["oneOf"] = [
            {"allOf": [one, {"not": {"required": ["messages"]}}]},
            {
                "allOf": [
                    batch,
                    {"not": {"anyOf": [{"required": [f]} for f in MESSAGE_FIELDS]}},
                ]
            },
        ]
    return result


# A message's own fields, which a batch may not have beside "messages" (queue_serializers'
# MESSAGE_FIELDS, which this layer may not import), and the pairs of queues.timing's fields of
# which a message names one at most, each with its type.
TIMING_PAIRS = (
    (("deliver_at", "string"), ("delay_secs", "number")),
    (("expires_at", "string"), ("ttl_secs", "number")),
)
MESSAGE_FIELDS = ("event", "payload", "key", "headers", *(name for pair in TIMING_PAIRS for name, _ in pair))


def _both(*fields):
    """A JSON Schema that holds when each of these (name, type) fields is there and not null (a
    null is of no type but "null", which OpenAPI 3.0 writes as `nullable`)."""
    return {"required": [name for name, _ in fields], "properties": {name: {"type": t} for name, t in fields}}


def blank_too(field):
    """drf-spectacular shows a blank-allowed text field with a pattern as `oneOf` [the field,
    an empty string]; but "" matches both when the pattern allows it (ours do), and `oneOf`
    then refuses what the server accepts. Either is fine: `anyOf`."""
    alternatives = field.get("oneOf")
    if alternatives and any(a == {"type": "string", "maxLength": 0} for a in alternatives):
        field["anyOf"] = field.pop("oneOf")


class BodyRequiredSchema(AutoSchema):
    """For a view whose body has several shapes (a PolymorphicProxySerializer), from which
    drf-spectacular cannot tell that a body is required: it is."""

    def _get_request_body(self, direction="request"):
        body = super()._get_request_body(direction)
        if body:
            body["required"] = True
        return body


class ErrorSerializer(serializers.Serializer):
    """An error in words and a code (mqsite.errors): {"detail": "...", "code": "..."}; for a
    400, DRF's field errors beside them ({"field": ["..."]})."""

    detail = serializers.CharField()
    code = serializers.CharField(help_text="A short code a program can test: `forbidden`, `unknown_queue`...")


ERRORS = {
    400: "Malformed body or query, or a bad name.",
    401: "No token, or one that is not valid (or its subscriber is inactive).",
    403: "The caller may not do this.",
    404: "Not found, or not the caller's.",
    406: "The Accept header names no type the API answers in (it answers JSON).",
    409: "The delivery is already acked or dead.",
    413: "The body or a payload is over its limit.",
    429: "Throttled: over MQ_THROTTLE_RATE requests; Retry-After says when to try again.",
}


def errors(*codes, **described):
    """OpenAPI responses for these error status codes, for extend_schema(responses=...).
    `described` overrides the words of one: errors(400, 404, e404="No such queue.")."""
    from drf_spectacular.utils import OpenApiResponse

    return {c: OpenApiResponse(ErrorSerializer, described.get(f"e{c}", ERRORS[c])) for c in codes}


class BoundedListField(serializers.ListField):
    """A ListField that checks its length before its items: DRF's validates every item first,
    so an ack of 350,000 `[]` (1 MiB) made 350,000 errors: seconds, hundreds of MB and a 12 MB
    answer. Past max_length now, one error at once."""

    def to_internal_value(self, data):
        if isinstance(data, list) and self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().to_internal_value(data)


class ApiView(APIView):
    """The one base of the REST views (NetBox's one base viewset): the names rule's 400, the
    ids' 404 and the mapping of the services' errors (ServiceError) to status codes, each
    written once here. Views parse, authorize, call one service and shape the answer. Who is
    calling, and the queue of a name, are asked in the layers that know them
    (subscribers.api.base.CallerView)."""

    @staticmethod
    def name_or_400(value, field):
        """A queue or event name, lower-cased; one that breaks the rule is a 400 on `field`."""
        try:
            return clean_name(value, field)
        except BadName as exc:
            raise exceptions.ValidationError({field: [str(exc)]}) from None

    @staticmethod
    def id_or_404(pk, what):
        """A row id; one past the bigint range is unknown (the database would fail on it)."""
        if not is_db_id(pk):
            raise exceptions.NotFound(f"You have no {what} with that id.")
        return pk

    def handle_exception(self, exc):
        return super().handle_exception(as_api_error(exc))


def as_api_error(exc):
    """A service's refusal as the status code and code it carries, in the contract's words."""
    if not isinstance(exc, ServiceError):
        return exc
    error = exceptions.APIException(exc.detail(), exc.code)
    error.status_code = exc.status_code
    return error
