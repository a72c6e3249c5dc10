from django.db import models


class Status(models.TextChoices):
    PENDING = "pending", "pending"
    INFLIGHT = "inflight", "in flight"
    ACKED = "acked", "acked"
    DEAD = "dead", "dead"


class Delivery(models.Model):
    """One message owed to one subscription. Only delivery.ledger changes its state.

    It carries copies of its subscription's subscriber and its message's queue, event and seq,
    so that the hot queries (lease, ack, expiry) read this one table with no join.
    """

    subscription = models.ForeignKey(
        "subscribers.Subscription",
        on_delete=models.SET_NULL,  # acked history outlives an unsubscribe, for the analytics
        null=True,
        related_name="deliveries",
        # No index of its own: delivery_lease and the unique (subscription, message) lead with
        # it. Every lease and ack writes an entry into each index of this table, and an index
        # that no query needs made both slower (bench/PROFILE.md); it also misled the planner.
        db_index=False,
    )
    subscriber = models.ForeignKey(
        "subscribers.Subscriber",
        on_delete=models.CASCADE,
        related_name="deliveries",
        db_index=False,  # delivery_by_subscriber leads with it (see above)
    )
    message = models.ForeignKey("queues.Message", on_delete=models.CASCADE, related_name="deliveries")
    queue = models.ForeignKey("queues.Queue", on_delete=models.CASCADE, related_name="+")
    event = models.ForeignKey("queues.Event", on_delete=models.CASCADE, related_name="+")
    seq = models.BigIntegerField()
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    attempt = models.PositiveIntegerField(default=0, help_text="How many times it was handed out.")
    next_attempt_at = models.DateTimeField(help_text="A pending delivery is not handed out before this.")
    ack_deadline = models.DateTimeField(null=True, blank=True)
    # Who holds the lease: a websocket connection's channel name, or "" (a pull or a webhook).
    lease_holder = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True, help_text="Last handed out.")
    acked_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")

    class Meta:
        verbose_name_plural = "deliveries"
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["subscription", "message"], name="delivery_once_per_subscription"
            ),
        ]
        indexes = [
            # lease: a subscription's pending deliveries in seq order
            models.Index(fields=["subscription", "status", "seq"], name="delivery_lease"),
            # expiry sweep: overdue leases by deadline
            models.Index(fields=["status", "ack_deadline"], name="delivery_overdue"),
            # retry sweep and backlog: pending by next_attempt_at
            models.Index(fields=["status", "next_attempt_at"], name="delivery_due"),
            # a subscriber's deliveries by status (what it is owed, stats)
            models.Index(fields=["subscriber", "status"], name="delivery_by_subscriber"),
            # acks in the last minutes: the dashboard's and /metrics' ack rate and latency
            models.Index(fields=["acked_at"], name="delivery_acked_at"),
        ]

    def __str__(self):
        return f"delivery {self.pk} ({self.status})"


class DeliveryAttempt(models.Model):
    """One try at pushing a delivery to a webhook: the history operators read on a dead letter."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField(help_text="The delivery's attempt count at this try.")
    at = models.DateTimeField()
    ok = models.BooleanField()
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    duration_ms = models.PositiveIntegerField(default=0)
    permanent = models.BooleanField(
        default=False,
        help_text="The failure looks permanent: an HTTP 4xx other than 408 and 429, or a refused URL. "
        "Retried on the backoff schedule all the same; it tells operators what to fix.",
    )

    class Meta:
        ordering = ["delivery", "number", "at"]

    def __str__(self):
        return f"attempt {self.number} of delivery {self.delivery_id}: {'ok' if self.ok else 'failed'}"


class DeadLetter(Delivery):
    """A dead delivery, as operators browse it in the admin's "Dead letters" list: the same
    rows (a proxy), which the admin limits to status dead. Its state still moves only through
    delivery.ledger (redeliver, purge_dead)."""

    class Meta:
        proxy = True
        verbose_name = "dead letter"
