"""`manage.py analyze`: extract the hot tables, run the Spark job over them and the archive, store
and print the results. The history is made in the database with known outcomes and latencies,
partly archived, partly left in both places by a crash; the expected figures are computed in
plain Python from the rows before any of it moved."""

import io
import json
import os
from datetime import datetime, timedelta

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from analytics import archive, extract, runs, stored
from analytics.models import EventStats, EventTrend, SubscriberStats
from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Message
from tests.analytics import history
from tests.analytics.history import within_rank
from tests.analytics.locks import archive_held_elsewhere
from tests.support.history_rows import days_ago, publish_at, settle

pytestmark = pytest.mark.django_db

EVENT_KEYS = {"queue", "event", "messages", "deliveries", "acked", "dead", "latency_ms", "attempts_mean"}
SUBSCRIBER_KEYS = {"subscriber", "pending", "oldest_pending_age_s", "acked", "dead"}
# The job's other figures, added beside the contract's (API.md allows adding fields).
EVENT_EXTRA_KEYS = set(stored.EVENT_EXTRAS) | {"first_published_at", "last_published_at"}
SUBSCRIBER_EXTRA_KEYS = set(stored.SUBSCRIBER_EXTRAS)


def snapshot():
    """The figures expected of the job, from the rows as they are now (plain Python)."""
    messages = list(Message.objects.values("id", "queue__name", "event__name"))
    deliveries = list(
        Delivery.objects.values(
            "queue__name", "event__name", "subscriber__name", "status", "attempt", "created_at", "acked_at"
        )
    )
    events = {}
    for m in messages:
        key = (m["queue__name"], m["event__name"])
        events.setdefault(key, {"messages": 0, "deliveries": [], "latencies": []})["messages"] += 1
    for d in deliveries:
        e = events[(d["queue__name"], d["event__name"])]
        e["deliveries"].append(d)
        if d["status"] == Status.ACKED:
            e["latencies"].append((d["acked_at"] - d["created_at"]) / timedelta(milliseconds=1))
    subscribers = {}
    for d in deliveries:
        subscribers.setdefault(d["subscriber__name"], []).append(d)
    return events, subscribers


