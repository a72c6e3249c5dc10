"""Who is calling: a subscriber by bearer token, or an operator (a staff user) by session.

Failed token attempts are counted per client address (the connection's peer, or what a
trusted proxy forwarded: mqsite/client_address.py; never a header a client could forge) in
fixed one-minute windows; past MQ_AUTH_FAILURES_PER_MINUTE a bad token is answered 429 (a
socket: closed 4429) until the window ends. A good token is never refused by this, so clients
sharing an address (a NAT) with a scanner keep working; the tokens are 256-bit random, so the
limit is about load and noise, not guessing.
"""

import logging
import math
import time

from django.conf import settings
from rest_framework import exceptions, permissions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from mqsite import rows
from mqsite.client_address import request_client_address

from .models import Subscriber
from .throttling import count_request, counters
from .tokens import hash_token, token_matches

log = logging.getLogger(__name__)
FAILURE_WINDOW_SECS = 60


def _failure_key(address):
    window = int(time.time() // FAILURE_WINDOW_SECS)
    return f"authfail:{address}:{window}", (window + 1) * FAILURE_WINDOW_SECS - time.time()


def auth_failed(address):
    """Count a failed token attempt from `address`; seconds to wait if it was one too many
    (for Retry-After), else 0. With the cache down, nothing is throttled."""
    key, left = _failure_key(address)
    try:
        count = count_request(counters(), key, FAILURE_WINDOW_SECS + 1)
    except Exception:
        log.warning("auth failure counter unavailable; not throttling", exc_info=True)
        return 0
    return max(math.ceil(left), 1) if count > settings.MQ_AUTH_FAILURES_PER_MINUTE else 0


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


# Active subscribers by token hash, forgotten in every process at any change of a subscriber
# (delivery.revocation): a rotated or deactivated token is refused from the next request on.
_by_token_hash = rows.Cached(Subscriber, "token_hash = %s AND is_active = %s", lambda h: [h, True])


def subscriber_for_token(token):
    """The active subscriber holding `token`, or None."""
    if not token:
        return None
    subscriber = _by_token_hash.first(hash_token(token))
    # The lookup is by hash, so its timing says nothing about the token; compare anyway, in
    # constant time, so that no future change of lookup can leak it.
    if subscriber is None or not token_matches(token, subscriber.token_hash):
        return None
    return subscriber


def subscribers_forgotten():
    """A count that moves whenever the kept subscribers are forgotten (any change announced):
    a request that leased after a wait compares it to learn whether its token may have been
    revoked meanwhile (delivery.long_polls)."""
    return _by_token_hash.forgotten()


def token_still_holds(request):
    """Whether the request's bearer token still names the subscriber it authenticated as, active:
    asked again by a request that waits (a long poll), since a rotation, deactivation or deletion
    during the wait must end it. From the kept rows: free unless something changed, and never
    older than MQ_REVOCATION_CHECK_SECS."""
    subscriber = subscriber_of(request)
    found = subscriber_for_token(bearer_token(request))
    return subscriber is not None and found is not None and found.pk == subscriber.pk


def bearer_token(request):
    """The token of an 'Authorization: Bearer <token>' header, or None."""
    parts = get_authorization_header(request).split()
    if len(parts) != 2 or parts[0].lower() != BearerTokenAuthentication.keyword:
        return None
    try:
        return parts[1].decode("ascii")
    except UnicodeDecodeError:
        return None


def forget_subscribers():
    """A subscriber changed (here or in another process): look tokens up again."""
    _by_token_hash.forget()


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
            token = None
        subscriber = subscriber_for_token(token) if token else None
        if subscriber is None:
            wait = auth_failed(request_client_address(request))
            if wait:
                raise exceptions.Throttled(wait, "Too many failed token attempts from this address.")
            raise exceptions.AuthenticationFailed("The token is not valid or its subscriber is inactive.")
        return SubscriberUser(subscriber), subscriber

    def authenticate_header(self, request):
        # Present so that DRF answers 401 (not 403) to a call without credentials.
        return 'Bearer realm="api"'


def subscriber_of(request):
    """The calling subscriber, or None for an operator."""
    return request.auth if isinstance(request.auth, Subscriber) else None


def operator_may(user, *perms):
    """Whether `user` is an operator: an active staff user (the admin's login) holding every one
    of `perms`, Django model permissions ("queues.add_message") as the admin asks them; a
    superuser holds them all. The one rule for every operator route (REST, the dashboard's
    socket): staff alone opens the admin's door, not every room behind it."""
    return bool(
        user is not None
        and getattr(user, "is_authenticated", False)
        and user.is_active
        and user.is_staff
        and (not perms or user.has_perms(perms))
    )


def is_operator(request, *perms):
    """The request is an operator's session (not a subscriber's token) holding `perms`."""
    return subscriber_of(request) is None and operator_may(request.user, *perms)


class IsSubscriber(permissions.BasePermission):
    message = "This call acts as a subscriber: send a subscriber's bearer token."

    def has_permission(self, request, view):
        return subscriber_of(request) is not None


class IsOperator(permissions.BasePermission):
    """An operator holding `perms` (none: any staff user; a route names what it shows or
    changes with operator_with)."""

    perms = ()

    @property
    def message(self):
        if not self.perms:
            return "Operators only: log in as a staff user."
        return f"Operators only: log in as a staff user with the permission {' and '.join(self.perms)}."

    def has_permission(self, request, view):
        return is_operator(request, *self.perms)


class IsSubscriberOrOperator(IsOperator):
    """A subscriber's token (the view checks its rights), or an operator holding `perms`."""

    @property
    def message(self):
        return f"This needs a subscriber token or an operator (staff) login{self._with()}."

    def _with(self):
        return f" with the permission {' and '.join(self.perms)}" if self.perms else ""

    def has_permission(self, request, view):
        return subscriber_of(request) is not None or is_operator(request, *self.perms)


def operator_with(*perms, subscribers_too=False):
    """A DRF permission class for a route operators reach only with these model permissions
    (`subscribers_too`: subscribers by token reach it as well, their rights checked by the view)."""
    base = IsSubscriberOrOperator if subscribers_too else IsOperator
    return type(f"{base.__name__}With", (base,), {"perms": tuple(perms)})
