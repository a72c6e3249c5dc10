"""The outbox (messages written in the caller's transaction, waiting for the relay) and the
webhook ledger (delivery ids already handled)."""

from __future__ import annotations

import uuid

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


class OutboxMessage(models.Model):
    class Status(models.TextChoices):
        WAITING = "waiting"
        SENT = "sent"
        # The server refused it for good (a 400: bad name, schema mismatch, too large): never
        # sent, kept with its error so the rows behind it are not held up forever.
        REFUSED = "refused"

    # The publish's idempotency key. A UUID of its own rather than the id alone: ids start again
    # in a new database (and two projects may publish to one queue), while the server keeps
    # keys as long as it keeps the message.
    key = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    queue = models.CharField(max_length=255)
    event = models.CharField(max_length=255)
    payload = models.JSONField(encoder=DjangoJSONEncoder, null=True)
    headers = models.JSONField(null=True, blank=True)
    group = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # delay_secs as a time, taken when publish() was called: a relay that runs late does not
    # stretch the delay.
    deliver_at = models.DateTimeField(null=True, blank=True)
    ttl_secs = models.FloatField(null=True, blank=True)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.WAITING)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    message_id = models.BigIntegerField(null=True, blank=True)  # the server's, once sent
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["status", "id"], name="mqclient_outbox_status_id")]
        verbose_name = "outbox message"

    def __str__(self) -> str:
        return f"#{self.id} {self.queue}/{self.event} ({self.status})"

    def as_message(self) -> dict:
        """The item of a batch publish (docs/rest-api.md: Publishing)."""
        item: dict = {"event": self.event, "payload": self.payload, "key": f"outbox-{self.key}"}
        if self.headers:
            item["headers"] = self.headers
        if self.group is not None:
            item["group"] = self.group
        if self.deliver_at is not None:
            item["deliver_at"] = self.deliver_at.isoformat()
        if self.ttl_secs is not None:
            item["ttl_secs"] = self.ttl_secs
        return item


class RelayLock(models.Model):
    """One row, locked (SELECT ... FOR UPDATE) by the relay sending a batch, so that two relays
    never send rows out of order. SQLite has no row locks: a file lock does it there."""

    class Meta:
        verbose_name = "relay lock"

    def __str__(self) -> str:
        return "the relay lock"


class ReceivedDelivery(models.Model):
    """A delivery the webhook view has handled, written in the handlers' transaction: a
    redelivery of it (its answer was lost) finds it and runs nothing."""

    id = models.BigIntegerField(primary_key=True)  # the delivery id (webhook-id)
    queue = models.CharField(max_length=255)
    event = models.CharField(max_length=255)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "received delivery"
        verbose_name_plural = "received deliveries"

    def __str__(self) -> str:
        return f"delivery {self.id} ({self.queue}/{self.event})"