@pytest.mark.parametrize("in_process", [False, True], ids=["spark", "in-process"])
def test_analyze_counts_the_archive_and_the_hot_tables_once(
    spark,
    archive_dir,
    make_queue,
    db_queue,
    logger,
    peer,
    monkeypatch,
    settings,
    in_process,
):
    # The archive reduced by Spark, or (a small archive after the folder's first run, by
    # default) in this process
    if in_process:
        settings.MQ_ANALYTICS_LOCAL_BYTES = 1 << 20
    # Given history in two queues: old settled messages, open and dead deliveries, fresh ones
    network, db = make_queue("network"), db_queue
    logger.subscribe_queues.add(network)  # a subscription is owed only what its right allows
    for queue in (db, network):
        subscribing.subscribe(logger, queue)
    subscribing.subscribe(peer, db)
    latencies = iter(range(10, 100_000, 37))
    for i in range(30):
        queue, event = ((db, "create"), (db, "delete"), (network, "error"))[i % 3]
        at = days_ago(12 - i * 0.3)
        message_id = publish_at(queue, event, at, {"i": i})
        outcomes = {logger: Status.ACKED}
        if queue == db:
            outcomes[peer] = (Status.ACKED, Status.ACKED, Status.ACKED, Status.PENDING, Status.DEAD)[i % 5]
        if i == 29:
            outcomes[logger] = Status.INFLIGHT
        settle(message_id, outcomes, latency_ms=next(latencies) * 1.5, attempts=1 + i % 3)
    events, subscribers = snapshot()
    assert sum(e["messages"] for e in events.values()) == 30

    if in_process:  # the beat's earlier run, before anything was archived (nothing to reduce)
        call_command("analyze", stdout=io.StringIO())
    # ... of which the settled part older than 5 days is archived, and one batch of it is
    # written but, the archive dying before its delete, still in the hot tables too
    real_delete = archive.delete_archived
    calls = []

    def crash_on_third_batch(message_ids, delivery_ids):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real_delete(message_ids, delivery_ids)

    monkeypatch.setattr(archive, "delete_archived", crash_on_third_batch)
    with pytest.raises(RuntimeError):
        archive.archive_history(older_than_days=5, batch_size=3)
    monkeypatch.setattr(archive, "delete_archived", real_delete)
    assert Message.objects.count() < 30 and os.listdir(archive_dir / "messages")

    # When
    out = io.StringIO()
    before = timezone.now()
    call_command("analyze", "--json", stdout=out)
    after = timezone.now()
    result = json.loads(out.getvalue())

    # Then: the contract's object, with the extra figures beside its fields
    assert set(result) == {"events", "subscribers"}
    assert all(
        set(e) == EVENT_KEYS | EVENT_EXTRA_KEYS and set(e["latency_ms"]) == {"p50", "p95", "p99"}
        for e in result["events"]
    )
    assert all(set(s) == SUBSCRIBER_KEYS | SUBSCRIBER_EXTRA_KEYS for s in result["subscribers"])
    # ... and every figure as counted before anything moved
    assert [(e["queue"], e["event"]) for e in result["events"]] == sorted(events)
    for e in result["events"]:
        want = events[(e["queue"], e["event"])]
        ds = want["deliveries"]
        assert e["messages"] == want["messages"]
        assert e["deliveries"] == len(ds)
        assert e["acked"] == sum(d["status"] == Status.ACKED for d in ds)
        assert e["dead"] == sum(d["status"] == Status.DEAD for d in ds)
        settled = [d["attempt"] for d in ds if d["status"] in (Status.ACKED, Status.DEAD)]
        assert e["attempts_mean"] == pytest.approx(sum(settled) / len(settled))
        lat = sorted(want["latencies"])
        for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            assert within_rank(lat, q, e["latency_ms"][name]), (e["queue"], e["event"], name)
    assert [s["subscriber"] for s in result["subscribers"]] == sorted(subscribers)
    for s in result["subscribers"]:
        ds = subscribers[s["subscriber"]]
        for status in ("pending", "acked", "dead"):
            assert s[status] == sum(d["status"] == status for d in ds), (s["subscriber"], status)
        pending = [d["created_at"] for d in ds if d["status"] == Status.PENDING]
        if pending:
            assert (before - min(pending)).total_seconds() <= s["oldest_pending_age_s"]
            assert s["oldest_pending_age_s"] <= (after - min(pending)).total_seconds()
        else:
            assert s["oldest_pending_age_s"] is None

    # ... stored for the admin, and written to a run folder beside the archive, made current
    assert EventStats.objects.count() == len(events)
    assert SubscriberStats.objects.count() == len(subscribers)
    assert EventTrend.objects.filter(period="hour").exists()
    assert {s.computed_at for s in EventStats.objects.all()} == {SubscriberStats.objects.first().computed_at}
    out_dir = archive_dir / "_analytics"
    first = runs.current(str(out_dir))
    assert first and stored.last_run().run_id == first and stored.last_run().spark is not in_process
    assert {"manifest.json", "event_stats.parquet", "event_trends.parquet"} <= set(
        os.listdir(runs.run_path(str(out_dir), first))
    )

    # When it runs again with nothing new, no Spark job runs, and it replaces its results
    # instead of adding to them
    again = io.StringIO()
    call_command("analyze", "--json", stdout=again)
    rerun = json.loads(again.getvalue())
    ageless = {"oldest_pending_age_s", "lag_s"}  # later now, older pending deliveries
    assert rerun["events"] == result["events"]
    assert [{k: v for k, v in s.items() if k not in ageless} for s in rerun["subscribers"]] == [
        {k: v for k, v in s.items() if k not in ageless} for s in result["subscribers"]
    ]
    assert EventStats.objects.count() == len(events)
    last = stored.last_run()
    assert last.run_id == runs.current(str(out_dir)) != first
    assert not last.spark and last.partitions_recomputed == 0 and last.partitions_reused > 0


def test_analyze_json_adds_rates_fanout_dead_letters_backlog_and_lag(
    spark,
    archive_dir,
    monkeypatch,
):
    # Given the generated history (tests/analytics/history.py): archived batches, the hot
    # rows, and the overlap a crash leaves; its hot part is what the snapshot finds
    h = history.generate()
    hot = history.write(h, str(archive_dir))
    monkeypatch.setattr(extract, "hot_snapshot", lambda: hot)

    # When
    out = io.StringIO()
    before = timezone.now()
    call_command("analyze", "--json", stdout=out)
    after = timezone.now()
    result = json.loads(out.getvalue())

    # Then each event's extra figures are those computed in plain Python from the unique rows
    events = history.expected_events(h)
    assert [(e["queue"], e["event"]) for e in result["events"]] == sorted(events)
    for e in result["events"]:
        want = events[(e["queue"], e["event"])]
        where = (e["queue"], e["event"])
        assert (e["messages"], e["deliveries"], e["dead"]) == (
            want["messages"],
            want["deliveries"],
            want["dead"],
        ), where
        assert (e["pending"], e["inflight"]) == (want["pending"], want["inflight"]), where
        assert (e["peak_per_minute"], e["peak_per_hour"]) == (
            want["peak_per_minute"],
            want["peak_per_hour"],
        ), where
        for name in ("fanout", "dead_letter_rate", "messages_per_minute", "messages_per_hour"):
            assert e[name] == pytest.approx(want[name], rel=1e-9), (where, name)
        for name in ("first_published_at", "last_published_at"):
            assert datetime.fromisoformat(e[name]) == want[name], (where, name)
    # ... and each subscriber's backlog (pending and in flight) and lag (the age of its oldest
    # pending delivery when the run began)
    subscribers = history.expected_subscribers(h)
    assert [s["subscriber"] for s in result["subscribers"]] == sorted(subscribers)
    for s in result["subscribers"]:
        want = subscribers[s["subscriber"]]
        assert s["deliveries"] == want["deliveries"]
        assert (s["pending"], s["inflight"]) == (want["pending"], want["inflight"])
        assert s["backlog"] == want["pending"] + want["inflight"] > 0
        # `want` is the lag at history.NOW; the run measured it at its own now, in [before, after].
        lag_at_now = want["oldest_pending_age_s"]
        shift = (before - history.NOW).total_seconds(), (after - history.NOW).total_seconds()
        assert lag_at_now + shift[0] <= s["lag_s"] <= lag_at_now + shift[1], s["subscriber"]
        assert s["lag_s"] == s["oldest_pending_age_s"]


