"""What the analytics job computed at its last loaded run (analytics.load replaces it whole),
and the runs loaded.

Rows name their queue, event and subscriber instead of pointing at them: the figures cover
the archive too, whose queues and subscribers may since have been deleted.
"""

from django.db import models
from django.utils import timezone


class EventStats(models.Model):
    """One queue and event, over the archive and the hot tables together."""

    queue = models.CharField(max_length=64)
    event = models.CharField(max_length=64)
    messages = models.BigIntegerField()
    deliveries = models.BigIntegerField()
    pending = models.BigIntegerField()
    inflight = models.BigIntegerField("in flight")
    acked = models.BigIntegerField()
    dead = models.BigIntegerField()
    fanout = models.FloatField("fan-out", null=True, help_text="Deliveries per message.")
    latency_p50_ms = models.FloatField("latency p50 (ms)", null=True, help_text="Publish to ack.")
    latency_p95_ms = models.FloatField("latency p95 (ms)", null=True)
    latency_p99_ms = models.FloatField("latency p99 (ms)", null=True)
    attempts_mean = models.FloatField(null=True, help_text="Mean attempts of acked and dead deliveries.")
    dead_letter_rate = models.FloatField(null=True, help_text="Dead / deliveries.")
    messages_per_minute = models.FloatField(
        null=True, help_text="Mean over the minutes from the first message to the last."
    )
    messages_per_hour = models.FloatField(
        null=True, help_text="Mean over the hours from the first to the last."
    )
    peak_per_minute = models.BigIntegerField(default=0)
    peak_per_hour = models.BigIntegerField(default=0)
    first_published_at = models.DateTimeField(null=True)
    last_published_at = models.DateTimeField(null=True)
    computed_at = models.DateTimeField()

    class Meta:
        verbose_name = "event statistics"
        verbose_name_plural = "event statistics"
        ordering = ["queue", "event"]
        constraints = [models.UniqueConstraint(fields=["queue", "event"], name="eventstats_once")]

    def __str__(self):
        return f"{self.queue}/{self.event}"


class SubscriberStats(models.Model):
    """One subscriber's backlog and lag, and what it got."""

    subscriber = models.CharField(max_length=100, unique=True)
    deliveries = models.BigIntegerField()
    pending = models.BigIntegerField()
    inflight = models.BigIntegerField("in flight")
    acked = models.BigIntegerField()
    dead = models.BigIntegerField()
    oldest_pending_age_s = models.FloatField(
        "oldest pending age (s)", null=True, help_text="At computed_at's run; empty when nothing is pending."
    )
    latency_p50_ms = models.FloatField(
        "latency p50 (ms)", null=True, help_text="Publish to ack of its acked deliveries."
    )
    latency_p95_ms = models.FloatField("latency p95 (ms)", null=True)
    latency_p99_ms = models.FloatField("latency p99 (ms)", null=True)
    computed_at = models.DateTimeField()

    class Meta:
        verbose_name = "subscriber statistics"
        verbose_name_plural = "subscriber statistics"
        ordering = ["subscriber"]

    def __str__(self):
        return self.subscriber


class Window(models.TextChoices):
    """analytics.windows.WINDOWS"""

    HOUR = "1h"
    DAY = "24h"


class EventWindowStats(models.Model):
    """One queue and event over the last hour or 24 hours before its run (analytics.windows):
    what was published then, and how it fared."""

    window = models.CharField(max_length=4, choices=Window.choices)
    since = models.DateTimeField(help_text="The window's first hour; it ends at the run's now.")
    queue = models.CharField(max_length=64)
    event = models.CharField(max_length=64)
    messages = models.BigIntegerField()
    deliveries = models.BigIntegerField()
    acked = models.BigIntegerField()
    dead = models.BigIntegerField()
    dead_letter_rate = models.FloatField(null=True, help_text="Dead / deliveries.")
    latency_p50_ms = models.FloatField("latency p50 (ms)", null=True, help_text="Publish to ack.")
    latency_p95_ms = models.FloatField("latency p95 (ms)", null=True)
    latency_p99_ms = models.FloatField("latency p99 (ms)", null=True)
    computed_at = models.DateTimeField()

    class Meta:
        verbose_name = "event statistics of a recent window"
        verbose_name_plural = "event statistics of recent windows"
        ordering = ["window", "queue", "event"]
        constraints = [
            models.UniqueConstraint(fields=["window", "queue", "event"], name="eventwindowstats_once")
        ]

    def __str__(self):
        return f"{self.queue}/{self.event} last {self.window}"


class SubscriberWindowStats(models.Model):
    """One subscriber over the last hour or 24 hours before its run: the deliveries made to it
    then, and their publish-to-ack latency (which consumer is slow)."""

    window = models.CharField(max_length=4, choices=Window.choices)
    since = models.DateTimeField(help_text="The window's first hour; it ends at the run's now.")
    subscriber = models.CharField(max_length=100)
    deliveries = models.BigIntegerField()
    acked = models.BigIntegerField()
    dead = models.BigIntegerField()
    latency_p50_ms = models.FloatField("latency p50 (ms)", null=True, help_text="Publish to ack.")
    latency_p95_ms = models.FloatField("latency p95 (ms)", null=True)
    latency_p99_ms = models.FloatField("latency p99 (ms)", null=True)
    computed_at = models.DateTimeField()

    class Meta:
        verbose_name = "subscriber statistics of a recent window"
        verbose_name_plural = "subscriber statistics of recent windows"
        ordering = ["window", "subscriber"]
        constraints = [
            models.UniqueConstraint(fields=["window", "subscriber"], name="subscriberwindowstats_once")
        ]

    def __str__(self):
        return f"{self.subscriber} last {self.window}"


