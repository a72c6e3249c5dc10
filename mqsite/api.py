"""What every API view shares: errors with the contract's status codes."""

from django.core.validators import RegexValidator
from drf_spectacular.openapi import AutoSchema
from rest_framework import exceptions, serializers, status

from queues.names import INPUT_RE, NAME_HELP


class TooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Too large."
    default_code = "too_large"


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "Conflict."
    default_code = "conflict"


BIGINT_MAX = 2**63 - 1


def is_db_id(value):
    """Whether `value` could be a row id (ids past the bigint range would make the database
    fail instead of finding nothing)."""
    return isinstance(value, int) and 0 < value <= BIGINT_MAX


def storable_text(text):
    """Whether a database can store this text: no NUL, no lone surrogate (JSON allows both)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StrictCharField(serializers.CharField):
    """A CharField that refuses numbers and booleans instead of turning them into text."""

    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


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
    """A queue or event name; its rule (queues.names) is checked here and shown in the schema."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", 64)
        kwargs.setdefault("trim_whitespace", False)  # " db" is not a name
        super().__init__(**kwargs)
        self.validators.append(RegexValidator(INPUT_RE, NAME_HELP))


class BodyRequiredSchema(AutoSchema):
    """For a view whose body has several shapes (a PolymorphicProxySerializer), from which
    drf-spectacular cannot tell that a body is required: it is."""

    def _get_request_body(self, direction="request"):
        body = super()._get_request_body(direction)
        if body:
            body["required"] = True
        return body


class ErrorSerializer(serializers.Serializer):
    """An error in words: {"detail": "..."}; for a 400, DRF's field errors ({"field": ["..."]})."""

    detail = serializers.CharField(required=False)


ERRORS = {
    400: "Malformed body or query, or a bad name.",
    401: "No token, or one that is not valid (or its subscriber is inactive).",
    403: "The caller may not do this.",
    404: "Not found, or not the caller's.",
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
