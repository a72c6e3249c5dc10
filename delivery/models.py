from django.db import models
from django.db.models.functions import Now

from . import querysets
from .querysets import DeliveryQuerySet
from .statuses import Status as Status  # where the rest of the project imports it from


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
        # No index of its own: the unique (subscription, message) leads with it, and
        # delivery_ready for the pending ones. Every lease and ack writes an entry into each
        # index of this table, and an index that no query needs made both slower
        # (bench/PROFILE.md); it also misled the planner.
        db_index=False,
    )
    subscriber = models.ForeignKey(
        "subscribers.Subscriber",
        on_delete=models.CASCADE,
        related_name="deliveries",
        db_index=False,  # delivery_by_subscriber leads with it (see above)
        # Checked by the database, although the fan-out copies it from the subscription, whose
        # own key to the subscriber is kept: that key does not imply this one, because the
        # subscription's is nullable. Deleting a subscriber, Django sets the subscription of
        # the subscription's deliveries to NULL (SET_NULL above) by an UPDATE that also catches
        # deliveries committed after it listed those to delete; without this key those would
        # stay behind, naming a deleted subscriber (tests/delivery/test_implied_keys.py).
    )
    message = models.ForeignKey("queues.Message", on_delete=models.CASCADE, related_name="deliveries")
    # The copies of queue and event have no constraint in the database (db_constraint=False):
    # the message's key implies them. The fan-out copies them from the message in the statement
    # that inserts the delivery, a delivery never changes its message (a key without SET_NULL),
    # nor a message its queue or event, and the message's own keys to both are kept. Checked
    # anyway, they were two of the five foreign-key triggers a publish fired per delivery
    # (bench/fan_out_plan.py). They stay relations with CASCADE for the ORM, which Django does
    # itself on both databases: a queue or an event deleted through Django (the admin, the API)
    # still deletes its deliveries, found by these indexes. And the message's keys still block
    # what these blocked, a queue or an event deleted while a publish fans out to it: the
    # publish's new messages name them, so either the delete fails at its commit on
    # message -> queue or event, or the publish fails on those keys (or the queue's row lock
    # makes one wait for the other); never a delivery left naming a queue or event that is gone
    # (tests/delivery/test_implied_keys.py).
    queue = models.ForeignKey("queues.Queue", on_delete=models.CASCADE, related_name="+", db_constraint=False)
    event = models.ForeignKey("queues.Event", on_delete=models.CASCADE, related_name="+", db_constraint=False)
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
    # Its message's publisher waits for a receipt (Message.receipt_wanted, copied at fan-out):
    # the settling statements return the message id of such rows only (delivery.receipts).
    receipt = models.BooleanField(default=False, db_default=False, editable=False)
    # Its message's expiry (Message.expires_at, copied at fan-out so that a lease's statement
    # reads one table): not acked by then, it is dead with the reason "expired". Null: never.
    # An operator's redelivery clears it (ledger.redeliver): a new chance, without the expiry.
    expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The line it waits in (message groups, delivery.lines): in an ordered queue its message's
    # group, "" for the default group; NULL in an unordered queue, which has no lines.
    grp = models.CharField(max_length=128, null=True, blank=True, editable=False)  # noqa: DJ001
    # It holds its line: the one open delivery of its (subscription, grp) that may be in flight
    # (the one in flight, else the lowest-seq pending one). Kept by triggers (delivery.lines);
    # meaningless once the delivery is acked or dead (left as it was: clearing it would write
    # the row again).
    head = models.BooleanField(default=False, db_default=False, editable=False)

    objects = DeliveryQuerySet.as_manager()  # the read predicates: ready(now), overdue(now), ...

    class Meta:
        verbose_name_plural = "deliveries"
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["subscription", "message"], name="delivery_once_per_subscription"
            ),
            # At most one open head per line, checked by the database: a race that made a second
            # would fail loudly rather than hand out two messages of one group at once. Also
            # the index of "has this line an open head?" (the insert trigger, delivery.lines).
            models.UniqueConstraint(
                fields=["subscription", "grp"],
                name="delivery_one_head_per_line",
                condition=models.Q(head=True, status__in=["pending", "inflight"]),
            ),
        ]
        # Every change of status writes a new version of the row, and (status being in an
        # index, so no update is HOT) an entry into each index whose condition the new version
        # meets. So the status-specific indexes are partial: a state change writes the six
        # full ones (the primary key, the unique pair, the message, queue and event keys,
        # delivery_by_subscriber) and the partial ones of its new status, 7 or 8 entries where
        # it wrote 10, and acked history, most of the table, is in no status index. Statements
        # that should use one name its status as a literal, as its condition does: a generic
        # plan of a prepared statement cannot use a partial index against a parameter, and
        # SQLite matches the condition's terms as written. bench/PROFILE.md, section 9.
        indexes = [
            # lease: a subscription's pending deliveries in seq order (and "anything ready?")
            models.Index(
                fields=["subscription", "seq"], name="delivery_ready", condition=models.Q(status="pending")
            ),
            # the ordered lease: a subscription's pending heads (one per line) in seq order. Only
            # heads have an entry, so a lease reads its window of heads whatever the backlog.
            models.Index(
                fields=["subscription", "seq"],
                name="delivery_heads",
                condition=models.Q(status="pending", head=True),
            ),
            # a line's next: the lowest pending delivery of a (subscription, grp), found when its
            # head closes (delivery.lines). Ordered queues' rows only (grp is NULL elsewhere).
            models.Index(
                fields=["subscription", "grp", "seq"],
                name="delivery_line_pending",
                condition=models.Q(status="pending", grp__isnull=False),
            ),
            # expiry: overdue leases by deadline (the sweep's, and a lease's for its subscriptions)
            models.Index(
                fields=["ack_deadline"], name="delivery_overdue", condition=models.Q(status="inflight")
            ),
            # a subscriber's pending deliveries by when they fall due: the recheck of its
            # sockets, its next retry (webhooks)
            models.Index(
                fields=["subscriber", "next_attempt_at"],
                name="delivery_due",
                condition=models.Q(status="pending"),
            ),
            # a subscriber's deliveries by status: what it is owed, backlog counts, its in-flight
            # ones (an ordered head). Not partial: SQLite could use it only where a query spells
            # the same IN list in literals, which the ORM never does; and a full index of few
            # distinct keys is small (deduplicated), which a partial one with a time would not be.
            models.Index(fields=["subscriber", "status"], name="delivery_by_subscriber"),
            # dead letters, newest first (written only when one dies)
            models.Index(
                fields=["next_attempt_at", "id"], name="delivery_dead", condition=models.Q(status="dead")
            ),
            # receipts: the open deliveries of messages whose publisher waits for a receipt. Only
            # those rows have an entry, so "is any still open?" is one probe, and the rows of
            # every other message cost it nothing (delivery.receipts).
            models.Index(
                fields=["message"],
                name="delivery_receipt_open",
                condition=models.Q(receipt=True, status__in=["pending", "inflight"]),
            ),
            # expiry: pending deliveries by when they expire (the sweep's); only those of
            # messages that expire have an entry
            models.Index(
                fields=["expires_at"],
                name="delivery_expiring",
                condition=models.Q(status="pending", expires_at__isnull=False),
            ),
            # acks in the last minutes: the dashboard's and /metrics' ack rate and latency
            models.Index(
                fields=["acked_at"], name="delivery_acked_at", condition=models.Q(acked_at__isnull=False)
            ),
        ]

    def __str__(self):
        return f"delivery {self.pk} ({self.status})"

    # The read predicates of delivery.querysets, on a row already read.

    def is_ready(self, now):
        return querysets.is_ready(self.status, self.next_attempt_at, now, self.expires_at)

    def is_expired(self, now):
        return querysets.is_expired(self.expires_at, now)

    def is_retrying(self, now):
        return querysets.is_retrying(self.status, self.next_attempt_at, now)

    def is_overdue(self, now):
        return querysets.is_overdue(self.status, self.ack_deadline, now)


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


