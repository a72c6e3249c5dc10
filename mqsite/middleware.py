"""Django's session, CSRF, authentication and messages middleware, skipped by bearer-token API
calls.

A call to /api/ with `Authorization: Bearer ...` is a subscriber's (or a script's): DRF
authenticates it by its token, and it has no session to load, no CSRF cookie to set and no
messages to show. Those four cost a cookie parse, a lazy user and response processing on the
busiest path of all (issue 15). Everything else keeps them: the admin, the dashboard, and an
operator using the browsable API with a session, whose unsafe calls DRF still checks for a CSRF
token (SessionAuthentication.enforce_csrf, which does not depend on this middleware). A browser
cannot add an Authorization header to a cross-site request without a CORS preflight, which this
server never grants, so the header cannot be used to step around the CSRF check.
"""

from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.middleware import csrf

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


class CsrfViewMiddleware(_SkippedByBearerApiCalls, csrf.CsrfViewMiddleware):
    def process_view(self, request, callback, callback_args, callback_kwargs):
        if is_bearer_api_call(request):
            return None
        return super().process_view(request, callback, callback_args, callback_kwargs)
