"""Sans-IO: each REST call of the contract as a request to send and a way to read its answer.

`Client` (httpx.Client) and `AsyncClient` (httpx.AsyncClient) only carry these requests, so
what each call sends and how its answer is read is written once, here.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

from .answers import Acked, Extended, Published, Receipt, Subscription
from .errors import MQBadRequest, MQRedirectError, error_for_answer

# A long poll may wait this long on the server (the contract's cap); the request's own timeout
# is that plus the client's timeout.
MAX_WAIT_SECS = 30


@dataclass(frozen=True)
class Call:
    """One request, and how its answer becomes the method's result."""

    method: str
    path: str
    read: Callable[[Any], Any]
    body: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    extra_timeout: float = 0.0  # a long poll's wait, beyond the client's timeout
    has_body: bool = False


def base_urls(url: str) -> tuple[str, str]:
    """(REST base, socket URL) from the server's base URL `http(s)://host:port[/prefix]`."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"url must be the server's base URL, http(s)://host:port, not {url!r}")
    prefix = parts.path.rstrip("/")
    rest = urlunsplit((parts.scheme, parts.netloc, f"{prefix}/api/", "", ""))
    socket = urlunsplit(("wss" if parts.scheme == "https" else "ws", parts.netloc, f"{prefix}/ws/", "", ""))
    return rest, socket


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, ws and http alike (a socket's origin is its server's)."""
    parts = urlsplit(url)
    secure = parts.scheme in ("https", "wss")
    return (
        "https" if secure else "http",
        (parts.hostname or "").lower(),
        parts.port or (443 if secure else 80),
    )


def is_loopback(host: str) -> bool:
    """localhost, *.localhost, 127.0.0.0/8 or ::1: a host whose traffic never leaves the machine
    (names are not resolved: a name that merely points at 127.0.0.1 counts as remote)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sends_token_in_clear(url: str) -> bool:
    """True when the token would cross a network unencrypted: http/ws to a host not loopback."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "ws") and not is_loopback(parts.hostname or "")


def redirect_error(
    url: str, status: int, location: str | None, *, same_origin_ok: bool
) -> MQRedirectError | None:
    """The refusal of a redirect from `url`, or None when it may be followed (same origin, and
    `same_origin_ok`). The token goes only to the origin the client was given: a redirect
    elsewhere (a hijacked DNS name, a misconfigured proxy) would hand it to another host."""
    if not location:
        return MQRedirectError(status, "redirect", f"The server at {url} answered {status} with no Location.")
    target = urljoin(url, location)
    if origin(target) != origin(url):
        return MQRedirectError(
            status,
            "cross_origin_redirect",
            f"The server at {url} redirected ({status}) to another origin, {target}: not followed, "
            "so that the token is not sent there. Give the client the server's own URL.",
        )
    if same_origin_ok:
        return None
    return MQRedirectError(
        status,
        "redirect",
        f"The server at {url} redirected ({status}) to {target}: REST calls follow no redirect "
        "(a POST would not survive one). Give the client the server's own URL.",
    )


def headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Accept": "application/json"}


