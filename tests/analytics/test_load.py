"""analytics.load.load_run: a run folder's results become the stored statistics, trends and the
run's row, in one go; results_json() keeps the shape `analyze --json` always had."""

from datetime import UTC, date, datetime

import pytest

from analytics import figures, load, runs
from analytics.models import AnalyticsRun, EventStats, EventTrend, SubscriberStats, SubscriberTrend
from tests.support.run_folders import write_run

pytestmark = pytest.mark.django_db

HOUR = datetime(2026, 11, 25, 10, tzinfo=UTC)
EVENT = {
    "queue": "db",
    "event": "create",
    "messages": 3,
    "deliveries": 6,
    "pending": 1,
    "acked": 4,
    "dead": 1,
    "latency_p50_ms": 12.5,
    "dead_letter_rate": float("nan"),  # 0/0 in Spark: stored as null
}


def test_a_runs_results_have_the_stored_tables_columns():
    """What the analysis writes (figures.RESULT_SCHEMAS) is what load stores, field for field."""
    assert figures.RESULT_SCHEMAS["event_stats"].names == load.EVENT_FIELDS
    assert figures.RESULT_SCHEMAS["subscriber_stats"].names == load.SUBSCRIBER_FIELDS
    assert figures.RESULT_SCHEMAS["event_trends"].names == load.EVENT_TREND_FIELDS
    assert figures.RESULT_SCHEMAS["subscriber_trends"].names == load.SUBSCRIBER_TREND_FIELDS
    assert figures.RESULT_SCHEMAS["event_windows"].names == load.EVENT_WINDOW_FIELDS
    assert figures.RESULT_SCHEMAS["subscriber_windows"].names == load.SUBSCRIBER_WINDOW_FIELDS


def test_it_loads_a_run_in_place_of_the_last(tmp_path):
    out = str(tmp_path)
    # Given a loaded run
    first = write_run(
        out,
        events=[EVENT, {**EVENT, "event": "delete"}],
        subscribers=[{"subscriber": "old", "deliveries": 1}],
        event_trends=[{"queue": "db", "event": "create", "period_start": HOUR, "messages": 9}],
        subscriber_trends=[{"subscriber": "old", "period_start": HOUR, "published": 1}],
    )
    load.load_run(out, first)
    # When a newer run is loaded
    second = write_run(
        out,
        events=[EVENT],
        subscribers=[{"subscriber": "logger", "deliveries": 6, "pending": 1, "oldest_pending_age_s": 4.5}],
        event_trends=[
            {"queue": "db", "event": "create", "period_start": HOUR, "messages": 3, "latency_p99_ms": 99.0},
            {"queue": "db", "event": "create", "period": "day", "period_start": HOUR.replace(hour=0)},
        ],
        subscriber_trends=[{"subscriber": "logger", "period_start": HOUR, "published": 3, "backlog": 1}],
        manifest={"window": {"since": "2026-11-01", "until": None}, "now": "2026-11-25T12:30:00+00:00"},
    )
    counts = load.load_run(out, second)

    # Then only its rows are stored (a folder without the recent windows, as an older release
    # wrote it, loads with none)
    assert counts == {
        "events": 1,
        "subscribers": 1,
        "event_trends": 2,
        "subscriber_trends": 1,
        "event_windows": 0,
        "subscriber_windows": 0,
    }
    stats = EventStats.objects.get()
    assert (stats.event, stats.messages, stats.latency_p50_ms, stats.dead_letter_rate) == (
        "create",
        3,
        12.5,
        None,
    )
    assert stats.computed_at == datetime(2026, 11, 25, 12, 30, tzinfo=UTC)
    assert list(SubscriberStats.objects.values_list("subscriber", flat=True)) == ["logger"]
    hourly = EventTrend.objects.get(period="hour")
    assert (hourly.period_start, hourly.messages, hourly.latency_p99_ms) == (HOUR, 3, 99.0)
    assert EventTrend.objects.filter(period="day").count() == 1
    assert SubscriberTrend.objects.get().backlog == 1
    # ... and both runs are recorded, the second the last
    assert AnalyticsRun.objects.count() == 2
    run = load.last_run()
    assert run.run_id == second and run.window_since == date(2026, 11, 1) and run.window_until is None
    assert (run.partitions_recomputed, run.partitions_reused, run.rows_hot_deliveries) == (2, 8, 9)
    # ... and results_json() is what `analyze --json` always printed
    result = load.results_json()
    assert set(result) == {"events", "subscribers"}
    assert result["events"][0]["latency_ms"] == {"p50": 12.5, "p95": None, "p99": None}
    assert result["subscribers"][0]["backlog"] == 1 and result["subscribers"][0]["lag_s"] == 4.5

    # When the same run is loaded again, nothing changes but when it was loaded
    load.load_run(out, second)
    assert AnalyticsRun.objects.count() == 2 and EventStats.objects.count() == 1


def test_it_refuses_an_unfinished_run_and_keeps_the_last(tmp_path):
    out = str(tmp_path)
    load.load_run(out, write_run(out, events=[EVENT]))
    unfinished = write_run(out, events=[], finished=False)
    with pytest.raises(runs.BadRun):
        load.load_run(out, unfinished)
    assert EventStats.objects.count() == 1 and AnalyticsRun.objects.count() == 1


def test_it_refuses_a_malformed_manifest(tmp_path):
    out = str(tmp_path)
    bad = write_run(out, manifest={"started_at": "yesterday"}, switch=False)
    with pytest.raises(runs.BadRun, match="malformed manifest"):
        load.load_run(out, bad)
    assert not AnalyticsRun.objects.exists()


def test_run_json_gives_back_the_manifest(tmp_path):
    out = str(tmp_path)
    run_id = write_run(out)
    load.load_run(out, run_id)
    manifest = runs.read_manifest(out, run_id)
    answer = load.run_json(load.last_run())
    assert {k: v for k, v in answer.items() if k != "loaded_at"} == manifest


def test_the_admin_shows_trends_and_runs_read_only(operator_client, tmp_path):
    from django.urls import reverse

    out = str(tmp_path)
    run_id = write_run(
        out,
        event_trends=[
            {"queue": "db", "event": "create", "period_start": HOUR, "messages": 3, "dead_letter_rate": 0.25},
            {"queue": "network", "event": "error", "period": "day", "period_start": HOUR.replace(hour=0)},
        ],
        subscriber_trends=[{"subscriber": "logger", "period_start": HOUR, "published": 3, "backlog": 1}],
    )
    load.load_run(out, run_id)
    for model, query, shown, rows in (
        (EventTrend, {"period__exact": "hour"}, "25.00%", 1),
        (EventTrend, {"queue": "network"}, "network", 1),
        (EventTrend, {}, "25.00%", 2),
        (SubscriberTrend, {"period__exact": "hour"}, "logger", 1),
        (AnalyticsRun, {}, run_id, 1),
    ):
        name = model._meta.model_name
        page = operator_client.get(reverse(f"admin:analytics_{name}_changelist"), query)
        text = page.content.decode()
        assert page.status_code == 200 and shown in text, (name, query)
        assert page.context["cl"].result_count == rows, (name, query)
        assert operator_client.get(reverse(f"admin:analytics_{name}_add")).status_code == 403
        obj = model.objects.first()
        assert (
            operator_client.post(reverse(f"admin:analytics_{name}_delete", args=[obj.pk])).status_code == 403
        )
        assert model.objects.filter(pk=obj.pk).exists()
