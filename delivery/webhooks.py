"""Posting a delivery to a subscriber's webhook: Standard Webhooks signatures, the SSRF guard
(mqsite.ssrf), a 10 s deadline for the whole post, a capped read, no redirects. No database work
here (slow I/O stays outside transactions); delivery.tasks leases before and acks or fails after.
"""

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlunsplit

import httpx
from django.conf import settings
from rest_framework.utils.encoders import JSONEncoder
from standardwebhooks import Webhook

from mqsite.ssrf import UnsafeURL, resolve_safe
from mqsite.workarounds import httpx_deadline

MAX_RESPONSE_BYTES = 64 * 1024  # what we read of an answer: enough for an error message
USER_AGENT = "mqsite-webhooks/1"


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status: int | None = None
    error: str = ""
    duration_ms: int = 0
    # Looks permanent (for operators only; retries follow the contract all the same): a 4xx
    # other than 408 and 429, or a URL we refuse. 5xx, 408, 429, timeouts and connection
    # errors look transient.
    permanent: bool = False


def looks_permanent(status):
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def make_client():
    """An httpx client for webhook posts: every socket operation bounded by the post's deadline.
    httpx takes no network backend, so its transport's pool is made here with ours."""
    return httpx.Client(transport=httpx_deadline.transport(), follow_redirects=False, trust_env=False)


def timeout_secs():
    return settings.MQ_WEBHOOK_TIMEOUT_SECS


def body_of(frame):
    return json.dumps(frame, cls=JSONEncoder, separators=(",", ":"))


# The most of an endpoint's words a log line shows (its error is kept whole in the ledger).
LOGGED_ERROR_CHARS = 200


def loggable(error, limit=LOGGED_ERROR_CHARS):
    """An attempt's error as a log line may carry it: escaped as a Python literal, since the
    endpoint wrote part of it (a CR or LF in its answer would forge log lines, an escape code
    would drive the terminal that reads them), and cut at `limit` characters."""
    cut = error[:limit]
    return repr(cut) + (f" (+{len(error) - len(cut)} chars)" if len(error) > limit else "")


# W3C Trace Context: a message's trace goes on as HTTP headers too, so that a receiver's tracing
# (OpenTelemetry's instrumentation of its web framework) continues it without reading the body.
TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(frame):
    """The message's traceparent and tracestate, when it has them, as HTTP headers. Values that
    HTTP cannot carry (a CR, an LF, a NUL: only the message's own rules checked them) are left
    out rather than fail the post."""
    carried = frame.get("headers") or {}
    return {
        name: value
        for name in TRACE_HEADERS
        if isinstance(value := carried.get(name), str) and value.isprintable() and value.isascii()
    }


def sign(secrets, msg_id, timestamp, body):
    """`webhook-signature` per Standard Webhooks: v1,base64(HMAC-SHA256("id.ts.body")), one for
    each secret (a string, or several: the new and the previous one while a rotation's grace
    lasts), space-separated; a receiver accepts the post when any of them is its secret's."""
    at = datetime.fromtimestamp(timestamp, UTC)
    if isinstance(secrets, str):
        secrets = [secrets]
    return " ".join(Webhook(secret).sign(msg_id, at, body) for secret in secrets)


def post(url, secrets, frame, client=None):
    """POST the message frame, signed with `secrets` (sign()); a 2xx answer within the deadline
    (connect, headers and body) is success, anything else a failed attempt."""
    started = time.monotonic()
    limit = timeout_secs()
    with httpx_deadline.deadline(started + limit):
        return _post(url, secrets, frame, client, started, limit)


def _post(url, secrets, frame, client, started, limit):
    msg_id = str(frame["id"])
    timestamp = int(time.time())
    body = body_of(frame)
    try:
        parts, port, address = resolve_safe(url)
    except UnsafeURL as exc:
        return Outcome(False, error=f"refused: {exc}", permanent=True)
    # Connect to the checked address; the Host header and TLS name stay the URL's host.
    host = f"[{address}]" if address.version == 6 else str(address)
    target = urlunsplit((parts.scheme, f"{host}:{port}", parts.path or "/", parts.query, ""))
    headers = {
        "Host": parts.netloc.rsplit("@", 1)[-1],
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secrets, msg_id, timestamp, body),
        **trace_headers(frame),
    }
    own_client = client is None
    client = client or make_client()
    left = max(httpx_deadline.time_left(limit), 0)
    try:
        with client.stream(
            "POST",
            target,
            content=body.encode(),
            headers=headers,
            extensions={"sni_hostname": parts.hostname, "timeout": dict.fromkeys(TIMEOUT_KINDS, left)},
        ) as response:
            head = b""
            for chunk in response.iter_bytes():
                head += chunk
                if len(head) >= MAX_RESPONSE_BYTES:
                    break
        ms = int((time.monotonic() - started) * 1000)
        if 200 <= response.status_code < 300:
            return Outcome(True, response.status_code, duration_ms=ms)
        text = head[:200].decode("utf-8", "replace")
        status = response.status_code
        return Outcome(False, status, f"HTTP {status}: {text}", ms, permanent=looks_permanent(status))
    except httpx.HTTPError as exc:
        ms = int((time.monotonic() - started) * 1000)
        error = f"{exc.__class__.__name__}: {exc}"
        if isinstance(exc, httpx.TimeoutException):
            error = f"{exc.__class__.__name__}: no complete answer within {limit:g} s ({exc})"
        return Outcome(False, error=error[:500], duration_ms=ms)
    finally:
        if own_client:
            client.close()


TIMEOUT_KINDS = ("connect", "read", "write", "pool")
