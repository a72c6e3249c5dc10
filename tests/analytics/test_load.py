"""analytics.load.load_run: a run folder's results become the stored statistics, trends and the
run's row, in one go; results_json() keeps the shape `analyze --json` always had."""

from datetime import UTC, date, datetime

import pytest
from django.db import IntegrityError

from analytics import figures, load, runs, stored
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
    assert figures.RESULT_SCHEMAS["event_stats"].names == stored.EVENT_FIELDS
    assert figures.RESULT_SCHEMAS["subscriber_stats"].names == stored.SUBSCRIBER_FIELDS
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
    run = stored.last_run()
    assert run.run_id == second and run.window_since == date(2026, 11, 1) and run.window_until is None
    assert (run.partitions_recomputed, run.partitions_reused, run.rows_hot_deliveries) == (2, 8, 9)
    # ... and results_json() is what `analyze --json` always printed
    result = stored.results_json()
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
    answer = stored.run_json(stored.last_run())
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


DAY = HOUR.replace(hour=0)
NAN = float("nan")


def _trend_rows():
    """The trend tables' rows, each (id, its fields), by key."""
    return {
        name: {
            tuple(getattr(row, f) for f in load._key(model)): (row.id, tuple(getattr(row, f) for f in fields))
            for row in model.objects.all()
        }
        for name, (model, fields) in load.TRENDS.items()
    }


def _values(rows):
    return {name: {key: values for key, (_, values) in by_key.items()} for name, by_key in rows.items()}


# Hours before HOUR that two runs share.
EARLIER = [HOUR.replace(hour=h) for h in range(4)]


def _two_runs(out):
    """A run's trends and the next's: some rows the same (one with a NaN), some changed, gone
    and new, by hour and by day, for events and subscribers. Fewer change than stay: past half,
    a load replaces them all (load._store_trends)."""
    same = {
        "event_trends": [
            {"queue": "db", "event": "create", "period_start": h, "messages": 1} for h in EARLIER
        ],
        "subscriber_trends": [{"subscriber": "logger", "period_start": h, "published": 1} for h in EARLIER],
    }
    first = {
        "event_trends": [
            {"queue": "db", "event": "create", "period_start": HOUR, "messages": 3, "latency_p50_ms": 1.5},
            {
                "queue": "db",
                "event": "create",
                "period_start": HOUR.replace(hour=11),
                "dead_letter_rate": NAN,
            },
            {"queue": "db", "event": "delete", "period_start": HOUR, "messages": 1, "latency_p99_ms": 7.0},
            {"queue": "db", "event": "create", "period": "day", "period_start": DAY, "messages": 3},
            {"queue": "network", "event": "error", "period_start": HOUR, "messages": 2},
        ],
        "subscriber_trends": [
            {"subscriber": "logger", "period_start": HOUR, "published": 3, "acked": 3},
            {"subscriber": "logger", "period_start": HOUR.replace(hour=11), "published": 1, "backlog": 1},
            {"subscriber": "logger", "period": "day", "period_start": DAY, "published": 4, "backlog": 1},
            {"subscriber": "gone", "period_start": HOUR, "published": 1},
        ],
    }
    second = {
        "event_trends": [
            first["event_trends"][0],
            first["event_trends"][1],
            # changed: a value, a value to null (NaN), a value from null
            {**first["event_trends"][2], "messages": 2, "latency_p99_ms": NAN, "latency_p50_ms": 3.0},
            {**first["event_trends"][3], "messages": 5},
            # the network row is gone; new ones:
            {"queue": "db", "event": "create", "period_start": HOUR.replace(hour=12), "messages": 2},
            {"queue": "db", "event": "delete", "period": "day", "period_start": DAY, "messages": 2},
        ],
        "subscriber_trends": [
            first["subscriber_trends"][0],
            {**first["subscriber_trends"][1], "acked": 1, "backlog": 0},
            {**first["subscriber_trends"][2], "acked": 4},
            {"subscriber": "logger", "period_start": HOUR.replace(hour=12), "published": 2, "backlog": 2},
        ],
    }
    return tuple(
        write_run(out, **{name: same[name] + rows[name] for name in rows}) for rows in (first, second)
    )


