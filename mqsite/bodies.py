"""How large a request body may be, by route: checked from Content-Length before the body is
read, and again as it arrives (a chunked body has no length to check)."""

import json
import re
from urllib.parse import unquote, urlsplit

from django.conf import settings

# Routes that take payloads: the publish endpoint (one message, or a batch of up to 1000) and
# the admin's test publish (one payload, form-encoded). A search, not a match, so that a root
# path (a proxy's prefix) in front changes nothing.
_PUBLISH = re.compile(r"/api/queues/[^/]+/messages/?$")
_ADMIN_PUBLISH = re.compile(r"/admin/tools/publish/?$")

# What a single message's body may hold beside its payload: an event name, a key (255
# characters), headers (8 KiB as stored), and their escapes and spaces.
ENVELOPE_BYTES = 64 * 1024
# A payload's text as sent may be longer than as stored (compact, UTF-8): \u escapes take up to
# three times the bytes of the UTF-8 they stand for, and a client may indent.
PAYLOAD_SPELLING_FACTOR = 4


def is_publish(method, path):
    return method.upper() == "POST" and _PUBLISH.search(path) is not None


def single_publish_limit():
    """The most bytes the body of one message (not a batch) may have: one payload at the
    MQ_MAX_PAYLOAD_BYTES limit, however it is spelt, and its envelope. Anything longer cannot
    be a publishable message, so it is refused without being parsed."""
    return min(
        PAYLOAD_SPELLING_FACTOR * settings.MQ_MAX_PAYLOAD_BYTES + ENVELOPE_BYTES, settings.MQ_MAX_BODY_BYTES
    )


def looks_like_batch(raw):
    """Whether a publish body may be a batch ({"messages": [...]}), by its bytes, before it is
    parsed. A body without the key's text is not one (a key spelt with escapes, which no client
    does, makes a batch look single: refused as too long, never let through); a single message
    whose payload holds the word is treated as a batch, whose limit is the larger."""
    return b'"messages"' in raw


def body_limit(method, path):
    """The most bytes a body of this request may have. `path` without its query string."""
    large = settings.MQ_MAX_BODY_BYTES
    if is_publish(method, path):
        return large
    if method.upper() == "POST" and _ADMIN_PUBLISH.search(path) is not None:
        return single_publish_limit()
    return min(settings.MQ_MAX_SMALL_BODY_BYTES, large)


def raw_target_path(target):
    """The decoded path of an HTTP request target as it came on the wire (bytes; origin form
    `/a?b` or absolute form `http://host/a?b`)."""
    text = target.decode("latin-1")
    if not text.startswith("/"):
        text = urlsplit(text).path or "/"
    return unquote(text.split("?", 1)[0])


def too_large_detail(limit, size=None):
    if size is not None:
        return f"The request body is {size} bytes, over the limit of {limit} bytes for this endpoint."
    return f"The request body is over the limit of {limit} bytes for this endpoint."


def too_large_json(detail):
    return json.dumps({"detail": detail, "code": "payload_too_large"}).encode()
