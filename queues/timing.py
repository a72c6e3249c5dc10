"""When a message may be handed out, and until when: `deliver_at` / `delay_secs` (a delayed
message) and `expires_at` / `ttl_secs` (expiry), as the API's Extensions section states them.

Checked here once, for every way in (REST, the socket, `manage.py publish`, the admin), into
two absolute times stored on the message (queues.Message): its deliveries are made ready at
`deliver_at` (delivery.ledger.owed_insert) and are dead with the reason `expired` once
`expires_at` passes unacked. A queue's default `ttl_secs` applies where a message names no
expiry (stored_times, at publish, where the queue is known).

A TTL counts from when the message falls due (its `deliver_at`, or its publish): a delayed
message in a queue with a default TTL still gets the whole TTL to be delivered, rather than
expire before it is ever handed out. Relative ones (delay_secs, ttl_secs) count from the
publish's own time (stored_times), the message's created_at.
"""

from datetime import UTC, timedelta
from typing import NamedTuple

from django.utils import timezone

from mqsite import values
from mqsite.values import iso_time

MAX_DELAY_SECS = 7 * 24 * 3600  # "at most 7 days ahead"
MAX_TTL_SECS = 365 * 24 * 3600  # an expiry at most a year after the message falls due
MAX_TIME_CHARS = values.MAX_TIME_CHARS

BAD_DELAY = "bad_delay"  # the error code of a bad deliver_at / delay_secs (REST and socket)
BAD_EXPIRY = "bad_expiry"  # of a bad expires_at / ttl_secs

# The fields, in the order a message's description lists them.
FIELDS = ("deliver_at", "delay_secs", "expires_at", "ttl_secs")


class BadTiming(ValueError):
    """A deliver_at / delay_secs / expires_at / ttl_secs that cannot be published as given (the
    caller answers 400 with `code`, naming `field`)."""

    def __init__(self, code, field, detail):
        super().__init__(detail)
        self.code, self.field, self.detail = code, field, detail


class Timing(NamedTuple):
    """A publish item's timing as checked: absolute times (aware UTC datetimes) and relative
    ones (seconds), each None when not given. Relative ones count from the publish itself
    (stored_times), so that a TTL is exactly that long after the message's created_at."""

    deliver_at: object = None
    expires_at: object = None
    delay_secs: float | None = None
    ttl_secs: float | None = None


NO_TIMING = Timing()


def stored_times(timing, now, default_ttl=None):
    """(deliver_at, expires_at) to store for a message published at `now` with `timing`, its
    queue's default TTL `default_ttl` (seconds; None: none) applying where it names no expiry.
    A deliver_at not after `now` is no delay (None)."""
    if timing == NO_TIMING and not default_ttl:
        return None, None
    due = timing.deliver_at
    if timing.delay_secs is not None:
        due = now + timedelta(seconds=timing.delay_secs)
    if due is not None and due <= now:
        due = None
    expires = timing.expires_at
    ttl = timing.ttl_secs if timing.ttl_secs is not None else (None if expires is not None else default_ttl)
    if ttl:
        expires = (due or now) + timedelta(seconds=ttl)
    return due, expires


def timing_of(deliver_at=None, delay_secs=None, expires_at=None, ttl_secs=None, now=None):
    """The Timing of a publish item's four optional fields (absent and null alike: not given),
    checked at `now`. BadTiming says what is wrong.

    A deliver_at not after `now` is no delay (None): the message is due at once, and its
    latency counts from its publish. An expiry must come after the message falls due."""
    if deliver_at is None and delay_secs is None and expires_at is None and ttl_secs is None:
        return NO_TIMING  # the usual publish: nothing to read
    now = now or timezone.now()
    if deliver_at is not None and delay_secs is not None:
        raise BadTiming(BAD_DELAY, "deliver_at", "Give deliver_at or delay_secs, not both.")
    if expires_at is not None and ttl_secs is not None:
        raise BadTiming(BAD_EXPIRY, "expires_at", "Give expires_at or ttl_secs, not both.")
    due = delay = ttl = None
    if delay_secs is not None:
        delay = _seconds(delay_secs, BAD_DELAY, "delay_secs", 0, MAX_DELAY_SECS)
        due = now + timedelta(seconds=delay)
    elif deliver_at is not None:
        due = _time(deliver_at, BAD_DELAY, "deliver_at")
        if due > now + timedelta(seconds=MAX_DELAY_SECS):
            raise BadTiming(BAD_DELAY, "deliver_at", "deliver_at may be at most 7 days ahead.")
    if due is not None and due <= now:
        due = None  # in the past (or now): no delay
    start = due or now
    expiry = None
    if ttl_secs is not None:
        ttl = _seconds(ttl_secs, BAD_EXPIRY, "ttl_secs", 0, MAX_TTL_SECS)
        if ttl <= 0:
            raise BadTiming(BAD_EXPIRY, "ttl_secs", "ttl_secs must be more than 0.")
    elif expires_at is not None:
        expiry = _time(expires_at, BAD_EXPIRY, "expires_at")
        if expiry <= start:
            when = "its deliver_at" if due is not None else "now"
            raise BadTiming(BAD_EXPIRY, "expires_at", f"expires_at must be after {when}.")
        if expiry > start + timedelta(seconds=MAX_TTL_SECS):
            raise BadTiming(BAD_EXPIRY, "expires_at", "expires_at may be at most a year after it falls due.")
    return Timing(None if delay is not None else due, expiry, delay, ttl)


def _seconds(value, code, field, low, high):
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:  # NaN
        raise BadTiming(code, field, f"{field} must be a number of seconds.")
    if not low <= value <= high:
        raise BadTiming(code, field, f"{field} must be from {low} to {high} seconds.")
    return value


def _time(text, code, field):
    """An ISO 8601 time as an aware UTC datetime (without an offset: UTC, as replay's times)."""
    when = iso_time(text)
    if when is None:
        raise BadTiming(
            code, field, f'{field} must be an ISO 8601 date and time, e.g. "2026-11-24T14:00:00Z".'
        )
    try:
        return when.astimezone(UTC)
    except OverflowError:  # year 1 with a positive offset, year 9999 with a negative one
        raise BadTiming(code, field, f"{field} is out of range.") from None