class ArchiveBatch(models.Model):
    """The archive's journal: one batch of messages between its Parquet write and its delete.

    Committed before the batch's files are written and deleted in the transaction that deletes
    the batch's rows, so a row here means "these files may exist, these rows may still be in
    the hot tables". The next archive run replays it with the same ids, hence the same file
    names (analytics.archive.replay_journal), whatever batches it would pick itself.
    """

    root = models.CharField(max_length=1024, help_text="The archive's place (MQ_ARCHIVE_DIR) it writes to.")
    queue = models.CharField(max_length=64)
    message_ids = models.JSONField(help_text="The batch's message ids; its files are named after them.")
    days = models.JSONField(default=list, help_text="The days (UTC) the batch wrote files into.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = "archive batch in progress"
        verbose_name_plural = "archive batches in progress"
        ordering = ["id"]

    def __str__(self):
        return f"{self.queue} {min(self.message_ids, default='')}-{max(self.message_ids, default='')}"


class Period(models.TextChoices):
    HOUR = "hour"
    DAY = "day"


class EventTrend(models.Model):
    """One queue and event over one hour or day (by publish time): what the dashboard's chart
    and GET /api/analytics?trends= show."""

    queue = models.CharField(max_length=64)
    event = models.CharField(max_length=64)
    period = models.CharField(max_length=4, choices=Period.choices)
    period_start = models.DateTimeField()
    messages = models.BigIntegerField()
    deliveries = models.BigIntegerField()
    acked = models.BigIntegerField()
    dead = models.BigIntegerField()
    dead_letter_rate = models.FloatField(null=True, help_text="Dead / deliveries.")
    latency_p50_ms = models.FloatField("latency p50 (ms)", null=True, help_text="Publish to ack.")
    latency_p95_ms = models.FloatField("latency p95 (ms)", null=True)
    latency_p99_ms = models.FloatField("latency p99 (ms)", null=True)

    class Meta:
        verbose_name = "event trend"
        ordering = ["queue", "event", "period", "-period_start"]
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "event", "period", "period_start"], name="eventtrend_once"
            )
        ]
        # The API and the dashboard ask for one period over a span of time.
        indexes = [models.Index(fields=["period", "period_start"], name="eventtrend_period")]

    def __str__(self):
        return f"{self.queue}/{self.event} {self.period} {self.period_start:%Y-%m-%d %H:00}"


class SubscriberTrend(models.Model):
    """One subscriber over one hour or day: what was published to it, what it acked, and its
    backlog at the period's end."""

    subscriber = models.CharField(max_length=100)
    period = models.CharField(max_length=4, choices=Period.choices)
    period_start = models.DateTimeField()
    published = models.BigIntegerField()
    acked = models.BigIntegerField()
    backlog = models.BigIntegerField()

    class Meta:
        verbose_name = "subscriber trend"
        ordering = ["subscriber", "period", "-period_start"]
        constraints = [
            models.UniqueConstraint(
                fields=["subscriber", "period", "period_start"], name="subscribertrend_once"
            )
        ]
        indexes = [models.Index(fields=["period", "period_start"], name="subscribertrend_period")]

    def __str__(self):
        return f"{self.subscriber} {self.period} {self.period_start:%Y-%m-%d %H:00}"


class AnalyticsRun(models.Model):
    """A run whose results were loaded (its manifest, flattened); the newest loaded is the one
    the statistics above are from. Kept, one row per run, as the history of the runs' cost."""

    run_id = models.CharField(max_length=40, unique=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    duration_s = models.FloatField("duration (s)")
    now = models.DateTimeField(help_text="The reference time of the figures (ages, lags).")
    window_since = models.DateField(null=True, help_text="First day covered; empty: from the start.")
    window_until = models.DateField(null=True, help_text="Last day covered; empty: up to now.")
    spark = models.BooleanField(help_text="Whether Spark computed it.")
    partitions_total = models.BigIntegerField()
    partitions_recomputed = models.BigIntegerField()
    partitions_reused = models.BigIntegerField()
    rows_archive_messages = models.BigIntegerField()
    rows_archive_deliveries = models.BigIntegerField()
    rows_hot_messages = models.BigIntegerField()
    rows_hot_deliveries = models.BigIntegerField()
    loaded_at = models.DateTimeField()

    class Meta:
        verbose_name = "analytics run"
        ordering = ["-loaded_at"]
        get_latest_by = "loaded_at"

    def __str__(self):
        return self.run_id


class AnalyticsFailure(models.Model):
    """An analysis on beat that failed (analytics.tasks.analyze): when, and why. Nothing of it
    was stored, so the figures stay the last loaded run's; /metrics and GET /api/analytics show
    the newest failure beside that run's age, so that figures gone stale never pass for fresh
    ones. The newest KEEP are kept."""

    KEEP = 100
    ERROR_CHARS = 2000

    failed_at = models.DateTimeField(default=timezone.now, db_index=True)
    error = models.TextField(help_text="The exception: its type and message.")

    class Meta:
        verbose_name = "failed analytics run"
        ordering = ["-failed_at"]

    def __str__(self):
        return f"{self.failed_at:%Y-%m-%d %H:%M:%S} {self.error[:60]}"

    @classmethod
    def record(cls, error):
        """Record a failure now (its text cut to ERROR_CHARS) and forget the oldest past KEEP."""
        cls.objects.create(error=error[: cls.ERROR_CHARS])
        stale = cls.objects.order_by("-failed_at", "-id").values_list("id", flat=True)[cls.KEEP :]
        cls.objects.filter(id__in=list(stale)).delete()