def encode(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def read_answer(status: int, content: bytes, retry_after: str | None) -> Any:
    """The parsed body of a success; raises the MQError of anything else."""
    try:
        body = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    if 200 <= status < 300:
        return body
    raise error_for_answer(status, body, retry_after)


def _name(value: str) -> str:
    return quote(str(value), safe="")


def _message(
    event: str,
    payload: Any,
    key: str | None,
    headers: dict[str, str] | None,
    group: str | None = None,
    **timing: Any,
) -> dict[str, Any]:
    item: dict[str, Any] = {"event": event, "payload": payload}
    if key is not None:
        item["key"] = key
    if headers is not None:
        item["headers"] = headers
    if group is not None:
        item["group"] = group
    # deliver_at / delay_secs (a delayed message), expires_at / ttl_secs (expiry): the server
    # checks them (both of a pair at once is a 400). A datetime goes as ISO 8601 (naive: UTC).
    for name, value in timing.items():
        if value is not None:
            item[name] = value.isoformat() if isinstance(value, datetime) else value
    return item


def _same(body: Any) -> Any:
    return body


def publish(
    queue: str,
    event: str,
    payload: Any,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    group: str | None = None,
    **timing: Any,
) -> Call:
    return Call(
        "POST",
        f"queues/{_name(queue)}/messages",
        Published,
        _message(event, payload, key, headers, group, **timing),
        has_body=True,
    )


def publish_many(queue: str, messages: Iterable[Sequence[Any] | dict[str, Any]]) -> Call:
    items = []
    for index, m in enumerate(messages):
        if isinstance(m, dict):
            items.append(m)
        elif isinstance(m, tuple | list) and len(m) in (2, 3):
            items.append(_message(m[0], m[1], m[2] if len(m) == 3 else None, None))
        else:
            raise MQBadRequest(None, "bad_request", f"messages[{index}] must be (event, payload) or a dict")
    return Call(
        "POST",
        f"queues/{_name(queue)}/messages",
        lambda body: [Published(m) for m in body["messages"]],
        {"messages": items},
        has_body=True,
    )


def point(start: Any) -> Any:
    """A replay's start as the contract takes it: "new", "all", a seq (an int) or a time (a
    datetime, naive: UTC; or an ISO 8601 string), or already {"seq": N} / {"time": ...}."""
    if isinstance(start, bool):
        raise ValueError(f"a replay starts from 'new', 'all', a seq or a time, not {start!r}")
    if isinstance(start, int):
        return {"seq": start}
    if isinstance(start, datetime):
        return {"time": start.isoformat()}
    if isinstance(start, str) and start not in ("new", "all"):
        return {"time": start}
    return start


def subscribe(
    queue: str,
    event: str | None = None,
    filter: dict[str, list[Any]] | None = None,  # noqa: A002
    start: Any = None,
) -> Call:
    """Without a filter the body names none: an existing subscription keeps its own."""
    body: dict[str, Any] = {"queue": queue, "event": event}
    if filter is not None:
        body["filter"] = filter
    if start is not None:
        body["from"] = point(start)
    return Call("POST", "subscriptions", Subscription, body, has_body=True)


def seek(subscription_id: int | dict[str, Any], start: Any) -> Call:
    """Owe again what the subscription's queue holds from `start` (a seq or a time)."""
    if isinstance(subscription_id, dict):  # the answer of subscribe()
        subscription_id = subscription_id["id"]
    body = point(start)
    if not isinstance(body, dict):
        raise ValueError(f"seek goes to a seq or a time, not {start!r}")
    return Call(
        "POST", f"subscriptions/{_name(str(subscription_id))}/seek", Subscription, body, has_body=True
    )


def receipt(message_id: int | dict[str, Any]) -> Call:
    """A message's deliveries counted by state (its publisher or an operator)."""
    if isinstance(message_id, dict):  # the answer of publish()
        message_id = message_id["id"]
    return Call("GET", f"messages/{_name(str(message_id))}", Receipt)


def set_filter(subscription_id: int | dict[str, Any], filter: dict[str, list[Any]] | None) -> Call:  # noqa: A002
    """Set (None: clear) a subscription's filter: the subscription as it is now."""
    if isinstance(subscription_id, dict):  # the answer of subscribe()
        subscription_id = subscription_id["id"]
    return Call(
        "PATCH",
        f"subscriptions/{_name(str(subscription_id))}",
        Subscription,
        {"filter": filter},
        has_body=True,
    )


def route(queue: str, event: str, payload: Any, headers: dict[str, str] | None = None) -> Call:
    """Who would receive this message: nothing is published."""
    body: dict[str, Any] = {"event": event, "payload": payload}
    if headers is not None:
        body["headers"] = headers
    return Call(
        "POST", f"queues/{_name(queue)}/route", lambda body: body["subscriptions"], body, has_body=True
    )


def unsubscribe(subscription_id: int | dict[str, Any]) -> Call:
    if isinstance(subscription_id, dict):  # the answer of subscribe()
        subscription_id = subscription_id["id"]
    return Call("DELETE", f"subscriptions/{_name(str(subscription_id))}", lambda body: None)


def pause(subscription_id: int | dict[str, Any], paused: bool = True) -> Call:
    """Pause (or, with `paused` False, resume) a subscription: the subscription as it is now."""
    if isinstance(subscription_id, dict):  # the answer of subscribe()
        subscription_id = subscription_id["id"]
    verb = "pause" if paused else "resume"
    return Call("POST", f"subscriptions/{_name(str(subscription_id))}/{verb}", Subscription)


def pull(queue: str | None = None, event: str | None = None, limit: int = 100, wait: float = 0) -> Call:
    params: dict[str, Any] = {"limit": limit, "wait": wait}
    if queue is not None:
        params["queue"] = queue
    if event is not None:
        params["event"] = event
    wait_secs = min(max(float(wait), 0.0), MAX_WAIT_SECS)
    return Call("GET", "deliveries", lambda body: body["deliveries"], params=params, extra_timeout=wait_secs)


def ids_of(ids: Iterable[Any]) -> list[int]:
    """Delivery ids, from ids or from Delivery objects (anything with an `id`)."""
    if isinstance(ids, int) or hasattr(ids, "id"):
        ids = [ids]
    return [getattr(i, "id", i) for i in ids]


def ack(ids: Iterable[Any]) -> Call:
    return Call("POST", "deliveries/ack", Acked, {"ids": ids_of(ids)}, has_body=True)


def extend(ids: Iterable[Any], seconds: int) -> Call:
    """Move the ack deadline of the caller's in-flight deliveries to now + `seconds` (1 to
    43200): {"extended", "unknown"}."""
    return Call(
        "POST", "deliveries/extend", Extended, {"ids": ids_of(ids), "seconds": seconds}, has_body=True
    )


def nack(delivery_id: Any, retry_in: float | None = None, error: str | None = None) -> Call:
    body: dict[str, Any] = {}
    if retry_in is not None:
        body["retry_in"] = retry_in
    if error is not None:
        body["error"] = clean_error(error)
    delivery_id = getattr(delivery_id, "id", delivery_id)
    return Call("POST", f"deliveries/{_name(str(delivery_id))}/nack", _same, body, has_body=True)


# The server keeps at most this much of a nack's reason (its last_error).
MAX_ERROR_CHARS = 1000


def clean_error(text: str) -> str:
    """A nack's reason as the server stores it: no NUL, no lone surrogate, at most 1000 chars."""
    text = str(text).replace("\x00", "")
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:MAX_ERROR_CHARS]
