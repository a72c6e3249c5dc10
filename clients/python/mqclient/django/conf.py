"""The project's MQ setting, read when used (so override_settings works in the project's tests),
with its defaults."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

DEFAULTS: dict[str, Any] = {
    "URL": None,
    "TOKEN": None,
    "TIMEOUT_SECS": 10,
    "MODEL_EVENTS": {},
    "WEBHOOK_SECRET": None,
    # Send right after each commit from a thread of the committing process (False: only
    # `manage.py mqrelay` sends).
    "RELAY_ON_COMMIT": True,
    # How long a process that is exiting waits for its relay thread to send what it committed.
    "RELAY_EXIT_WAIT_SECS": 5,
    "RELAY_BATCH": 100,  # rows per publish (the server takes up to 1000)
    "RELAY_INTERVAL_SECS": 1.0,  # how often `mqrelay` looks for rows nobody sent
    "RELAY_MAX_BACKOFF_SECS": 60.0,
    # Sent rows are kept this long (the admin shows them), then deleted.
    "OUTBOX_RETENTION_SECS": 7 * 24 * 3600,
    # Delivery ids the webhook view has run, kept this long to refuse a redelivery (the
    # server gives up on a delivery long before: its backoff caps at 5 minutes an attempt).
    "RECEIVED_RETENTION_SECS": 30 * 24 * 3600,
}


def get(name: str) -> Any:
    mq = getattr(settings, "MQ", {}) or {}
    return mq.get(name, DEFAULTS[name])


def need(name: str) -> Any:
    value = get(name)
    if not value:
        raise ImproperlyConfigured(f'settings.MQ["{name}"] is not set')
    return value
