from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from mqsite import adb, rows
from mqsite.ssrf import UnsafeURL, check_url
from queues.models import SYSTEM_QUEUE

from .tokens import hash_token, new_token, new_webhook_secret


def validate_webhook_url(url):
    """The SSRF rule (mqsite.ssrf), applied where a URL is entered."""
    try:
        check_url(url)
    except UnsafeURL as exc:
        raise ValidationError(str(exc)) from None


class Subscriber(models.Model):
    """A client application with its own token and the queues it may use.

    The token is never stored: only its hash. `issue_token()` makes a new one and returns it,
    the one time it can be shown.
    """

    name = models.CharField(max_length=100, unique=True)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    token_hint = models.CharField(
        max_length=12, editable=False, blank=True, help_text="The first characters of the token."
    )
    webhook_url = models.URLField(
        max_length=2000,
        blank=True,
        validators=[validate_webhook_url],
        help_text="Deliveries are POSTed here while the subscriber has no websocket open.",
    )
    # Kept as it is (the HMAC of every post needs it), but shown only when made or rotated, to
    # an operator who may change the subscriber; never on its page afterwards.
    webhook_secret = models.CharField(max_length=100, blank=True, default=new_webhook_secret, editable=False)
    # The secret before the last rotation: posts are signed with it too until the time given,
    # so that receivers can switch to the new one without missing a delivery.
    previous_webhook_secret = models.CharField(max_length=100, blank=True, default="", editable=False)
    previous_webhook_secret_until = models.DateTimeField(null=True, blank=True, editable=False)
    webhook_secret_set_at = models.DateTimeField(null=True, blank=True, editable=False)
    publish_all = models.BooleanField("may publish to every queue", default=False)
    subscribe_all = models.BooleanField("may subscribe to every queue", default=False)
    publish_queues = models.ManyToManyField(
        "queues.Queue", blank=True, related_name="publishers", verbose_name="may publish to"
    )
    subscribe_queues = models.ManyToManyField(
        "queues.Queue", blank=True, related_name="subscribers", verbose_name="may subscribe to"
    )
    is_active = models.BooleanField(default=True, help_text="An inactive subscriber's token is refused.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def issue_token(self):
        """Set a fresh token and return it; the caller saves the row and shows it once."""
        token = new_token()
        self.token_hash = hash_token(token)
        self.token_hint = token[:10]
        return token

    def rotate_webhook_secret(self, now, grace_secs):
        """Set a fresh webhook secret and return it; the caller saves the row and shows it once.
        The one it replaces still signs posts for `grace_secs` (0: not at all)."""
        secret = new_webhook_secret()
        if grace_secs > 0 and self.webhook_secret:
            self.previous_webhook_secret = self.webhook_secret
            self.previous_webhook_secret_until = now + timedelta(seconds=grace_secs)
        else:
            self.previous_webhook_secret, self.previous_webhook_secret_until = "", None
        self.webhook_secret = secret
        self.webhook_secret_set_at = now
        return secret

    def secret_for_first_webhook(self, old_url, now):
        """A subscriber given its first webhook URL (it had `old_url`, empty) gets a fresh secret:
        the one it had was never shown. Returns it, for the caller to show once; else None."""
        if self.webhook_url and not old_url:
            return self.rotate_webhook_secret(now, grace_secs=0)
        return None

    def webhook_secrets(self, now):
        """The secrets a post made at `now` is signed with: the current one, and the previous
        one while its grace lasts."""
        until = self.previous_webhook_secret_until
        if self.previous_webhook_secret and until is not None and now < until:
            return [self.webhook_secret, self.previous_webhook_secret]
        return [self.webhook_secret]

    def may_publish(self, queue):
        """Asked at every publish (each request, each batch of publish frames): a grant is
        kept in the process (_publish_grants), so a publisher with per-queue grants pays no
        query per publish after its first. No subscriber may publish to the server's own
        queue (SYSTEM_QUEUE), whatever its rights: its events must be the server's."""
        if queue.name == SYSTEM_QUEUE:
            return False
        if self.publish_all:
            return True
        granted, forgotten = _publish_grants.kept((self.pk, queue.pk))
        if granted is None:
            granted = self._granted(self.publish_queues.through, queue)
            _publish_grants.keep((self.pk, queue.pk), granted or None, forgotten)
        return granted

    def may_subscribe(self, queue):
        """may_subscribe_q / may_subscribe_sql, below, for this row and a queue."""
        return self.subscribe_all or self._granted(self.subscribe_queues.through, queue)

    async def amay_publish(self, queue):
        """may_publish() from the event loop (mqsite/adb.py)."""
        if queue.name == SYSTEM_QUEUE:
            return False
        if self.publish_all:
            return True
        granted, forgotten = _publish_grants.kept((self.pk, queue.pk))
        if granted is None:
            granted = await self._agranted(self.publish_queues.through, queue)
            _publish_grants.keep((self.pk, queue.pk), granted or None, forgotten)
        return granted

    def _granted(self, through, queue):
        return adb.run_sync(self._granted_statement(through, queue))

    @adb.twin(_granted)
    async def _agranted(self, through, queue):
        return await adb.run(self._granted_statement(through, queue))

    def _granted_statement(self, through, queue):
        # Asked on every publish: plain SQL, since building the ORM's query cost more than
        # running it.
        found = yield (
            f"SELECT 1 FROM {through._meta.db_table} WHERE subscriber_id = %s AND queue_id = %s",
            [self.pk, queue.pk],
        )
        return bool(found)

    def visible_queue_filter(self):
        """A Q over Queue for the queues this subscriber may publish or subscribe to (never
        publish to the server's own: a right to publish to every queue does not show it)."""
        if self.subscribe_all:
            return models.Q()
        if self.publish_all:
            return ~models.Q(name=SYSTEM_QUEUE) | models.Q(subscribers=self)
        return (models.Q(publishers=self) & ~models.Q(name=SYSTEM_QUEUE)) | models.Q(subscribers=self)


# The publish grants (subscriber id, queue id) this process has read, forgotten in every
# process at any change of a subscriber, its rights or a queue (delivery.revocation), as the
# subscribers and queues kept for requests are (mqsite.rows.Kept). Only grants are kept, never
# a refusal: a grant given is seen at once, and a refused publish is not a path worth a cache.
_publish_grants = rows.Kept()


def forget_publish_grants():
    """A subscriber, its rights or a queue changed (here or in another process)."""
    _publish_grants.forget()


# Subscribers found without a webhook (no URL, or inactive) by the web processes' check after
# every commit (delivery.tasks.webhook_subscribers), kept as the grants are and forgotten with
# them: a URL set or a subscriber made active again is a save, announced. A new subscriber is
# an id never kept; one with a webhook is never kept (whether it has a socket open changes
# without an announcement), so it is asked about after every commit, as before.
_webhookless = rows.Kept()


def maybe_webhook(subscriber_ids):
    """(those of `subscriber_ids` not known to be without a webhook, the count to pass to
    keep_webhookless() for what a look-up of them finds)."""
    forgotten = _webhookless.forgotten()
    return [i for i in subscriber_ids if _webhookless.kept(i)[0] is None], forgotten


def keep_webhookless(subscriber_ids, forgotten):
    for i in subscriber_ids:
        _webhookless.keep(i, True, forgotten)


def forget_webhookless():
    """A subscriber changed (here or in another process)."""
    _webhookless.forget()


# --- may subscribe: to every queue (subscribe_all), or to this one (a row of its rights) ----------
# Publishing fans out only to subscriptions whose subscriber still may subscribe, leases skip
# the others, and sockets end them (revocation): each spelling of the rule is here, side by
# side, as delivery.querysets keeps those of a delivery's state. Activity (is_active) is a rule
# of its own, checked beside it.


def may_subscribe_q(subscriber="subscriber", queue="queue"):
    """Subscriber.may_subscribe as a Q over rows with a subscriber and a queue (a Subscription,
    a Delivery): `subscriber` and `queue` name their foreign keys."""
    granted = Subscriber.subscribe_queues.through.objects.filter(
        subscriber_id=OuterRef(f"{subscriber}_id"), queue_id=OuterRef(f"{queue}_id")
    )
    return Q(**{f"{subscriber}__subscribe_all": True}) | Exists(granted)


def may_subscribe_sql(subscriber, row):
    """Subscriber.may_subscribe in SQL: the subscriber row `subscriber` (joined) may subscribe to
    the queue of `row` (with subscriber_id and queue_id); its one parameter is True. An EXISTS
    on the rights' unique index: cheap enough for every publish."""
    through = Subscriber.subscribe_queues.through._meta.db_table
    return f"""({subscriber}.subscribe_all = %s OR EXISTS (
        SELECT 1 FROM {through} g
        WHERE g.subscriber_id = {row}.subscriber_id AND g.queue_id = {row}.queue_id))"""


class Subscription(models.Model):
    """A subscriber's durable interest in one queue, and one event of it or all (event empty)."""

    subscriber = models.ForeignKey(Subscriber, on_delete=models.CASCADE, related_name="subscriptions")
    queue = models.ForeignKey("queues.Queue", on_delete=models.CASCADE, related_name="subscriptions")
    event = models.ForeignKey(
        "queues.Event",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="subscriptions",
        help_text="Empty: every event of the queue.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # A replay (or an unsubscribe) is done in chunks, each its own short transaction, so that
    # it never holds the writer for long (delivery.ledger). While one is under way the
    # subscription is leased nothing (its history is not all owed yet: handing out what is
    # would break seq order), `busy_since` says since when its last chunk ran, and the sweep
    # finishes one that stopped moving (its server died). The replay still owes the seqs
    # replay_next..replay_until of its queue, reopening acked and dead ones (`replay_reopen`,
    # a seek), of these events only (`replay_events`, listen --from; null: all).
    busy_since = models.DateTimeField(null=True, blank=True, editable=False)
    replay_next = models.BigIntegerField(null=True, blank=True, editable=False)
    replay_until = models.BigIntegerField(null=True, blank=True, editable=False)
    replay_reopen = models.BooleanField(default=False, editable=False)
    replay_events = models.JSONField(null=True, blank=True, editable=False)
    # A new subscription's replay reads its queue's last seq again once at its end (under the
    # queue's lock): a publish waiting on that lock when the subscription was made had read the
    # subscriptions before it, so fanned out without it, and took the seqs just after the range.
    replay_extend = models.BooleanField(default=False, editable=False)
    leaving = models.BooleanField(default=False, editable=False, help_text="Being unsubscribed.")
    # Paused (its subscriber, an operator: delivery.subscribing.pause): still owed everything
    # published to it, handed out nothing by any transport until resumed (ledger._may_lease).
    # db_default: the column is filled by the database, so that adding it to a big table is
    # no rewrite, and rows made by raw SQL need not name it.
    paused = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Still owed what is published, but handed nothing until resumed.",
    )

    # What it is owed of its queue, by the values of headers and payload fields
    # (subscribers.filters, which checked it): null, everything. Its FilterClause rows are
    # what the fan-out reads; this is the filter as given, for the answers.
    filter = models.JSONField(
        null=True,
        blank=True,
        editable=False,
        help_text="Only messages whose headers and payload fields have these values; empty: all.",
    )
    # Since when its oldest pending delivery is older than its queue's lag_alert_secs, as the
    # sweep last saw it (delivery.operational.check_lagging): subscription.lagging is published
    # once per crossing, when this goes from empty to set; it is emptied when it recovers.
    lagging_since = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["subscriber__name", "queue__name"]
        constraints = [
            models.UniqueConstraint(
                fields=["subscriber", "queue", "event"], name="subscription_unique_event"
            ),
            # NULLs are distinct in a unique index, so "all events" needs its own constraint.
            models.UniqueConstraint(
                fields=["subscriber", "queue"],
                condition=models.Q(event__isnull=True),
                name="subscription_unique_all_events",
            ),
        ]
        indexes = [
            models.Index(fields=["queue", "event"], name="subscription_fanout"),
            # Whether a queue has a filtered subscription: asked once per message published
            # (subscribers.filters.filter_source), so it must be a probe of a tiny index.
            models.Index(
                fields=["queue"], condition=models.Q(filter__isnull=False), name="subscription_filtered"
            ),
        ]

    def __str__(self):
        return f"{self.subscriber.name} ← {self.queue.name}/{self.event.name if self.event_id else '*'}"

    def clean(self):
        # The ledger owes a subscription nothing while its subscriber lacks the right (a right
        # withdrawn must stop fan-out at once): refuse to make one that would wait in vain.
        if self.subscriber_id and self.queue_id and not self.subscriber.may_subscribe(self.queue):
            raise ValidationError(
                f"{self.subscriber.name} may not subscribe to {self.queue.name}: give it that right"
                " first (its subscriber page), or this subscription would be owed nothing."
            )


class FilterClause(models.Model):
    """One key of a subscription's filter (subscribers.filters), as the fan-out reads it: in
    which document (`source`, payload or headers), at which JSON path, and the values allowed
    there (a JSON array). Replaced whole whenever the filter is set."""

    subscription = models.ForeignKey(Subscription, on_delete=models.CASCADE, related_name="filter_clauses")
    key = models.CharField(max_length=600)
    source = models.CharField(max_length=7)
    path = models.CharField(max_length=600)
    allowed = models.JSONField()

    class Meta:
        # The fan-out looks a subscription's clauses up by its foreign key's index.
        ordering = ["subscription", "id"]

    def __str__(self):
        return self.key


# Each open connection's server refreshes its row (last_seen) this often (delivery.presence).
HEARTBEAT_SECS = 15
# Three missed heartbeats: long enough not to sweep a busy but live server.
STALE_AFTER_SECS = 3 * HEARTBEAT_SECS


def stale_before(now):
    """A connection last seen before this is stale at `now`: its server stopped refreshing it
    (probably died), and the sweep closes it."""
    return now - timedelta(seconds=STALE_AFTER_SECS)


class ConnectionQuerySet(models.QuerySet):
    def stale(self, now):
        return self.filter(last_seen__lt=stale_before(now))

    def live(self, now):
        return self.filter(last_seen__gte=stale_before(now))


class Connection(models.Model):
    """An open websocket of a subscriber (presence). Deleted when the socket closes; a row
    whose heartbeat stopped (its server died) is stale, and swept by `delivery.presence`."""

    subscriber = models.ForeignKey(Subscriber, on_delete=models.CASCADE, related_name="connections")
    channel_name = models.CharField(max_length=200, unique=True)
    remote_addr = models.CharField(max_length=100, blank=True)
    connected_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now, db_index=True)

    objects = ConnectionQuerySet.as_manager()

    class Meta:
        ordering = ["-connected_at"]

    def __str__(self):
        return f"{self.subscriber.name} since {self.connected_at:%Y-%m-%d %H:%M:%S}"

    def is_stale(self, now):
        return self.last_seen < stale_before(now)


class ServerProcess(models.Model):
    """A live server or worker process (a Daphne, a Celery worker), which beats every
    second (delivery.liveness). What a process holds (socket and pull leases, webhook posts)
    carries its name in the lease holder, so that when it stops beating (killed, its machine
    gone) the others hand its holdings back within seconds instead of at the ack deadline."""

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=20)
    started_at = models.DateTimeField(default=timezone.now)
    last_beat = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class Heartbeat(models.Model):
    """When a periodic duty last ran ("sweep": the sweeper, delivery.tasks.sweep), one row each,
    for /healthz: a sweep that stops running holds back every retry, expiry and webhook job
    while every process still beats."""

    name = models.CharField(max_length=40, primary_key=True)
    at = models.DateTimeField()

    def __str__(self):
        return f"{self.name} at {self.at}"
