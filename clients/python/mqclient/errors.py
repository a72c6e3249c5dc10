"""The server's refusals as exceptions: its status, a short code and its own words.

REST errors are `{"detail": "...", "code": "..."}` (field errors beside them); socket errors
are `error` frames with a `code` and a `detail`. Both end up here, so a caller catches one
family whichever way the client talked to the server.
"""

from __future__ import annotations

import email.utils
import time
from typing import Any


class MQError(Exception):
    """Anything the server refused, or could not be reached for (`status` None then)."""

    def __init__(self, status: int | None, code: str, detail: str) -> None:
        super().__init__(f"{status or '-'} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class MQBadRequest(MQError):
    """400 (malformed body, bad name), 413 (too large) or 422."""


class MQSchemaMismatch(MQBadRequest):
    """400 `schema_mismatch` (or a socket's error frame of that code): a payload fails its
    event's JSON Schema and nothing was published. `errors` lists the failures, each
    `{"index": the message's place in the batch (0 for one), "path": a JSON pointer into its
    payload, "message": the rule it breaks}`."""

    def __init__(self, status: int | None, code: str, detail: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(status, code, detail)
        self.errors = errors


class MQAuthError(MQError):
    """401, or a socket closed with 4401: no token, or one that is not valid."""


class MQForbidden(MQError):
    """403: the subscriber may not publish to or subscribe to that queue."""


class MQNotFound(MQError):
    """404: no such queue, or not the caller's object."""


class MQThrottled(MQError):
    """429 (a socket: 4429 or a `rate_limited` frame): try again after `retry_after` seconds
    (None when the server did not say)."""

    def __init__(self, status: int | None, code: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(status, code, detail)
        self.retry_after = retry_after


class MQRedirectError(MQError):
    """A 3xx the client did not follow: to another origin (scheme, host, port), where its token
    must not go, or any redirect of a REST call. `status` is the 3xx; `code` is
    `cross_origin_redirect` or `redirect`."""


class InsecureURLWarning(UserWarning):
    """The client was given an http:// URL of a host other than loopback: its token (and every
    payload) crosses the network in clear text. Use https://."""


class MQConnectionError(MQError):
    """The server could not be reached, or went away during the call (no status)."""


# Codes for answers whose body names none (DRF's bodies carry only words).
_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "too_large",
    422: "unprocessable",
    429: "throttled",
    503: "unavailable",
}

_CLASSES: dict[int, type[MQError]] = {
    400: MQBadRequest,
    401: MQAuthError,
    403: MQForbidden,
    404: MQNotFound,
    413: MQBadRequest,
    422: MQBadRequest,
    429: MQThrottled,
}

# The socket's error frame codes, as the REST status each stands for.
_FRAME_STATUS = {
    "unauthenticated": 401,
    "forbidden": 403,
    "not_found": 404,
    "not_subscribed": 404,
    "bad_json": 400,
    "bad_frame": 400,
    "bad_name": 400,
    "unknown_type": 400,
    "too_large": 413,
    "schema_mismatch": 400,
    "bad_filter": 400,
    "rate_limited": 429,
    "too_many_connections": 429,
    "too_many_new_events": 429,
    "too_many_subscriptions": 409,
}


def words_of(body: Any) -> str:
    """The server's words in an error body: its `detail`, or DRF's field errors as one line."""
    if isinstance(body, dict):
        if isinstance(body.get("detail"), str):
            return body["detail"]
        parts = []
        for field, problems in body.items():
            if isinstance(problems, list):
                problems = " ".join(str(p) for p in problems)
            parts.append(f"{field}: {problems}")
        return "; ".join(parts)
    if isinstance(body, list):
        return "; ".join(str(p) for p in body)
    return str(body)


def retry_after_of(value: str | None) -> float | None:
    """Seconds to wait, from a Retry-After header (seconds, or an HTTP date)."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def error_for_answer(status: int, body: Any, retry_after: str | None = None) -> MQError:
    """The exception for an HTTP answer that is not a success."""
    code = body.get("code") if isinstance(body, dict) and isinstance(body.get("code"), str) else None
    code = code or _CODES.get(status) or ("server_error" if status >= 500 else "error")
    detail = words_of(body) if body not in (None, "") else f"HTTP {status}"
    cls = _CLASSES.get(status, MQError)
    if cls is MQThrottled:
        return MQThrottled(status, code, detail, retry_after_of(retry_after))
    if code == "schema_mismatch":
        return MQSchemaMismatch(status, code, detail, _schema_errors(body))
    return cls(status, code, detail)


def error_for_frame(frame: dict[str, Any]) -> MQError:
    """The exception for a socket `error` frame."""
    code = str(frame.get("code") or "error")
    detail = str(frame.get("detail") or code)
    status = _FRAME_STATUS.get(code)
    cls = _CLASSES.get(status, MQError) if status else MQError
    if cls is MQThrottled:
        wait = frame.get("retry_after")
        return MQThrottled(status, code, detail, float(wait) if isinstance(wait, int | float) else None)
    if code == "schema_mismatch":
        return MQSchemaMismatch(status, code, detail, _schema_errors(frame))
    return cls(status, code, detail)


def _schema_errors(body: Any) -> list[dict[str, Any]]:
    errors = body.get("errors") if isinstance(body, dict) else None
    return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def error_for_close(code: int | None, reason: str = "") -> MQError | None:
    """The exception a socket's close code stands for, or None for an ordinary close."""
    if code == 4401:
        return MQAuthError(401, "unauthorized", reason or "The token was refused (socket closed with 4401).")
    if code == 4429:
        return MQThrottled(
            429, "throttled", reason or "Too many sockets or frames (socket closed with 4429)."
        )
    if code == 4403:
        return MQForbidden(403, "forbidden", reason or "Refused (socket closed with 4403).")
    return None
