"""GET /api/analytics: its query (checked here: a bad value is a 400 naming it) and the shape
of its answer (for the OpenAPI schema)."""

from datetime import UTC, date, datetime, time

from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from analytics.models import Period
from mqsite.api import NameField, StorableCharField

FILTERS = ("queue", "event", "subscriber", "since", "until")


@extend_schema_field(
    {
        "type": "string",
        "pattern": r"^\d{4}-\d{2}-\d{2}([T ].+)?$",
        "description": "An ISO 8601 date (its midnight UTC) or date and time (without a zone: UTC).",
    }
)
class InstantField(serializers.Field):
    """An ISO 8601 date (midnight UTC) or date and time (without a zone: UTC)."""

    default_error_messages = {
        "invalid": "Must be an ISO 8601 date (2026-11-25) or date and time (2026-11-25T10:00Z)."
    }

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        try:
            value = parse_datetime(data) or parse_date(data)
        except ValueError:  # well formed but no such day or hour (2026-02-30)
            value = None
        if value is None:
            self.fail("invalid")
        if isinstance(value, datetime):
            return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)
        assert isinstance(value, date)
        return datetime.combine(value, time(), tzinfo=UTC)

    def to_representation(self, value):
        return value.isoformat()


class AnalyticsQuerySerializer(serializers.Serializer):
    trends = serializers.ChoiceField(
        choices=Period.values, required=False, help_text="Add the hourly or daily trends of the last run."
    )
    queue = NameField(required=False, help_text="With trends: only this queue's event trends.")
    event = NameField(required=False, help_text="With trends: only this event's trends.")
    subscriber = StorableCharField(
        required=False, max_length=100, help_text="With trends: only this subscriber's trends."
    )
    since = InstantField(required=False, help_text="With trends: periods starting at or after this (UTC).")
    until = InstantField(required=False, help_text="With trends: periods starting before this (UTC).")

    def validate(self, attrs):
        given = [f for f in FILTERS if f in attrs]
        if given and "trends" not in attrs:
            raise serializers.ValidationError(
                {given[0]: ["Filters the trends: give trends=hour or trends=day with it."]}
            )
        if "since" in attrs and "until" in attrs and attrs["since"] >= attrs["until"]:
            raise serializers.ValidationError({"until": ["Must be after since."]})
        return attrs


class LatencySerializer(serializers.Serializer):
    p50 = serializers.FloatField(allow_null=True)
    p95 = serializers.FloatField(allow_null=True)
    p99 = serializers.FloatField(allow_null=True)


class WindowSerializer(serializers.Serializer):
    since = serializers.DateField(allow_null=True)
    until = serializers.DateField(allow_null=True)


class PartitionsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    recomputed = serializers.IntegerField()
    reused = serializers.IntegerField()


class RowsSerializer(serializers.Serializer):
    archive_messages = serializers.IntegerField()
    archive_deliveries = serializers.IntegerField()
    hot_messages = serializers.IntegerField()
    hot_deliveries = serializers.IntegerField()


class RunSerializer(serializers.Serializer):
    run_id = serializers.CharField()
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    duration_s = serializers.FloatField()
    now = serializers.DateTimeField(help_text="The reference time of the figures (ages, lags).")
    window = WindowSerializer(help_text="The days the run covered; null: from the start, up to now.")
    spark = serializers.BooleanField()
    partitions = PartitionsSerializer()
    rows = RowsSerializer()
    loaded_at = serializers.DateTimeField()
    age_s = serializers.FloatField(
        help_text="Seconds since the run finished: how old the figures are (a failed run leaves them)."
    )


class FailureSerializer(serializers.Serializer):
    failed_at = serializers.DateTimeField()
    error = serializers.CharField(help_text="The exception: its type and message.")


class FailuresSerializer(serializers.Serializer):
    since_run = serializers.IntegerField(
        help_text="Runs on beat that failed since the last run was loaded (0: the figures are the newest)."
    )
    last = FailureSerializer(
        allow_null=True, help_text="The newest failed run (kept: the last 100); null: none."
    )


