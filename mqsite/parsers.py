"""JSON bodies with limits checked before parsing: size (413) and nesting depth (400)."""

import json

from django.conf import settings
from rest_framework import exceptions, status
from rest_framework.parsers import BaseParser

from .bodies import body_limit, is_publish, looks_like_batch, single_publish_limit, too_large_detail

# Arrays and objects a JSON body of a route other than publish may hold. Theirs hold a few (an
# ack: one list of numbers; a nack's error text at most 1000 characters, brackets included), but
# each costs ~80 bytes decoded: 1 MiB of `[]` is 350,000 lists, 22 MB and 0.4 s to decode and
# walk. Counting the brackets of the raw body (those inside strings too, so an upper bound)
# refuses that in a millisecond.
MAX_SMALL_BODY_CONTAINERS = 4096
# A socket's publish frame may hold more (each message of a batch is an object, its payload
# more), but a frame is decoded on the event loop every socket and request shares: past this
# many, up to 40 ms of it (1 MiB of `[]`, Daphne's largest frame, is 350,000 and 0.2 s).
MAX_PUBLISH_FRAME_CONTAINERS = 65536
# The same for a REST publish body: 200 a message of a full batch (its envelope takes 1 to 2), about
# 40 MB decoded at most. Beyond the body's size, this is what bounds the memory a publish body
# costs before it is refused (8 MiB of `[]` was 2.8 million lists, 230 MB and 6 s).
MAX_PUBLISH_BODY_CONTAINERS = 200_000


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "too_large"


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def json_depth(value):
    """How deeply arrays and objects nest in a decoded JSON value. Iterative, holding one
    iterator per level: memory by depth, not by size (it held a tuple per item: 16 million
    numbers made a GB)."""
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 1, [iter(value.values() if isinstance(value, dict) else value)]
    while stack:
        for child in stack[-1]:
            if isinstance(child, dict):
                stack.append(iter(child.values()))
                break
            if isinstance(child, list):
                stack.append(iter(child))
                break
        else:
            stack.pop()
            continue
        deepest = max(deepest, len(stack))
    return deepest


class BadJSON(ValueError):
    """JSON that is malformed, not strict JSON (NaN), or nested too deep."""


class TooManyContainers(BadJSON):
    """More arrays and objects than the body or frame may hold: refused before decoding."""


def count_containers(raw):
    """An upper bound of the arrays and objects in raw JSON (str or bytes): its '[' and '{',
    those inside strings too. A millisecond a MiB, where decoding them takes a second."""
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return raw.count(b"[") + raw.count(b"{")


def check_containers(raw, limit=MAX_SMALL_BODY_CONTAINERS, what="body", taker="this endpoint"):
    """The one rule on how many arrays and objects raw JSON may hold, before it is decoded."""
    if count_containers(raw) > limit:
        raise TooManyContainers(
            f"The {what} holds more than {limit} arrays and objects ('[' and '{{' counted), "
            f"more than {taker} takes."
        )


def decode_json(raw):
    """Decode a request body or a websocket frame by the one rule: strict JSON, nested at most
    MQ_MAX_JSON_DEPTH deep. BadJSON says what is wrong."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BadJSON("The JSON nests too deeply.") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadJSON(f"The body is not valid JSON: {exc}") from None
    if json_depth(data) > settings.MQ_MAX_JSON_DEPTH:
        raise BadJSON(f"The JSON nests deeper than {settings.MQ_MAX_JSON_DEPTH} levels.")
    return data


def check_shape(request, raw):
    """Refuse, before it is parsed, a body whose bytes already say it cannot be taken: decoding
    costs up to 30 times a body's size in memory, and seconds, for a body refused anyway."""
    if is_publish(request.method, request.path_info):
        single = single_publish_limit()
        if len(raw) > single and not looks_like_batch(raw):
            raise RequestTooLarge(
                f"The body is {len(raw)} bytes, over the {single} bytes one message may take "
                f"(a payload of MQ_MAX_PAYLOAD_BYTES, {settings.MQ_MAX_PAYLOAD_BYTES}, and its "
                'event, key and headers); a batch ({"messages": [...]}) may take MQ_MAX_BODY_BYTES.'
            )
        if count_containers(raw) > MAX_PUBLISH_BODY_CONTAINERS:
            raise RequestTooLarge(
                f"The body holds more than {MAX_PUBLISH_BODY_CONTAINERS} arrays and objects "
                "('[' and '{' counted): send the messages in smaller batches."
            )


class _BoundedJSONBody(BaseParser):
    """Not a JSONParser subclass on purpose: DRF reads the whole body into memory before it
    calls one of those (and Django refuses a body over 2.5 MiB with an error that was a 500);
    this one gets the stream, refuses a declared length over the limit before reading, and
    reads at most one byte past the limit."""

    def parse(self, stream, media_type=None, parser_context=None):
        request = (parser_context or {}).get("request")
        limit = (
            body_limit(request.method, request.path_info)
            if request is not None
            else settings.MQ_MAX_BODY_BYTES
        )
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge(too_large_detail(limit, int(declared)))
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise RequestTooLarge(too_large_detail(limit))
        if request is not None:
            check_shape(request, raw)
        try:
            if request is not None and not is_publish(request.method, request.path_info):
                check_containers(raw)
            # UTF-8 only (json.loads would also guess UTF-16 and -32 from bytes).
            return decode_json(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(f"The body is not valid JSON: {exc}") from None
        except BadJSON as exc:
            raise exceptions.ParseError(str(exc)) from None


class BoundedJSONParser(_BoundedJSONBody):
    media_type = "application/json"


class AnyTypeJSONParser(_BoundedJSONBody):
    """The body is read as JSON whatever its declared Content-Type (`curl -d` says
    form-urlencoded, some clients say nothing): the API speaks only JSON, so a clear 400 for a
    body that is not JSON helps more than a 415. Listed after BoundedJSONParser, and left out
    of the schema, which documents application/json (hence not a subclass of it: the
    schema's whitelist goes by isinstance)."""

    media_type = "*/*"