def test_a_run_after_another_rewrites_only_the_trend_rows_that_changed(tmp_path):
    out = str(tmp_path)
    # Given a loaded run, and a newer one whose trends differ by a few rows
    first, second = _two_runs(out)
    load.load_run(out, first)
    before = _trend_rows()
    # When the newer run is loaded
    counts = load.load_run(out, second)

    # Then the rows that are the same in both runs stay as they were, row for row (NaN and NaN
    # are the same: null); the others are new rows
    after = _trend_rows()
    assert (counts["event_trends"], counts["subscriber_trends"]) == (10, 8)
    kept = {
        "event_trends": {("db", "create", "hour", h) for h in [*EARLIER, HOUR, HOUR.replace(hour=11)]},
        "subscriber_trends": {("logger", "hour", h) for h in [*EARLIER, HOUR]},
    }
    for name in load.TRENDS:
        assert {key for key, row in after[name].items() if before[name].get(key) == row} == kept[name]
    assert ("network", "error", "hour", HOUR) not in after["event_trends"]
    assert stored.last_run().run_id == second and AnalyticsRun.objects.count() == 2
    # ... and the tables hold exactly what a full load of the newer run gives (the same load
    # when no run was loaded before)
    AnalyticsRun.objects.all().delete()
    load.load_run(out, second)
    full = _trend_rows()
    assert not set(full["event_trends"].values()) & set(after["event_trends"].values())
    assert _values(after) == _values(full)
    assert full["event_trends"][("db", "delete", "hour", HOUR)][1][-4:] == (None, 3.0, None, None)

    # When the same run is loaded again, nothing of the trends is rewritten
    load.load_run(out, second)
    assert _trend_rows() == full


@pytest.mark.parametrize("how", ["pruned", "unreadable"])
def test_without_the_previous_runs_trends_the_trends_are_replaced_whole(tmp_path, how):
    out = str(tmp_path)
    first, second = _two_runs(out)
    load.load_run(out, first)
    before = _trend_rows()
    # Given the loaded run's folder is gone (analytics.runs.prune), or its event trends unreadable
    if how == "pruned":
        assert runs.prune(out, keep=1) == [first]
    else:
        with open(f"{runs.run_path(out, first)}/event_trends.parquet", "wb") as f:
            f.write(b"not parquet")
    # When the newer run is loaded
    load.load_run(out, second)
    # Then every row of those trends is a new one (the subscriber trends of a run whose event
    # trends are unreadable are still compared)
    after = _trend_rows()
    for name in load.TRENDS:
        replaced = not set(before[name].values()) & set(after[name].values())
        assert replaced == (how == "pruned" or name == "event_trends"), name
    # ... and they are the newer run's
    assert len(after["event_trends"]) == 10 and len(after["subscriber_trends"]) == 8
    assert after["subscriber_trends"][("logger", "hour", HOUR.replace(hour=11))][1] == (
        "logger",
        "hour",
        HOUR.replace(hour=11),
        1,
        1,
        0,
    )


def test_trends_changed_behind_the_loads_back_are_replaced_whole(tmp_path):
    out = str(tmp_path)
    first, second = _two_runs(out)
    load.load_run(out, first)
    # Given a row of the tables that the last loaded run does not have
    SubscriberTrend.objects.create(
        subscriber="stray", period="hour", period_start=HOUR, published=1, acked=0, backlog=0
    )
    # When the newer run is loaded, the tables hold its rows, and only those
    load.load_run(out, second)
    assert set(_trend_rows()["subscriber_trends"]) == {
        *(("logger", "hour", h) for h in EARLIER),
        ("logger", "hour", HOUR),
        ("logger", "hour", HOUR.replace(hour=11)),
        ("logger", "day", DAY),
        ("logger", "hour", HOUR.replace(hour=12)),
    }


def test_a_load_that_fails_midway_leaves_the_previous_figures(tmp_path):
    out = str(tmp_path)
    first = write_run(
        out, events=[EVENT], event_trends=[{"queue": "db", "event": "create", "period_start": HOUR}]
    )
    load.load_run(out, first)
    before = (_trend_rows(), list(EventStats.objects.values_list("id", flat=True)))
    # Given a run whose new trend row the table refuses (no count of messages), after the
    # statistics were replaced and the trend rows it changes deleted
    broken = write_run(
        out,
        events=[{**EVENT, "event": "delete"}],
        event_trends=[
            {"queue": "db", "event": "create", "period_start": HOUR, "messages": 5},
            {"queue": "db", "event": "create", "period_start": HOUR.replace(hour=11), "messages": None},
        ],
    )
    with pytest.raises(IntegrityError):
        load.load_run(out, broken)
    # Then the previous run's figures are all there, as they were
    assert (_trend_rows(), list(EventStats.objects.values_list("id", flat=True))) == before
    assert stored.last_run().run_id == first
    # ... and a run with a key twice is refused before anything is written
    twice = write_run(out, event_trends=[{"queue": "db", "event": "create", "period_start": HOUR}] * 2)
    with pytest.raises(runs.BadRun, match="two rows for one queue, event, period, period_start"):
        load.load_run(out, twice)
    assert stored.last_run().run_id == first
