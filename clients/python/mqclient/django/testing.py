"""For the project's own tests: what a block of code put in the outbox, and a delivery handed
to a handler or to the webhook view as the server would post it."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from . import outbox


class Captured:
    """The messages put in the outbox inside captured(), as dicts (queue, event, payload,
    headers, group, ...): read when asked, so the rows of a rolled-back transaction are gone."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, Any]] = []  # (database, key): ids of rolled-back rows are reused

    @property
    def messages(self) -> list[dict[str, Any]]:
        from .models import OutboxMessage

        found = []
        for using, key in self.rows:
            row = OutboxMessage.objects.using(using).filter(key=key).first()
            if row is not None:
                found.append(
                    {
                        "queue": row.queue,
                        "event": row.event,
                        "payload": row.payload,
                        "headers": row.headers or {},
                        "group": row.group,
                        "deliver_at": row.deliver_at,
                        "ttl_secs": row.ttl_secs,
                    }
                )
        return found

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)


@contextlib.contextmanager
def captured() -> Iterator[Captured]:
    """`with captured() as sent: ...; assert sent.messages == [...]`: the rows are written as
    usual, but no relay thread is woken to send them."""
    capture = Captured()
    with outbox._captures_lock:
        outbox._captures.append(capture.rows)
    try:
        yield capture
    finally:
        with outbox._captures_lock:
            outbox._captures.remove(capture.rows)


_next_id = [10**12]


def frame_of(frame: dict[str, Any]) -> dict[str, Any]:
    """A complete message frame from the fields a test names (queue and event at least)."""
    _next_id[0] += 1
    full = {
        "type": "message",
        "id": _next_id[0],
        "message_id": _next_id[0],
        "seq": 1,
        "payload": None,
        "attempt": 1,
        "published_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "deliver_at": None,
        "expires_at": None,
        "group": None,
    }
    full.update(frame)
    return full


def deliver(handler_or_view: Callable[..., Any], frame: dict[str, Any], *, secret: str | None = None) -> Any:
    """Hand `frame` (its fields; the rest filled in) to a handler, called with the Delivery
    (its return value), or to a webhook view (csrf_exempt), posted signed with
    MQ["WEBHOOK_SECRET"] or `secret` as the server posts it (the response)."""
    from django.test import RequestFactory

    from . import conf, webhooks

    full = frame_of(frame)
    # A webhook view is csrf_exempt (the server has no CSRF token): mqclient's, or a project's
    # own that wraps it.
    if getattr(handler_or_view, "csrf_exempt", False):
        from standardwebhooks import Webhook

        body = json.dumps(full, separators=(",", ":"))
        now = int(time.time())
        signature = Webhook(secret or conf.need("WEBHOOK_SECRET")).sign(
            str(full["id"]), datetime.fromtimestamp(now, UTC), body
        )
        request = RequestFactory().post(
            "/mq/webhook/",
            data=body,
            content_type="application/json",
            headers={
                "webhook-id": str(full["id"]),
                "webhook-timestamp": str(now),
                "webhook-signature": signature,
            },
        )
        return handler_or_view(request)
    delivery = webhooks.delivery_of(full)
    return handler_or_view(delivery)
