"""Limits in one place: how much of a shared server one client may take (issue 14).

Each rule names its setting and the error a client gets beyond it; the services count what they
own (presence its connections, subscribing its subscriptions, publishing its new events) and ask
here. Operators (the admin, manage.py) are never limited: the callers pass no subscriber then.

- frames a socket sends: MQ_WS_FRAME_RATE a second (5000) in bursts of MQ_WS_FRAME_BURST
  (10000); beyond, an error frame `rate_limited`; a socket refused for MQ_WS_ABUSE_SECS (5) on
  end is closed with 4429.
- sockets a subscriber holds open: MQ_MAX_CONNECTIONS_PER_SUBSCRIBER (64); beyond, an error
  frame `too_many_connections` and the close 4429.
- subscriptions a subscriber holds: MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER (256); beyond, 409 or
  an error frame `too_many_subscriptions`.
- replays under way at once (subscribe with `from`, seek): MQ_MAX_REPLAYS_PER_SUBSCRIBER (1);
  beyond, 429 with Retry-After or an error frame `too_many_replays`.
- event names a subscriber makes (publishing or subscribing): MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER
  an hour (100); beyond, 429 with Retry-After or an error frame `too_many_new_events`.
- sockets one client address holds open without a token yet (waiting to send `auth`), in each
  server process: MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS (64); beyond, an error frame
  `too_many_unauthenticated` and the close 4429. A socket with a token is never counted.
- receipts a subscriber's sockets in one process wait for at once:
  MQ_MAX_RECEIPTS_PER_SUBSCRIBER (10,000); beyond, an error frame `too_many_receipts`.
"""

import collections
import logging
import math
import time

from django.conf import settings
from django.core.cache import cache
from rest_framework import exceptions, status

log = logging.getLogger(__name__)

CLOSE_TOO_MANY = 4429  # a websocket close code mirroring HTTP's 429
NEW_EVENTS_WINDOW_SECS = 3600
# A socket's refusals are one stretch of abuse until this long passes without one: a client
# that bursts then calms down starts afresh.
ABUSE_GAP_SECS = 1.0


class LimitExceeded(exceptions.APIException):
    """Over one of the limits above. An APIException, so that a REST view answers it as it is
    (status, detail, Retry-After); the socket turns it into an error frame of `code`."""

    def __init__(self, code, detail, status_code, retry_after=None):
        super().__init__(detail, code)
        self.code, self.status_code, self.wait = code, status_code, retry_after


# --- counts a subscriber holds --------------------------------------------------------------------


def check_connections(open_now):
    """Before a subscriber's socket is recorded: `open_now` of its sockets are open already."""
    cap = settings.MQ_MAX_CONNECTIONS_PER_SUBSCRIBER
    if open_now >= cap:
        raise LimitExceeded(
            "too_many_connections",
            f"This subscriber has {open_now} sockets open, the most MQ_MAX_CONNECTIONS_PER_SUBSCRIBER "
            f"({cap}) allows; close one first.",
            status.HTTP_429_TOO_MANY_REQUESTS,
        )


def check_subscriptions(held_now):
    """Before a new subscription is made (reusing one is always fine)."""
    cap = settings.MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER
    if held_now >= cap:
        raise LimitExceeded(
            "too_many_subscriptions",
            f"This subscriber holds {held_now} subscriptions, the most "
            f"MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER ({cap}) allows; delete one first.",
            status.HTTP_409_CONFLICT,
        )


# A replay of tens of thousands of rows takes about a second or two (its chunks, with others'
# writes between them): try again after that.
REPLAY_RETRY_AFTER_SECS = 2


def check_replays(under_way_now):
    """Before a replay starts: `under_way_now` of the subscriber's replays are under way."""
    cap = settings.MQ_MAX_REPLAYS_PER_SUBSCRIBER
    if under_way_now >= cap:
        raise LimitExceeded(
            "too_many_replays",
            f"This subscriber has {under_way_now} replays under way, the most "
            f"MQ_MAX_REPLAYS_PER_SUBSCRIBER ({cap}) allows; try again when they are done.",
            status.HTTP_429_TOO_MANY_REQUESTS,
            retry_after=REPLAY_RETRY_AFTER_SECS,
        )


def check_not_busy(busy_since):
    """Before a replay of a subscription starts: none of it (nor an unsubscribe) is under way."""
    if busy_since is not None:
        raise LimitExceeded(
            "replay_under_way",
            "A replay (or an unsubscribe) of this subscription is under way; try again when it is done.",
            status.HTTP_429_TOO_MANY_REQUESTS,
            retry_after=REPLAY_RETRY_AFTER_SECS,
        )


