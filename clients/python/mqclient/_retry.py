"""Retrying a publish that carries an idempotency key, on a connection error or a 503 (a server
restarting, a proxy with no backend yet), with jittered exponential backoff (tenacity).

Only keyed publishes: the server answers the same key again with the first message and
delivers nothing new, so a retry after a lost answer cannot duplicate. A publish without a key
is tried once: its answer lost, it may have been stored, and sending it again would store it
twice."""

from __future__ import annotations

import logging
from typing import Any

from tenacity import (
    AsyncRetrying,
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from .errors import MQConnectionError, MQError

log = logging.getLogger("mqclient")

# The first wait about FIRST_WAIT_SECS, doubling, at most MAX_WAIT_SECS: 4 attempts try for a
# few seconds, long enough for a server restart, short enough for a request handler.
DEFAULT_PUBLISH_ATTEMPTS = 4
FIRST_WAIT_SECS = 0.5
MAX_WAIT_SECS = 8.0


def is_transient(exc: BaseException) -> bool:
    """An error that trying again may mend: no answer at all, or 503."""
    return isinstance(exc, MQConnectionError) or (isinstance(exc, MQError) and exc.status == 503)


def _policy(attempts: int) -> dict[str, Any]:
    return {
        "retry": retry_if_exception(is_transient),
        "stop": stop_after_attempt(attempts),
        # FIRST_WAIT_SECS * 2**n, plus up to FIRST_WAIT_SECS of jitter, at most MAX_WAIT_SECS
        "wait": wait_exponential_jitter(
            multiplier=FIRST_WAIT_SECS, jitter=FIRST_WAIT_SECS, max=MAX_WAIT_SECS
        ),
        "before_sleep": before_sleep_log(log, logging.INFO),
        "reraise": True,  # the caller sees the MQError, not tenacity's RetryError
    }


def retrying(attempts: int) -> Retrying:
    return Retrying(**_policy(attempts))


def async_retrying(attempts: int) -> AsyncRetrying:
    return AsyncRetrying(**_policy(attempts))


def check_attempts(attempts: Any) -> int:
    if type(attempts) is not int or attempts < 1:
        raise ValueError(f"publish_attempts must be a whole number, at least 1, not {attempts!r}")
    return attempts