def test_analyze_with_nothing_anywhere_stores_nothing(spark, archive_dir):
    # Twice: the second keeps the first's hour rows of no partition (a new install's archive
    # stays empty for its queues' retention, while the beat runs the analysis every hour)
    for _ in range(2):
        out = io.StringIO()
        call_command("analyze", "--json", stdout=out)
        assert json.loads(out.getvalue()) == {"events": [], "subscribers": []}
        assert not EventStats.objects.exists() and not stored.last_run().spark


def test_analyze_over_a_window_prints_its_days_and_stores_nothing(
    spark,
    archive_dir,
    monkeypatch,
):
    h = history.generate()
    hot = history.write(h, str(archive_dir))
    monkeypatch.setattr(extract, "hot_snapshot", lambda: hot)
    day = (history.START + timedelta(days=1)).date()

    out = io.StringIO()
    call_command("analyze", "--json", "--since", day.isoformat(), "--until", day.isoformat(), stdout=out)

    result = json.loads(out.getvalue())
    in_day = {m["id"] for m in h.messages if m["created_at"].date() == day}
    assert sum(e["messages"] for e in result["events"]) == len(in_day) > 0
    # ... with all their deliveries, those a replay made on a later day too
    assert sum(e["deliveries"] for e in result["events"]) == sum(
        d["message_id"] in in_day for d in h.deliveries
    )
    assert not EventStats.objects.exists() and stored.last_run() is None
    assert runs.current(str(archive_dir / "_analytics")) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--since", "2026-13-01"], "not a date"),
        (["--until", "yesterday"], "not a date"),
        (["--since", "2026-11-20", "--until", "2026-11-19"], "is after"),
    ],
)
def test_analyze_refuses_a_bad_window(archive_dir, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("analyze", *args, stdout=io.StringIO())


def test_analyze_waits_for_the_archive_then_gives_up_clearly(archive_dir, settings):
    """One run at a time, and none while the archive or its compaction writes: a run finding
    the archive held past MQ_ANALYZE_LOCK_WAIT_SECS stops with a clear error, having done
    nothing."""
    settings.MQ_ANALYZE_LOCK_WAIT_SECS = 0.5
    with archive_held_elsewhere(archive_dir):
        with pytest.raises(CommandError, match="try again"):
            call_command("analyze", stdout=io.StringIO())
    assert stored.last_run() is None and runs.current(str(archive_dir / "_analytics")) is None


def test_the_admin_shows_the_statistics_read_only(operator_client):
    now = timezone.now()
    EventStats.objects.create(
        queue="db",
        event="create",
        messages=3,
        deliveries=6,
        pending=1,
        inflight=0,
        acked=4,
        dead=1,
        fanout=2.0,
        latency_p50_ms=12.5,
        latency_p95_ms=80.0,
        latency_p99_ms=99.0,
        attempts_mean=1.4,
        dead_letter_rate=1 / 6,
        messages_per_minute=0.5,
        messages_per_hour=3.0,
        computed_at=now,
    )
    EventTrend.objects.create(
        queue="db",
        event="create",
        period="hour",
        period_start=now.replace(minute=0),
        messages=3,
        deliveries=6,
        acked=4,
        dead=1,
        dead_letter_rate=1 / 6,
    )
    SubscriberStats.objects.create(
        subscriber="logger",
        deliveries=6,
        pending=1,
        inflight=0,
        acked=4,
        dead=1,
        oldest_pending_age_s=42.0,
        computed_at=now,
    )
    for model, text in ((EventStats, "16.67%"), (EventTrend, "db"), (SubscriberStats, "42 s")):
        url = reverse(f"admin:analytics_{model._meta.model_name}_changelist")
        page = operator_client.get(url)
        assert page.status_code == 200 and text in page.content.decode()
        assert (
            operator_client.get(reverse(f"admin:analytics_{model._meta.model_name}_add")).status_code == 403
        )
        obj = model.objects.get()
        change = operator_client.post(
            reverse(f"admin:analytics_{model._meta.model_name}_delete", args=[obj.pk])
        )
        assert change.status_code == 403 and model.objects.filter(pk=obj.pk).exists()