class Tally(models.Model):
    """Kept counts of the hot tables, so that operators' reads cost in proportion to queues and
    subscribers, never to rows (delivery.tallies). One row per (queue, event, subscription,
    subscriber, status) with how many deliveries are in that state, and per (queue, event) with
    status "published" for the messages still in the hot tables (subscription and subscriber 0).

    Written by database triggers only, never by the application: every statement that inserts,
    deletes or changes the status or subscription of a delivery, or inserts or deletes a
    message, appends its net change to TallyChange in its own transaction, and a fold moves the
    changes in here. Plain integers, not foreign keys: a count outlives nothing it names.
    """

    queue_id = models.BigIntegerField()
    event_id = models.BigIntegerField()
    subscription_id = models.BigIntegerField()  # 0: a delivery left by an unsubscribe, or a message
    subscriber_id = models.BigIntegerField()  # 0: a message
    status = models.CharField(max_length=20)  # a delivery's Status, "published", or an attempt outcome
    n = models.BigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["queue_id", "event_id", "subscription_id", "subscriber_id", "status"],
                name="tally_key",
            )
        ]

    def __str__(self):
        return f"tally {self.queue_id}/{self.event_id}/{self.subscription_id}/{self.status}: {self.n}"


class TallyChange(models.Model):
    """A net change to a Tally, appended by a trigger in the transaction that made it (an
    append, not an update of a shared row: concurrent acks never wait for each other here)."""

    id = models.BigAutoField(primary_key=True)
    queue_id = models.BigIntegerField()
    event_id = models.BigIntegerField()
    subscription_id = models.BigIntegerField()
    subscriber_id = models.BigIntegerField()
    status = models.CharField(max_length=20)
    n = models.BigIntegerField()
    # When it was made (the database's clock, as the trigger inserts it): the fold files the
    # publishes and acks it counts under this time (TallyActivity).
    at = models.DateTimeField(db_default=Now())

    def __str__(self):
        return f"tally change {self.pk}: {self.status} {self.n:+d}"


