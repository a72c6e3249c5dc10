"""A run with nothing new takes the current run's figures (analytics.reuse): the same, to the bit,
as a full run over the same inputs at the same time, and a full run whenever an input differs."""

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from analytics import analysis, layout, load, reuse, runs
from analytics.models import AnalyticsRun, EventTrend, SubscriberStats
from tests.analytics import history

# The first run's time: a day and a half before the history's end, so that its windows reach
# back into the archived days (the hours a later window can still need are kept) and the next
# runs' later windows start within them.
FIRST = history.NOW - timedelta(hours=30)
LATER = FIRST + timedelta(hours=2, minutes=20)

RESULTS = ("event_stats", "subscriber_stats", "event_windows", "subscriber_windows")


@pytest.fixture
def in_process(settings):
    """Arrow, not Spark, for the archive's partitions (the tests' default is Spark): the same
    hour rows (test_job holds both engines to them), a JVM's start less."""
    settings.MQ_ANALYTICS_LOCAL_BYTES = 1 << 30


@pytest.fixture
def first(tmp_path, in_process):
    h = history.generate(seed=5, n_messages=400)
    snapshot = history.write(h, tmp_path / "archive")
    archive, out = str(tmp_path / "archive"), str(tmp_path / "out")
    run = analysis.compute(archive, out, snapshot, now=FIRST)
    runs.switch(out, run.run_id)
    return archive, out, snapshot, run


def full_run(archive, snapshot, now, tmp_path):
    """A run with no current run to take from."""
    return analysis.compute(archive, str(tmp_path / "fresh"), snapshot, now=now)


def same_figures(a, b):
    for name in RESULTS:
        assert getattr(a, name) == getattr(b, name), name
    assert a.event_trends.equals(b.event_trends)
    assert a.subscriber_trends.equals(b.subscriber_trends)


def test_a_later_run_with_nothing_new_gives_a_full_runs_figures_with_the_ages_and_windows_moved(
    first, tmp_path
):
    archive, out, snapshot, run = first
    again = analysis.compute(archive, out, snapshot, now=LATER)
    assert again.manifest["reuse"]["figures_of"] == run.run_id
    assert not again.manifest["spark"]
    assert again.manifest["partitions"]["recomputed"] == 0
    full = full_run(archive, snapshot, LATER, tmp_path)
    assert full.manifest["reuse"]["figures_of"] == full.run_id  # computed, not taken
    same_figures(again, full)

    # What moved with the clock moved: every pending age by the 2 h 20 min between the runs,
    # and the windows (the archived hours they reach are the kept ones)
    ages = {s["subscriber"]: s["oldest_pending_age_s"] for s in run.subscriber_stats}
    moved = [s for s in again.subscriber_stats if s["oldest_pending_age_s"] is not None]
    assert moved
    for s in moved:
        assert s["oldest_pending_age_s"] == pytest.approx(ages[s["subscriber"]] + 140 * 60)
    assert again.event_windows != run.event_windows
    kept = Path(runs.run_path(out, run.run_id), reuse.RECENT["events"])
    assert kept.stat().st_size > 0

    # ... and a run after it takes the same figures, from the run they were computed by.
    runs.switch(out, again.run_id)
    third = analysis.compute(archive, out, snapshot, now=LATER + timedelta(minutes=30))
    assert third.manifest["reuse"]["figures_of"] == run.run_id
    same_figures(third, full_run(archive, snapshot, LATER + timedelta(minutes=30), tmp_path / "3"))


def test_a_changed_hot_row_a_changed_archive_or_an_earlier_time_make_a_full_run(first, tmp_path):
    archive, out, snapshot, run = first
    # One hot delivery less: the hot tables' hour rows differ.
    fewer = dataclasses.replace(snapshot, deliveries=snapshot.deliveries.slice(1))
    changed = analysis.compute(archive, out, fewer, now=LATER)
    assert changed.manifest["reuse"]["figures_of"] == changed.run_id
    same_figures(changed, full_run(archive, fewer, LATER, tmp_path / "a"))
    assert changed.subscriber_stats != full_run(archive, snapshot, LATER, tmp_path / "b").subscriber_stats

    # An earlier time than the run's: its windows would reach hours the run did not keep.
    earlier = analysis.compute(archive, out, snapshot, now=FIRST - timedelta(hours=1))
    assert earlier.manifest["reuse"]["figures_of"] == earlier.run_id

    # A window of days computes its own and keeps nothing to take.
    windowed = analysis.compute(archive, out, snapshot, now=LATER, since=FIRST.date())
    assert windowed.manifest["reuse"] is None

    # A partition gone from the archive (its files removed by hand): another fingerprint.
    day = sorted(Path(archive).glob("deliveries/queue=*/day=*"))[0]
    for file in day.glob("*.parquet"):
        file.unlink()
    gone = analysis.compute(archive, out, snapshot, now=LATER)
    assert gone.manifest["reuse"]["figures_of"] == gone.run_id
    assert gone.manifest["partitions"]["recomputed"] > 0
    same_figures(gone, full_run(archive, snapshot, LATER, tmp_path / "c"))


