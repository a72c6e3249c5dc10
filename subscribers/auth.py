"""Who is calling: a subscriber by bearer token, or an operator (a staff user) by session."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions, permissions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from mqsite import rows

from .models import Subscriber
from .tokens import hash_token, token_matches


class SubscriberUser:
    """Stands in request.user for a subscriber, so DRF's checks see an authenticated caller."""

    is_authenticated = True
    is_anonymous = False
    is_staff = False
    is_active = True

    def __init__(self, subscriber):
        self.subscriber = subscriber
        self.pk = self.id = f"subscriber:{subscriber.pk}"

    def __str__(self):
        return self.subscriber.name


def subscriber_for_token(token):
    """The active subscriber holding `token`, or None."""
    if not token:
        return None
    subscriber = rows.first(Subscriber, "token_hash = %s AND is_active = %s", [hash_token(token), True])
    # The lookup is by hash, so its timing says nothing about the token; compare anyway, in
    # constant time, so that no future change of lookup can leak it.
    if subscriber is None or not token_matches(token, subscriber.token_hash):
        return None
    return subscriber


class BearerTokenAuthentication(BaseAuthentication):
    keyword = b"bearer"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Authorization must be 'Bearer <token>'.")
        try:
            token = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("The token is not valid.") from None
        subscriber = subscriber_for_token(token)
        if subscriber is None:
            raise exceptions.AuthenticationFailed("The token is not valid or its subscriber is inactive.")
        return SubscriberUser(subscriber), subscriber

    def authenticate_header(self, request):
        # Present so that DRF answers 401 (not 403) to a call without credentials.
        return 'Bearer realm="api"'


def subscriber_of(request):
    """The calling subscriber, or None for an operator."""
    return request.auth if isinstance(request.auth, Subscriber) else None


def is_operator(request):
    return bool(request.user and getattr(request.user, "is_staff", False) and subscriber_of(request) is None)


class IsSubscriberOrOperator(permissions.BasePermission):
    message = "This needs a subscriber token or an operator (staff) login."

    def has_permission(self, request, view):
        return subscriber_of(request) is not None or is_operator(request)


class IsSubscriber(permissions.BasePermission):
    message = "This call acts as a subscriber: send a subscriber's bearer token."

    def has_permission(self, request, view):
        return subscriber_of(request) is not None


class IsOperator(permissions.BasePermission):
    message = "Operators only: log in as a staff user."

    def has_permission(self, request, view):
        return is_operator(request)


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The token in the OpenAPI schema (drf-spectacular finds it by the class it names)."""

    target_class = "subscribers.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A subscriber's API token."}
