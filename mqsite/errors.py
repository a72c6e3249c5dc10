"""Errors as JSON with words a person understands; never a traceback to the client."""

import logging

from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import JsonResponse
from django.views import defaults
from rest_framework.views import exception_handler

log = logging.getLogger(__name__)


def api_exception_handler(exc, context):
    if isinstance(exc, RequestDataTooBig):  # Django's own cap, should anything read the body
        return JsonResponse({"detail": "The request body is too large."}, status=413)
    if isinstance(exc, OperationalError | InterfaceError):
        # The database restarting, failing over, or locked past the busy timeout: nothing was
        # done (the transaction rolled back), so the client may simply try again.
        log.warning("database unavailable in %s: %s", context["view"].__class__.__name__, exc)
        return JsonResponse(
            {"detail": "The database is unavailable for a moment; nothing was done. Try again."},
            status=503,
            headers={"Retry-After": "1"},
        )
    response = exception_handler(exc, context)
    if response is None:
        # Not an API error: a bug or an outage. Log it whole; tell the client little.
        log.error("unhandled error in %s", context["view"].__class__.__name__, exc_info=exc)
        return JsonResponse({"detail": "Internal error; it has been logged."}, status=500)
    return response


def _is_api(request):
    return request.path.startswith("/api/") or request.path == "/healthz"


def not_found(request, exception=None):
    if _is_api(request):
        return JsonResponse({"detail": f"Nothing is at {request.path}."}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request):
    if _is_api(request):
        return JsonResponse({"detail": "Internal error; it has been logged."}, status=500)
    return defaults.server_error(request)


def bad_request(request, exception=None):
    if _is_api(request):
        return JsonResponse({"detail": "Bad request."}, status=400)
    return defaults.bad_request(request, exception)


def permission_denied(request, exception=None):
    if _is_api(request):
        return JsonResponse({"detail": "You may not do this."}, status=403)
    return defaults.permission_denied(request, exception)
