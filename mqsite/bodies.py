"""How large a request body may be, by route: checked from Content-Length before the body is
read, and again as it arrives (a chunked body has no length to check)."""

import json
import re
from urllib.parse import unquote, urlsplit

from django.conf import settings

# Routes that take batches of payloads: the publish endpoint (up to 1000 payloads) and the
# admin's test publish (one payload, form-encoded: up to three times its size). A search, not a
# match, so that a root path (a proxy's prefix) in front changes nothing.
_PUBLISH = re.compile(r"/api/queues/[^/]+/messages/?$|/admin/tools/publish/?$")


def is_publish(method, path):
    return method.upper() == "POST" and _PUBLISH.search(path) is not None


def body_limit(method, path):
    """The most bytes a body of this request may have. `path` without its query string."""
    large = settings.MQ_MAX_BODY_BYTES
    if is_publish(method, path):
        return large
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
    return json.dumps({"detail": detail}).encode()
