"""How many long polls (GET /api/deliveries with wait > 0) a subscriber has waiting at once.

A waiting poll holds a thread of its server and looks at the ledger every recheck, so one
token must not be able to open hundreds (issue 14). The cap is MQ_MAX_LONG_POLLS per
subscriber. With Redis it holds across every server process: one sorted set per subscriber,
each waiting poll a member whose score is the moment it will have ended for sure (its wait
plus a margin), so a poll of a process killed mid-wait stops counting by itself then; the
check-and-take is one Lua script, atomic however many processes ask at once. Without Redis
(the embedded mode: one server process) a counter in the process does the same.

A poll whose token is revoked while it waits (rotated, its subscriber deactivated or deleted)
ends with 401 and keeps nothing leased after the revocation: the announcement wakes it
(delivery.revocation), it asks its token again before each lease, and a lease that raced an
announcement is given back before it answers (wait_for_deliveries).
"""

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import Counter

from django.conf import settings
from rest_framework import exceptions, status

from mqsite import bus, limits
from subscribers import auth

from . import frames, ledger, liveness, wakeups

log = logging.getLogger(__name__)

# A poll answers at most this long after its wait (one recheck and a lease): past it, a slot
# still taken belongs to a poll whose process died.
SLOT_MARGIN_SECS = 10
# What a refused poll is told: polls end as soon as a delivery comes, so a slot frees often.
RETRY_AFTER_SECS = 1

_lock = threading.Lock()
_held = Counter()  # subscriber id -> waiting polls of this process (without Redis)

# KEYS[1] the subscriber's set; ARGV: now, cap, this poll's member, its expiry.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[4])))
return 1
"""


class TooManyLongPolls(limits.LimitExceeded):
    """The subscriber already has MQ_MAX_LONG_POLLS waiting: 429 with Retry-After, as every
    limit of mqsite.limits is answered."""

    def __init__(self, cap):
        super().__init__(
            "too_many_long_polls",
            f"This subscriber already has {cap} long polls waiting (MQ_MAX_LONG_POLLS); "
            "wait for one to answer, or pull with wait=0.",
            status.HTTP_429_TOO_MANY_REQUESTS,
            retry_after=RETRY_AFTER_SECS,
        )


# While waiting, look at the ledger at least this often even without a wake-up: a wake-up
# from another process, or one that was lost, costs at most this much latency.
RECHECK_SECS = 0.5


class Revoked(exceptions.AuthenticationFailed):
    default_detail = (
        "The token was revoked while the poll waited (rotated, or its subscriber deactivated or deleted)."
    )


def wait_for_deliveries(request, lease, wait_secs, between_leases):
    """Lease with `lease(holder)` until it gives something, `wait_secs` pass or the server
    stops, waiting for a wake-up between tries (`between_leases()` first, which may give back
    the database connection). Revoked (401) once the request's token no longer holds.

    The race it closes: a poll that asked its token just before a revocation was announced,
    then leased a delivery published just after it. Every process forgets its kept
    subscribers before the announcement returns, so a publish that follows it moves
    auth.subscribers_forgotten() before the lease that sees its deliveries: a lease made while
    that count moved asks the token again, and gives back what it leased if it is revoked
    (the attempt not counted: it never reached the client)."""
    subscriber_id = auth.subscriber_of(request).pk
    holder = liveness.holder(f"poll.{uuid.uuid4().hex[:12]}")  # its own: to give back only its lease

    def lease_unless_revoked():
        forgotten = auth.subscribers_forgotten()
        if not auth.token_still_holds(request):
            raise Revoked()
        leased = lease(holder)
        if leased and auth.subscribers_forgotten() != forgotten and not auth.token_still_holds(request):
            ledger.release_held([holder], reason=frames.REVOKED)
            raise Revoked()
        return leased

    # A poll with something ready is answered at once and never waits: it needs no slot
    # (two Redis round trips, a third of a prompt consumer's pull). Only one that found
    # nothing takes one; its loop reads the wake-up count before leasing again, so a
    # delivery that came in between is not missed.
    leased = lease_unless_revoked()
    if leased or wait_secs <= 0:
        return leased
    with slot(subscriber_id, wait_secs):
        return wakeups.lease_when_woken(
            subscriber_id, lease_unless_revoked, time.monotonic() + wait_secs, between_leases, RECHECK_SECS
        )


@functools.cache
def _take_script():
    return bus.client().register_script(_TAKE)


def _key(subscriber_id):
    return f"mq:longpolls:{subscriber_id}"


@contextlib.contextmanager
def slot(subscriber_id, wait_secs):
    """Hold one of the subscriber's long-poll slots for the body; TooManyLongPolls if none is free."""
    cap = settings.MQ_MAX_LONG_POLLS
    client = bus.client()
    if client is None:
        with _lock:
            if _held[subscriber_id] >= cap:
                raise TooManyLongPolls(cap)
            _held[subscriber_id] += 1
        try:
            yield
        finally:
            with _lock:
                _held[subscriber_id] -= 1
                if not _held[subscriber_id]:
                    del _held[subscriber_id]
        return
    key, member, now = _key(subscriber_id), uuid.uuid4().hex, time.time()
    try:
        taken = _take_script()(keys=[key], args=[now, cap, member, now + wait_secs + SLOT_MARGIN_SECS])
    except Exception:  # Redis is down: serve the poll rather than refuse every one
        log.warning("long-poll slots unavailable; not capping", exc_info=True)
        taken = None
    if taken == 0:
        raise TooManyLongPolls(cap)
    try:
        yield
    finally:
        if taken:
            try:
                client.zrem(key, member)
            except Exception:  # it expires by its score anyway
                log.warning("could not give back a long-poll slot", exc_info=True)