def check_receipts(waiting_now, more):
    """Before a publish frame that wants `more` receipts: the subscriber's sockets in this
    process wait for `waiting_now` already (each a row of the registry and of the recheck's
    query, delivery.receipts)."""
    cap = settings.MQ_MAX_RECEIPTS_PER_SUBSCRIBER
    if waiting_now + more > cap:
        raise LimitExceeded(
            "too_many_receipts",
            f"This subscriber's sockets already wait for {waiting_now} receipts, and "
            f"MQ_MAX_RECEIPTS_PER_SUBSCRIBER allows {cap} at once; this frame wants {more} more. "
            "Nothing was published.",
            status.HTTP_429_TOO_MANY_REQUESTS,
        )


# --- new event names, per hour ----------------------------------------------------------------------


def charge_new_events(counts):
    """Count the event names subscribers are about to make ({subscriber id: how many}) in the
    hour's window of the cache. When one of them would pass MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER,
    nothing is counted and LimitExceeded says so (the caller makes nothing). Each event name
    is a row and a label of /metrics for as long as its queue lives."""
    cap = settings.MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER
    now = time.time()
    window = int(now // NEW_EVENTS_WINDOW_SECS)
    charged, over = [], None
    try:
        for subscriber_id, count in counts.items():
            if count <= 0:
                continue
            key = f"limits:new-events:{subscriber_id}:{window}"
            cache.add(key, 0, timeout=NEW_EVENTS_WINDOW_SECS + 1)
            made = cache.incr(key, count)  # atomic: two publishers at once both count
            charged.append((key, count))
            if made > cap:
                over = made - count
                break
        if over is None:
            return
        for key, count in charged:  # refused: none of them is made
            cache.decr(key, count)
    except Exception:
        # The cache (Redis) is down, or the window ended between add and incr: let the
        # publish through, as the request throttle does. A cap, not an exact count.
        log.warning("limits cache unavailable; not counting new event names", exc_info=True)
        return
    retry_after = math.ceil((window + 1) * NEW_EVENTS_WINDOW_SECS - now)
    raise LimitExceeded(
        "too_many_new_events",
        f"This subscriber made {over} new event names in this hour, and "
        f"MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER allows {cap}: use existing events, or try "
        f"again in {retry_after} s. Nothing was done.",
        status.HTTP_429_TOO_MANY_REQUESTS,
        retry_after=retry_after,
    )


# --- sockets not authenticated yet --------------------------------------------------------------


class Unauthenticated:
    """The sockets of this process waiting for their `auth` frame, counted by client address:
    each costs a connection and its AUTH_WAIT_SECS, and no token is at stake for it."""

    def __init__(self):
        self.by_address = collections.Counter()

    def admit(self, address):
        cap = settings.MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS
        if self.by_address[address] >= cap:
            raise LimitExceeded(
                "too_many_unauthenticated",
                f"This address has {cap} sockets open that have not sent their auth frame, the most "
                "MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS allows: authenticate those, or put the token "
                "in the URL or an Authorization header.",
                status.HTTP_429_TOO_MANY_REQUESTS,
            )
        self.by_address[address] += 1

    def release(self, address):
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


unauthenticated = Unauthenticated()


# --- frames a socket sends ----------------------------------------------------------------------


class FrameRate:
    """A socket's token bucket: MQ_WS_FRAME_RATE frames a second, MQ_WS_FRAME_BURST at once.

    take() answers None for a frame to process, else the seconds until one would be; `abusive`
    says that the socket has been refused frames for MQ_WS_ABUSE_SECS on end (no pause of
    ABUSE_GAP_SECS between refusals), the one case where it is closed."""

    def __init__(self, rate=None, burst=None, abuse_secs=None, clock=time.monotonic):
        self.rate = float(rate if rate is not None else settings.MQ_WS_FRAME_RATE)
        self.burst = float(burst if burst is not None else settings.MQ_WS_FRAME_BURST)
        self.abuse_secs = abuse_secs if abuse_secs is not None else settings.MQ_WS_ABUSE_SECS
        self.clock = clock
        self.tokens, self.at = self.burst, clock()
        self.refused_since = self.last_refused = None
        self.wait = None  # the last take()'s answer
        self.closed = False  # the socket is being closed for abuse: refuse without answering

    def take(self):
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            self.wait = None
            return None
        if self.last_refused is None or now - self.last_refused >= ABUSE_GAP_SECS:
            self.refused_since = now
        self.last_refused = now
        self.wait = (1 - self.tokens) / self.rate
        return self.wait

    @property
    def abusive(self):
        return self.refused_since is not None and self.last_refused - self.refused_since >= self.abuse_secs
