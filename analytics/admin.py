"""The analytics' results in the admin: read-only, since only `analyze` writes them."""

from django.contrib import admin

from .models import (
    AnalyticsFailure,
    AnalyticsRun,
    EventStats,
    EventTrend,
    EventWindowStats,
    SubscriberStats,
    SubscriberTrend,
    SubscriberWindowStats,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class EventColumns:
    """The columns an event's stats and its trends show alike (and a subscriber's, latency):
    latency and dead-letter rate."""

    @admin.display(description="p50 ms", ordering="latency_p50_ms")
    def latency_p50(self, obj):
        return _num(obj.latency_p50_ms, 1)

    @admin.display(description="p95 ms", ordering="latency_p95_ms")
    def latency_p95(self, obj):
        return _num(obj.latency_p95_ms, 1)

    @admin.display(description="p99 ms", ordering="latency_p99_ms")
    def latency_p99(self, obj):
        return _num(obj.latency_p99_ms, 1)

    @admin.display(description="dead-letter rate", ordering="dead_letter_rate")
    def dead_rate(self, obj):
        return "-" if obj.dead_letter_rate is None else f"{obj.dead_letter_rate:.2%}"


@admin.register(EventStats)
class EventStatsAdmin(EventColumns, ReadOnlyAdmin):
    list_display = (
        "queue",
        "event",
        "messages",
        "deliveries",
        "pending",
        "inflight",
        "acked",
        "dead",
        "fanout_",
        "latency_p50",
        "latency_p95",
        "latency_p99",
        "attempts",
        "dead_rate",
        "per_minute",
        "per_hour",
        "computed_at",
    )
    list_filter = ("queue",)
    search_fields = ("queue", "event")

    @admin.display(description="fan-out", ordering="fanout")
    def fanout_(self, obj):
        return _num(obj.fanout, 2)

    @admin.display(description="attempts (mean)", ordering="attempts_mean")
    def attempts(self, obj):
        return _num(obj.attempts_mean, 2)

    @admin.display(description="msgs/min (mean, peak)", ordering="messages_per_minute")
    def per_minute(self, obj):
        return f"{_num(obj.messages_per_minute, 2)}, {obj.peak_per_minute}"

    @admin.display(description="msgs/hour (mean, peak)", ordering="messages_per_hour")
    def per_hour(self, obj):
        return f"{_num(obj.messages_per_hour, 1)}, {obj.peak_per_hour}"


@admin.register(EventTrend)
class EventTrendAdmin(EventColumns, ReadOnlyAdmin):
    list_display = (
        "queue",
        "event",
        "period",
        "period_start",
        "messages",
        "deliveries",
        "acked",
        "dead",
        "dead_rate",
        "latency_p50",
        "latency_p95",
        "latency_p99",
    )
    list_filter = ("period", "queue")
    search_fields = ("queue", "event")
    date_hierarchy = "period_start"


@admin.register(SubscriberTrend)
class SubscriberTrendAdmin(ReadOnlyAdmin):
    list_display = ("subscriber", "period", "period_start", "published", "acked", "backlog")
    list_filter = ("period",)
    search_fields = ("subscriber",)
    date_hierarchy = "period_start"


@admin.register(AnalyticsRun)
class AnalyticsRunAdmin(ReadOnlyAdmin):
    list_display = (
        "run_id",
        "finished_at",
        "duration",
        "spark",
        "window",
        "partitions",
        "rows_archive_messages",
        "rows_hot_messages",
        "loaded_at",
    )
    list_filter = ("spark",)
    search_fields = ("run_id",)

    @admin.display(description="duration", ordering="duration_s")
    def duration(self, obj):
        return f"{obj.duration_s:,.1f} s"

    @admin.display(description="window")
    def window(self, obj):
        return f"{obj.window_since or 'start'} .. {obj.window_until or 'now'}"

    @admin.display(description="partitions (recomputed / reused)")
    def partitions(self, obj):
        return f"{obj.partitions_recomputed} / {obj.partitions_reused}"


@admin.register(AnalyticsFailure)
class AnalyticsFailureAdmin(ReadOnlyAdmin):
    list_display = ("failed_at", "error")
    search_fields = ("error",)
    date_hierarchy = "failed_at"

    # A failed run is a run: who may see the runs sees them, here as in GET /api/analytics.
    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("analytics.view_analyticsrun")


@admin.register(EventWindowStats)
class EventWindowStatsAdmin(EventColumns, ReadOnlyAdmin):
    list_display = (
        "window",
        "queue",
        "event",
        "since",
        "messages",
        "deliveries",
        "acked",
        "dead",
        "dead_rate",
        "latency_p50",
        "latency_p95",
        "latency_p99",
        "computed_at",
    )
    list_filter = ("window", "queue")
    search_fields = ("queue", "event")


@admin.register(SubscriberWindowStats)
class SubscriberWindowStatsAdmin(EventColumns, ReadOnlyAdmin):
    list_display = (
        "window",
        "subscriber",
        "since",
        "deliveries",
        "acked",
        "dead",
        "latency_p50",
        "latency_p95",
        "latency_p99",
        "computed_at",
    )
    list_filter = ("window",)
    search_fields = ("subscriber",)


@admin.register(SubscriberStats)
class SubscriberStatsAdmin(EventColumns, ReadOnlyAdmin):
    list_display = (
        "subscriber",
        "pending",
        "inflight",
        "oldest_pending",
        "acked",
        "dead",
        "deliveries",
        "latency_p50",
        "latency_p95",
        "latency_p99",
        "computed_at",
    )
    search_fields = ("subscriber",)

    @admin.display(description="oldest pending", ordering="oldest_pending_age_s")
    def oldest_pending(self, obj):
        if obj.oldest_pending_age_s is None:
            return "-"
        return f"{obj.oldest_pending_age_s:,.0f} s"


def _num(value, digits):
    return "-" if value is None else f"{value:,.{digits}f}"
