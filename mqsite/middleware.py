"""Django's session, authentication and messages middleware and django-csp's, skipped by
bearer-token API calls.

A call to /api/ with `Authorization: Bearer ...` is a subscriber's (or a script's): DRF
authenticates it by its token, and it has no session to load and no messages to show (issue
15). Everything else keeps them: the admin, the dashboard, and an operator using the browsable
API with a session, whose unsafe calls DRF still checks for a CSRF token
(SessionAuthentication.enforce_csrf, which does not depend on any middleware). A browser cannot
add an Authorization header to a cross-site request without a CORS preflight, which this server
never grants, so the header cannot be used to step around a session's checks.

A Content-Security-Policy only guards a page a browser renders; a bearer-token call's JSON is
read by a program, so it goes without (and without building the header on the hot path).

Django's CsrfViewMiddleware stays as it is (settings.MIDDLEWARE says why): on an API call it
only reads the cookie header, since DRF's views are csrf_exempt.
"""

from csp import middleware as csp
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions

API_PREFIX = "/api/"


def is_bearer_api_call(request):
    return (
        request.path_info.startswith(API_PREFIX)
        and request.META.get("HTTP_AUTHORIZATION", "")[:7].lower() == "bearer "
    )


class _SkippedByBearerApiCalls:
    def __call__(self, request):
        if is_bearer_api_call(request):
            return self.get_response(request)
        return super().__call__(request)


class SessionMiddleware(_SkippedByBearerApiCalls, sessions.SessionMiddleware):
    pass


class AuthenticationMiddleware(_SkippedByBearerApiCalls, auth.AuthenticationMiddleware):
    pass


class MessageMiddleware(_SkippedByBearerApiCalls, messages.MessageMiddleware):
    pass


class CSPMiddleware(_SkippedByBearerApiCalls, csp.CSPMiddleware):
    pass