class TallyActivity(models.Model):
    """Publishes and acks per ACTIVITY_STEP_SECS of the clock, filed by the fold from the
    changes it moves (delivery.tallies): the dashboard's rates and charts read a few rows per
    step and key, not the messages and acks of the window themselves, whatever the traffic.

    Two groupings in one table: per (queue, event) with subscriber 0, and per subscriber with
    queue and event 0. `status` is "published" or "acked". Kept for ACTIVITY_KEEP_SECS.
    """

    step = models.DateTimeField()  # the start of the step
    queue_id = models.BigIntegerField()
    event_id = models.BigIntegerField()
    subscriber_id = models.BigIntegerField()
    status = models.CharField(max_length=20)
    n = models.BigIntegerField()

    class Meta:
        verbose_name_plural = "tally activity"
        constraints = [
            models.UniqueConstraint(
                fields=["step", "queue_id", "event_id", "subscriber_id", "status"], name="tally_activity_key"
            )
        ]

    def __str__(self):
        return f"{self.status} {self.n} at {self.step}"


class ReceiptMove(models.Model):
    """Receipt deliveries of message `message_id` moved (settled, or dropped): written by the
    ledger in the transaction of the statement that moved them, so that each process's recheck
    of the receipts its sockets wait for reads only what changed since its last pass
    (delivery.receipts.recheck). Kept for a minute (the sweep prunes it). A plain integer, not a
    foreign key: the row outlives nothing it names, and costs no check."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.BigIntegerField()
    at = models.DateTimeField(db_default=Now(), db_index=True)  # the database's clock, for the prune

    def __str__(self):
        return f"receipt move {self.pk}: message {self.message_id}"


class WebhookHealth(models.Model):
    """How a subscriber's webhook has been doing, written by its webhook jobs once per batch of
    posts (delivery.webhook_health): the failures in a row since its last success, and whether
    it is disabled. A webhook whose every attempt failed for MQ_WEBHOOK_DISABLE_AFTER_SECS and
    at least MQ_WEBHOOK_DISABLE_FAILURES attempts in a row is disabled: posted nothing, its
    deliveries left pending with no attempt spent, until an operator enables it again."""

    subscriber = models.OneToOneField(
        "subscribers.Subscriber", on_delete=models.CASCADE, primary_key=True, related_name="webhook_health"
    )
    failures = models.PositiveIntegerField(default=0, help_text="Failed attempts in a row.")
    first_failure_at = models.DateTimeField(null=True, blank=True, help_text="The first of them.")
    last_failure_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    last_success_at = models.DateTimeField(null=True, blank=True)
    disabled_since = models.DateTimeField(null=True, blank=True)
    # How many failures in a row it had when it was disabled (an operator's disable: whatever
    # it had then), kept while `failures` may be reset.
    disabled_after = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        verbose_name = "webhook health"
        verbose_name_plural = "webhook health"

    def __str__(self):
        return f"webhook of {self.subscriber_id}"

    @property
    def disabled(self):
        return self.disabled_since is not None