def test_other_analytics_code_of_the_same_release_makes_a_full_run(first, monkeypatch):
    """A deployment of unreleased code (VERSION unchanged) that computes a figure otherwise
    must not serve the last run's figures."""
    archive, out, snapshot, run = first
    same = analysis.compute(archive, out, snapshot, now=LATER)
    assert same.manifest["reuse"]["figures_of"] == run.run_id
    monkeypatch.setattr(reuse, "_code", lambda: "the analytics code of another commit")
    other = analysis.compute(archive, out, snapshot, now=LATER)
    assert other.manifest["reuse"]["figures_of"] == other.run_id


def test_a_day_of_messages_no_one_subscribed_to_is_counted_beside_another_queues(tmp_path, in_process):
    """The archive writes no deliveries file for a day whose messages had no subscriber; the
    in-process reduction reads a day's partitions of every queue together, so the empty one
    must join the others (it failed the whole run: ArrowInvalid, schemas differ)."""
    at = history.START + timedelta(hours=3)
    archive = tmp_path / "archive"
    quiet = [(1, "create", 1, at, "{}", None, None, None)]
    busy = [(2, "error", 1, at, "{}", None, None, None)]
    delivered = [(20, 2, "error", "logger", 1, "acked", 1, at, at, at + timedelta(milliseconds=5), None)]
    layout.write_history(str(archive), "db", quiet, [], durable=False)
    layout.write_history(str(archive), "network", busy, delivered, durable=False)
    snapshot = history.write(history.History(), tmp_path / "unused")  # no hot rows
    run = analysis.compute(str(archive), str(tmp_path / "out"), snapshot, now=history.NOW)
    counts = {(s["queue"], s["event"]): (s["messages"], s["deliveries"]) for s in run.event_stats}
    assert counts == {("db", "create"): (1, 0), ("network", "error"): (1, 1)}


@pytest.mark.parametrize("file", [analysis.EVENT_HOURS, "subscriber_trends.parquet"])
def test_a_run_whose_file_cannot_be_written_fails_and_the_current_run_stays(
    first, tmp_path, monkeypatch, file
):
    """The hour rows and the trends are written on threads beside the figures: a disk error
    there fails the run as one in line would, and the next run takes no half-written folder."""
    archive, out, snapshot, run = first
    real_write = layout.write_run_file

    def write_run_file(folder, name, table):
        if name == file:
            raise OSError(28, "No space left on device")
        real_write(folder, name, table)

    monkeypatch.setattr(layout, "write_run_file", write_run_file)
    # A partition gone from the archive: a run that recomputes and writes its hour rows.
    for day in sorted(Path(archive).glob("deliveries/queue=*/day=*"))[:1]:
        for part in day.glob("*.parquet"):
            part.unlink()
    with pytest.raises(OSError, match="No space left"):
        analysis.compute(archive, out, snapshot, now=LATER)
    assert runs.current(out) == run.run_id
    monkeypatch.setattr(layout, "write_run_file", real_write)
    again = analysis.compute(archive, out, snapshot, now=LATER)
    assert again.manifest["partitions"]["recomputed"] > 0
    same_figures(again, full_run(archive, snapshot, LATER, tmp_path / "fresh"))


def stored_trends():
    return sorted(EventTrend.objects.values_list("queue", "event", "period", "period_start", "messages"))


@pytest.mark.django_db
def test_loading_a_run_that_took_the_figures_writes_no_trend_row_yet_mends_a_table_that_lost_some(first):
    archive, out, snapshot, run = first
    load.load_run(out, run.run_id)
    trends = stored_trends()
    ids = set(EventTrend.objects.values_list("id", flat=True))

    again = analysis.compute(archive, out, snapshot, now=LATER)
    runs.switch(out, again.run_id)
    with CaptureQueriesContext(connection) as queries:
        load.load_run(out, again.run_id)
    writes = ("INSERT", "COPY", "DELETE")
    assert not [q for q in queries if "analytics_eventtrend" in q["sql"] and q["sql"].startswith(writes)]
    assert set(EventTrend.objects.values_list("id", flat=True)) == ids  # the very rows, kept
    ages = dict(SubscriberStats.objects.values_list("subscriber", "oldest_pending_age_s"))
    assert ages == {s["subscriber"]: s["oldest_pending_age_s"] for s in again.subscriber_stats}
    assert AnalyticsRun.objects.order_by("-loaded_at").first().run_id == again.run_id

    # The table lost a row (by hand): the next load of the same figures puts them all back.
    EventTrend.objects.filter(id=min(ids)).delete()
    third = analysis.compute(archive, out, snapshot, now=LATER + timedelta(minutes=5))
    assert third.manifest["reuse"]["figures_of"] == run.run_id
    load.load_run(out, third.run_id)
    assert stored_trends() == trends


def test_a_current_run_missing_a_file_it_would_be_taken_from_is_computed_again(first, tmp_path, caplog):
    archive, out, snapshot, run = first
    (Path(runs.run_path(out, run.run_id)) / reuse.SUBSCRIBER_OLDEST).unlink()
    again = analysis.compute(archive, out, snapshot, now=LATER)
    assert again.manifest["reuse"]["figures_of"] == again.run_id
    assert "cannot take run" in caplog.text
    same_figures(again, full_run(archive, snapshot, LATER, tmp_path))
