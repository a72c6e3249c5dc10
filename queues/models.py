from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from mqsite.names import NAME_HELP, NAME_RE

name_validator = RegexValidator(rf"^{NAME_RE.pattern}\Z", NAME_HELP)

DEFAULT_MAX_ATTEMPTS = 10
DEFAULT_ACK_TIMEOUT_SECS = 30
DEFAULT_RETENTION_DAYS = 7

# The queue the server publishes its operational events to (delivery.operational): made by a
# migration, published to by the server alone (Subscriber.may_publish refuses it to every
# subscriber), subscribed to like any other queue.
SYSTEM_QUEUE = "mq.system"


class Queue(models.Model):
    """A named bucket of events. `last_seq` is the counter publish takes under this row's lock."""

    name = models.CharField(max_length=64, unique=True, validators=[name_validator])
    ordered = models.BooleanField(
        default=False, help_text="FIFO: each subscription gets messages in seq order, one at a time."
    )
    max_attempts = models.PositiveIntegerField(
        default=DEFAULT_MAX_ATTEMPTS,
        validators=[MinValueValidator(1)],
        help_text="After this many failed attempts a delivery is dead.",
    )
    ack_timeout = models.PositiveIntegerField(
        "ack timeout (seconds)",
        default=DEFAULT_ACK_TIMEOUT_SECS,
        validators=[MinValueValidator(1)],
        help_text="How long a client holds a delivery before it is handed out again.",
    )
    retention_days = models.PositiveIntegerField(
        default=DEFAULT_RETENTION_DAYS, help_text="Acknowledged history older than this is archived."
    )
    paused = models.BooleanField(
        default=False, help_text="A paused queue takes publishes but hands out no deliveries."
    )
    # The expiry of a message that names none (queues.timing): null, no expiry.
    ttl_secs = models.PositiveIntegerField(
        "default TTL (seconds)",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="A message that names no expiry expires this long after it falls due "
        "(its deliver_at, or its publish); empty: messages never expire.",
    )
    # The sweep publishes subscription.lagging (delivery.operational) when a subscription's
    # oldest pending delivery gets older than this; empty: never.
    lag_alert_secs = models.PositiveIntegerField(
        "lag alert (seconds)",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Publish subscription.lagging to mq.system when a subscription's oldest pending "
        "delivery is older than this. Empty: never.",
    )
    last_seq = models.BigIntegerField(default=0, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def is_system(self):
        return self.name == SYSTEM_QUEUE


class Event(models.Model):
    """What happened inside a queue (create, delete, ...). Made on first publish or subscribe."""

    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="events")
    name = models.CharField(max_length=64, validators=[name_validator])
    created_at = models.DateTimeField(auto_now_add=True)
    # A JSON Schema (draft 2020-12) every payload of this event must satisfy (queues.schemas);
    # null: any payload. Checked when set, never stored invalid.
    schema = models.JSONField(
        "payload schema",
        null=True,
        blank=True,
        help_text="A JSON Schema (draft 2020-12) each published payload must satisfy; empty: any payload.",
    )
    # Counts the changes of `schema` (queues.schemas.save_schema). db_default: rows inserted
    # by plain SQL (bench/) get it too.
    schema_version = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    schema_updated_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["queue__name", "name"]
        constraints = [models.UniqueConstraint(fields=["queue", "name"], name="event_unique_per_queue")]

    def __str__(self):
        return f"{self.queue.name}/{self.name}"


class Message(models.Model):
    """One published (queue, event, payload). Immutable once written."""

    # No index of its own: the unique (queue, seq) leads with it, and a second index misled the
    # planner into reading a whole queue's messages for one seq (bench/PROFILE.md).
    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="messages", db_index=False)
    event = models.ForeignKey(Event, on_delete=models.CASCADE, related_name="messages")
    seq = models.BigIntegerField(editable=False)
    # The payload's JSON text as published: stored as text, not jsonb, so that any JSON value
    # the client sent is kept as it was (PostgreSQL's jsonb refuses "\u0000" and reorders keys).
    payload_json = models.TextField("payload (JSON)")
    # Its headers' JSON text as sent (queues.headers), the same way; NULL when it has none, so
    # that the messages of clients that send none cost nothing more.
    headers_json = models.TextField("headers (JSON)", null=True, blank=True)  # noqa: DJ001
    # NULL, not "", means no key: the partial unique constraint below leaves NULLs out.
    key = models.CharField("idempotency key", max_length=255, null=True, blank=True)  # noqa: DJ001
    publisher = models.ForeignKey(
        "subscribers.Subscriber",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="published_messages",
        help_text="Empty when an operator published it.",
    )
    created_at = models.DateTimeField(db_index=True)
    # The publisher asked for a receipt (a socket publish frame's "receipt": true): its
    # deliveries carry `receipt` too, so that the ack path learns of them without a join.
    receipt_wanted = models.BooleanField(default=False, db_default=False, editable=False)
    # A delayed message (queues.timing): no delivery of it is handed out before this. Null: due
    # at its publish. Its deliveries are made pending from this time (their next_attempt_at).
    deliver_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Not acked by then, a delivery of it goes no further: dead, "expired". Copied onto each
    # delivery (Delivery.expires_at), which is what the ledger reads.
    expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Its message group (API.md, Extensions 2026-11-27): in an ordered queue, order holds within
    # each group; NULL is the queue's one default group. Column "grp": GROUP is an SQL word.
    group = models.CharField(max_length=128, null=True, blank=True, db_column="grp", editable=False)  # noqa: DJ001

    class Meta:
        ordering = ["queue__name", "-seq"]
        constraints = [
            models.UniqueConstraint(fields=["queue", "seq"], name="message_seq_unique_per_queue"),
            models.UniqueConstraint(
                fields=["queue", "key"],
                condition=models.Q(key__isnull=False),
                name="message_key_unique_per_queue",
            ),
        ]

    def __str__(self):
        return f"{self.queue.name}#{self.seq} {self.event.name}"