class EventStatsSerializer(serializers.Serializer):
    queue = serializers.CharField()
    event = serializers.CharField()
    messages = serializers.IntegerField()
    deliveries = serializers.IntegerField()
    acked = serializers.IntegerField()
    dead = serializers.IntegerField()
    latency_ms = LatencySerializer()
    attempts_mean = serializers.FloatField(allow_null=True)
    pending = serializers.IntegerField()
    inflight = serializers.IntegerField()
    fanout = serializers.FloatField(allow_null=True)
    dead_letter_rate = serializers.FloatField(allow_null=True)
    messages_per_minute = serializers.FloatField(allow_null=True)
    messages_per_hour = serializers.FloatField(allow_null=True)
    peak_per_minute = serializers.IntegerField()
    peak_per_hour = serializers.IntegerField()
    first_published_at = serializers.DateTimeField(allow_null=True)
    last_published_at = serializers.DateTimeField(allow_null=True)


class SubscriberStatsSerializer(serializers.Serializer):
    subscriber = serializers.CharField()
    pending = serializers.IntegerField()
    oldest_pending_age_s = serializers.FloatField(allow_null=True)
    acked = serializers.IntegerField()
    dead = serializers.IntegerField()
    deliveries = serializers.IntegerField()
    inflight = serializers.IntegerField()
    backlog = serializers.IntegerField()
    lag_s = serializers.FloatField(allow_null=True)
    latency_ms = LatencySerializer(help_text="Publish to ack of its acked deliveries.")


class EventFiguresSerializer(serializers.Serializer):
    """A queue and event over a span of time: an hour or a day (a trend), a recent window."""

    queue = serializers.CharField()
    event = serializers.CharField()
    messages = serializers.IntegerField()
    deliveries = serializers.IntegerField()
    acked = serializers.IntegerField()
    dead = serializers.IntegerField()
    dead_letter_rate = serializers.FloatField(allow_null=True)
    latency_ms = LatencySerializer()


class EventTrendSerializer(EventFiguresSerializer):
    period_start = serializers.DateTimeField()


class SubscriberTrendSerializer(serializers.Serializer):
    subscriber = serializers.CharField()
    period_start = serializers.DateTimeField()
    published = serializers.IntegerField()
    acked = serializers.IntegerField()
    backlog = serializers.IntegerField(help_text="What it was still owed at the period's end.")


class TrendsSerializer(serializers.Serializer):
    period = serializers.ChoiceField(choices=Period.values)
    events = EventTrendSerializer(many=True)
    subscribers = SubscriberTrendSerializer(many=True)
    truncated = serializers.BooleanField(
        help_text="More rows matched than one answer holds: narrow the query."
    )


class SubscriberWindowSerializer(serializers.Serializer):
    subscriber = serializers.CharField()
    deliveries = serializers.IntegerField()
    acked = serializers.IntegerField()
    dead = serializers.IntegerField()
    latency_ms = LatencySerializer(help_text="Publish to ack of its acked deliveries.")


class RecentWindowSerializer(serializers.Serializer):
    since = serializers.DateTimeField(help_text="The window's first hour (its start, UTC).")
    until = serializers.DateTimeField(help_text="The run's now: the figures are as of the last run.")
    events = EventFiguresSerializer(many=True)
    subscribers = SubscriberWindowSerializer(many=True)


class WindowsSerializer(serializers.Serializer):
    # "1h" and "24h" are not Python names: declared below.
    pass


WindowsSerializer._declared_fields["1h"] = RecentWindowSerializer(
    required=False, help_text="Published from the start of the hour one hour before the run to the run."
)
WindowsSerializer._declared_fields["24h"] = RecentWindowSerializer(
    required=False, help_text="Published from the start of the hour 24 hours before the run to the run."
)


class AnalyticsSerializer(serializers.Serializer):
    run = RunSerializer(allow_null=True, help_text="The last loaded run; null before the first.")
    failures = FailuresSerializer()
    events = EventStatsSerializer(many=True)
    subscribers = SubscriberStatsSerializer(many=True)
    windows = WindowsSerializer(
        help_text="The last hour's and the last 24 hours' figures as of the last run; {} before the first."
    )
    trends = TrendsSerializer(required=False, help_text="With ?trends=hour or day.")
