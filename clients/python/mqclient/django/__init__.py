"""mqclient.django: publish from a Django project exactly when its transaction commits (an
outbox and its relay), model events from settings, and webhook handlers that run once.

    INSTALLED_APPS += ["mqclient.django"]
    MQ = {"URL": "http://127.0.0.1:8000", "TOKEN": "...", "WEBHOOK_SECRET": "whsec_..."}

The names below load their modules when first used, so that importing this package (as
INSTALLED_APPS does) needs no ready app registry."""

from __future__ import annotations

from typing import Any

__all__ = ["handler", "publish", "webhook_view"]


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
    """Write a message to the outbox of database `using` in the caller's transaction and return
    its row at once; the relay publishes it after the commit (outbox.publish)."""
    from .outbox import publish as write

    return write(
        queue,
        event,
        payload,
        headers=headers,
        group=group,
        delay_secs=delay_secs,
        ttl_secs=ttl_secs,
        using=using,
    )


def handler(queue: str, event: str | None = None) -> Any:
    """@handler("db", "create"): run the function for those deliveries (webhooks.handler)."""
    from .webhooks import handler as register

    return register(queue, event)


def webhook_view(request: Any) -> Any:
    """The webhook endpoint: path("mq/webhook/", mqclient.django.webhook_view)."""
    from .webhooks import webhook_view as view

    return view(request)


# The CSRF middleware reads this on the view the URLconf names: this wrapper.
webhook_view.csrf_exempt = True  # type: ignore[attr-defined]
