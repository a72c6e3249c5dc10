"""X-Request-ID: every REST answer carries one, the caller's own when it sent a safe one, else a
new one, and every line logged while serving the request carries it too (log_context), so that
a caller's report, a proxy's log and ours name the same request.

The ASGI handler (mqsite.asgi_handler) takes it first, before the body is read, so that even a
413 for an oversized body carries it; RequestId, the first middleware, does the same for a
request that came another way (Django's test client, another server), and sets the header.
"""

import logging
import re
import time
import uuid

from . import log_context

HEADER = "X-Request-ID"
# One line a request, in the log's format (Daphne's own access log, plain text on stdout, is
# off under `make run`: daphne -v 0). The path without its query, which may hold a token.
access_log = logging.getLogger("mqsite.access")
# At most 128 characters, none that could split a header or a log line, or be read as markup.
_SAFE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def from_header(value):
    """The caller's id when it is a safe one (str or bytes), else a new one (32 hex digits)."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value and _SAFE.fullmatch(value):
        return value
    return uuid.uuid4().hex


def of_scope(scope):
    """The request id of an ASGI scope (its X-Request-ID header, if safe)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id":
            return from_header(value)
    return from_header(None)


class RequestId:
    """The first middleware: the request's id bound for its log lines and answered, and its
    access log line."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request_id = log_context.current("request_id")
        if request_id is None:  # not taken by mqsite.asgi_handler: a test client, another server
            request_id = from_header(request.headers.get(HEADER))
            with log_context.bound(request_id=request_id):
                return self._respond(request, request_id)
        return self._respond(request, request_id)

    def _respond(self, request, request_id):
        started = time.perf_counter()
        response = self.get_response(request)
        response[HEADER] = request_id
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                "%s %s %s %.1f ms",
                request.method,
                request.path,
                response.status_code,
                (time.perf_counter() - started) * 1000,
            )
        return response
