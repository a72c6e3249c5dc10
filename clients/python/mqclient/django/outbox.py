"""publish(): a row of the outbox, written in the caller's transaction. The relay sends it after
the commit; a rolled-back transaction takes its rows with it, so a message is published if and
only if the transaction that wrote it commits."""

from __future__ import annotations

import datetime
import threading
from typing import Any

from django.db import router, transaction
from django.utils import timezone

from . import tracing

# testing.captured() collects here instead of letting the relay send (a list per capture).
_captures: list[list[tuple[str, Any]]] = []
_captures_lock = threading.Lock()


def publish(
    queue: str,
    event: str,
    payload: Any,
    *,
    headers: dict[str, str] | None = None,
    group: str | None = None,
    delay_secs: float | None = None,
    ttl_secs: float | None = None,
    using: str | None = None,
) -> Any:
    """Write the message to the outbox of database `using` (the router's choice for the outbox
    by default) in the current transaction, and return the row at once."""
    from .models import OutboxMessage

    using = using or router.db_for_write(OutboxMessage)
    headers = tracing.with_trace_context(headers)
    deliver_at = None
    if delay_secs:
        deliver_at = timezone.now() + datetime.timedelta(seconds=delay_secs)
    row = OutboxMessage.objects.using(using).create(
        queue=queue,
        event=event,
        payload=payload,
        headers=headers or None,
        group=group,
        deliver_at=deliver_at,
        ttl_secs=ttl_secs,
    )
    with _captures_lock:
        capturing = bool(_captures)
        for capture in _captures:
            capture.append((using, row.key))
    if not capturing:
        from . import relay

        transaction.on_commit(lambda: relay.kick(using), using=using)
    return row
