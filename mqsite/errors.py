"""Errors as JSON with words a person understands and a code a program can test: every REST
error body is {"detail": "<words>", "code": "<short_code>", ...} (field errors keep their fields
beside), never a traceback. The codes are the socket's `error` frames' where the two mean the
same thing; this module is the one place that names a REST error's code."""

import functools
import logging

from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import JsonResponse
from django.views import defaults
from rest_framework import fields, relations, serializers
from rest_framework.views import exception_handler

log = logging.getLogger(__name__)

# DRF's own codes, in the contract's words (docs/rest-api.md, "Errors").
_CODES = {
    "permission_denied": "forbidden",
    "not_authenticated": "unauthenticated",
    "authentication_failed": "unauthenticated",
    "parse_error": "bad_json",
    "too_large": "payload_too_large",
}


def error_json(detail, code, status, headers=None, **extra):
    """A JSON error answer outside DRF's views (Django's handlers, the dashboard, /metrics)."""
    return JsonResponse({"detail": detail, "code": code, **extra}, status=status, headers=headers)


def api_exception_handler(exc, context):
    if isinstance(exc, RequestDataTooBig):  # Django's own cap, should anything read the body
        return error_json("The request body is too large.", "payload_too_large", 413)
    if isinstance(exc, OperationalError | InterfaceError):
        # The database restarting, failing over, or locked past the busy timeout: nothing was
        # done (the transaction rolled back), so the client may simply try again.
        log.warning("database unavailable in %s: %s", context["view"].__class__.__name__, exc)
        return error_json(
            "The database is unavailable for a moment; nothing was done. Try again.",
            "unavailable",
            503,
            headers={"Retry-After": "1"},
        )
    response = exception_handler(exc, context)
    if response is None:
        # Not an API error: a bug or an outage. Log it whole; tell the client little.
        log.error("unhandled error in %s", context["view"].__class__.__name__, exc_info=exc)
        return error_json("Internal error; it has been logged.", "server_error", 500)
    if isinstance(response.data, dict) and "code" not in response.data:
        if "detail" not in response.data:  # field errors: {"field": ["words"]}, kept beside
            response.data = {"detail": _field_errors_detail(response.data), **response.data}
        response.data["code"] = api_code(exc)
    elif isinstance(response.data, list):  # a ValidationError of a list: its words as detail
        response.data = {"detail": " ".join(map(str, response.data)), "code": api_code(exc)}
    return response


def api_code(exc):
    """The code of a DRF error: its own, in the contract's words (_CODES). A validation error's
    is the one code its messages were raised with when that is one of ours (bad_filter, ...);
    DRF's generic field codes (required, max_length, ...) are all `bad_request`."""
    codes = exc.get_codes() if hasattr(exc, "get_codes") else None
    leaves = set(_leaves(codes)) if codes is not None else set()
    if exc.__class__.__name__ == "ValidationError":
        (only,) = leaves if len(leaves) == 1 else (None,)
        return only if only and only not in _drf_field_codes() else "bad_request"
    code = next(iter(leaves)) if len(leaves) == 1 else getattr(exc, "default_code", "error")
    return _CODES.get(code, code)


def _leaves(codes):
    if isinstance(codes, dict):
        for value in codes.values():
            yield from _leaves(value)
    elif isinstance(codes, list):
        for value in codes:
            yield from _leaves(value)
    else:
        yield codes


@functools.cache
def _drf_field_codes():
    """Every code DRF's fields, serializers and relations raise on their own."""
    found = {"invalid", "required", "null", "blank", "unique", "does_not_exist"}
    for module in (fields, serializers, relations):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, fields.Field):
                found.update(getattr(value, "default_error_messages", {}))
    return frozenset(found)


def _field_errors_detail(errors):
    """Words for a body of field errors: the first field's first message, named."""
    for field, messages in errors.items():
        first = messages[0] if isinstance(messages, list) and messages else messages
        if isinstance(first, dict | list):
            return f"{field}: invalid."
        return f"{field}: {first}" if field != "non_field_errors" else str(first)
    return "Invalid input."


def _is_api(request):
    return request.path.startswith("/api/") or request.path == "/healthz"


def not_found(request, exception=None):
    if _is_api(request):
        return error_json(f"Nothing is at {request.path}.", "not_found", 404)
    return defaults.page_not_found(request, exception)


def server_error(request):
    if _is_api(request):
        return error_json("Internal error; it has been logged.", "server_error", 500)
    return defaults.server_error(request)


def bad_request(request, exception=None):
    if _is_api(request):
        return error_json("Bad request.", "bad_request", 400)
    return defaults.bad_request(request, exception)


def permission_denied(request, exception=None):
    if _is_api(request):
        return error_json("You may not do this.", "forbidden", 403)
    return defaults.permission_denied(request, exception)
