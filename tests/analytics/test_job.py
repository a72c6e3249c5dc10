"""The analytics computation without a database: the Spark job's transforms on tiny hand-made
data, the same hour rows from Arrow, and whole runs (analytics.analysis.compute) over a
generated archive and hot snapshot, every figure checked against plain Python and DuckDB
reading the same Parquet."""

from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from django.test import override_settings

from analytics import analysis, figures, hours, job, layout, partitions, runs
from tests.analytics import history, sketch_rule
from tests.analytics.frames import DELIVERY_FIELDS, MESSAGE_FIELDS, frame, ts
from tests.analytics.reference import assert_agrees_with_duckdb, duckdb_events


def hours_of(spark, messages, deliveries):
    parts = job.compute_parts(
        spark,
        frame(spark, "messages", MESSAGE_FIELDS, messages),
        frame(spark, "deliveries", DELIVERY_FIELDS, deliveries),
    )
    derived = analysis._derived(parts)
    return derived["events"], derived["subscribers"]


# --- tiny expected data ---------------------------------------------------------------------------


def test_it_computes_event_stats_of_a_tiny_history(spark):
    # Given two messages of db/create, one of db/delete, and their deliveries
    event_rows, _ = hours_of(
        spark,
        [("db", "create", ts(0)), ("db", "create", ts(90)), ("db", "delete", ts(3600))],
        [
            ("db", "create", "logger", "acked", 1, ts(0), ts(0.25)),
            ("db", "create", "peer", "acked", 3, ts(0), ts(2)),
            ("db", "create", "logger", "dead", 5, ts(90), None),
            ("db", "create", "peer", "pending", 0, ts(90), None),
            ("db", "delete", "logger", "inflight", 1, ts(3600), None),
        ],
    )
    # When
    stats, _ = figures.event_figures(event_rows)
    stats = {(s["queue"], s["event"]): s for s in stats}
    # Then: counted by hand
    create = stats[("db", "create")]
    assert (create["messages"], create["deliveries"]) == (2, 4)
    assert (create["pending"], create["inflight"], create["acked"], create["dead"]) == (1, 0, 2, 1)
    assert create["fanout"] == 2.0
    assert create["latency_p50_ms"] == 250.0 and create["latency_p99_ms"] == 2000.0
    assert create["attempts_mean"] == 3.0  # (1 + 3 + 5) / 3: acked and dead only
    assert create["dead_letter_rate"] == 0.25
    assert create["messages_per_minute"] == 1.0  # minutes 12:00 and 12:01, one message each
    assert (create["peak_per_minute"], create["peak_per_hour"], create["messages_per_hour"]) == (1, 2, 2.0)
    delete = stats[("db", "delete")]
    assert (delete["messages"], delete["deliveries"], delete["inflight"], delete["acked"]) == (1, 1, 1, 0)
    assert delete["latency_p50_ms"] is None and delete["attempts_mean"] is None
    assert delete["dead_letter_rate"] == 0.0


def test_it_counts_an_event_with_no_deliveries(spark):
    event_rows, _ = hours_of(spark, [("db", "create", ts(0))], [])
    stats, _ = figures.event_figures(event_rows)
    assert [
        (s["messages"], s["deliveries"], s["acked"], s["fanout"], s["dead_letter_rate"]) for s in stats
    ] == [(1, 0, 0, 0.0, None)]


def test_it_measures_each_subscribers_backlog_and_lag(spark):
    _, subscriber_rows = hours_of(
        spark,
        [],
        [
            ("db", "create", "logger", "pending", 0, ts(0), None),
            ("db", "create", "logger", "pending", 2, ts(30), None),
            ("db", "create", "logger", "inflight", 1, ts(-100), None),  # in flight: not pending
            ("db", "create", "logger", "acked", 1, ts(-200), ts(-199)),
            ("db", "create", "peer", "dead", 5, ts(0), None),
        ],
    )
    stats, trends = figures.subscriber_figures(subscriber_rows, now=ts(60))
    stats = {s["subscriber"]: s for s in stats}
    logger, peer = stats["logger"], stats["peer"]
    assert (logger["pending"], logger["inflight"], logger["acked"], logger["dead"]) == (2, 1, 1, 0)
    assert logger["oldest_pending_age_s"] == 60.0
    assert (peer["pending"], peer["dead"], peer["oldest_pending_age_s"]) == (0, 1, None)
    # ... and its backlog at the end of each hour: 11:00 made 2 and acked 1, 12:00 made 2 more
    hourly = {(t["subscriber"], t["period_start"]): t for t in trends.to_pylist() if t["period"] == "hour"}
    assert hourly[("logger", ts(-3600))]["backlog"] == 1
    assert hourly[("logger", ts(0))]["backlog"] == 3
    assert hourly[("peer", ts(0))]["backlog"] == 0  # a dead letter is owed nothing more


def test_it_reads_the_layout_as_the_archive_writes_it():
    """The job's Spark schema is the layout's, plus the two partition columns."""
    assert job.MESSAGE_SCHEMA.names == [*layout.MESSAGE_SCHEMA.names, "queue", "day"]
    assert job.DELIVERY_SCHEMA.names == [*layout.DELIVERY_SCHEMA.names, "queue", "day"]


def test_a_sketch_is_never_bigger_than_its_hour():
    """An hour of at most K acked deliveries keeps its latencies, exact; a busier one K points,
    the ceil(i * n / K)-th smallest: both engines (test_the_arrow_parts_are_sparks) by this rule."""
    assert sketch_rule.points([30.0, 10.0, 20.0]) == [10.0, 20.0, 30.0]
    busy = [float(v) for v in range(1000, 0, -1)]
    points = sketch_rule.points(busy)
    assert len(points) == job.SKETCH_POINTS == 200
    assert points[:3] == [5.0, 10.0, 15.0] and points[-1] == 1000.0
    merged = sketch_rule.Merged()
    merged.add(sketch_rule.points([1.0, 2.0, 3.0, 4.0]), 4)
    assert merged.quantiles([0.5, 0.75, 1.0]) == [2.0, 3.0, 4.0]


def test_merged_sketches_stay_within_one_percent_of_rank():
    """Hours of very different spreads, merged: every percentile within 1 % of rank."""
    values = [[(h + 1) * (i % 97) + h * 1000 for i in range(50 + 40 * h)] for h in range(24)]
    merged = sketch_rule.Merged()
    for hour in values:
        merged.add(sketch_rule.points(hour), len(hour))
    everything = sorted(v for hour in values for v in hour)
    ps = [i / 100 for i in range(1, 100)]
    for p, got in zip(ps, merged.quantiles(ps), strict=True):
        assert history.within_rank(everything, p, got), p


# --- whole runs on a generated history -----------------------------------------------------------


@pytest.fixture(scope="module")
def generated(spark, tmp_path_factory):
    base = tmp_path_factory.mktemp("generated")
    h = history.generate()
    snapshot = history.write(h, base / "archive")
    # Module-scoped, so before the suite's function-scoped settings: Spark is asked for here.
    with override_settings(MQ_ANALYTICS_LOCAL_BYTES=0):
        run = analysis.compute(str(base / "archive"), str(base / "out"), snapshot, now=history.NOW)
    return h, base, snapshot, run


def test_the_generated_history_has_the_overlap_a_crash_leaves(generated):
    h, base, snapshot, run = generated
    archived = {r["id"] for r in pq.read_table(base / "archive" / "messages").to_pylist()}
    hot = set(snapshot.messages["id"].to_pylist())
    assert archived & hot and archived | hot == {m["id"] for m in h.messages}
    assert run.manifest["rows"]["hot_overlap_messages"] == len(archived & hot)


def test_the_archives_copy_wins_over_the_snapshots(generated):
    """The overlap's hot copy says pending (seen before the acks); the archive says acked."""
    h, _, snapshot, run = generated
    stale = {d["id"] for d in snapshot.deliveries.to_pylist() if d["status"] == "pending"} & {
        d["id"] for d in h.deliveries if d["status"] == "acked"
    }
    assert stale
    acked = sum(d["status"] == "acked" for d in h.deliveries)
    pending = sum(d["status"] == "pending" for d in h.deliveries)
    assert sum(s["acked"] for s in run.event_stats) == acked
    assert sum(s["pending"] for s in run.event_stats) == pending


def test_it_counts_every_event_as_python_does(generated):
    h, _, _, run = generated
    expected = history.expected_events(h)
    got = {(r["queue"], r["event"]): r for r in run.event_stats}
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        row = got[key]
        for name in ("messages", "deliveries", "pending", "inflight", "acked", "dead"):
            assert row[name] == want[name], (key, name)
        for name in (
            "fanout",
            "attempts_mean",
            "dead_letter_rate",
            "messages_per_minute",
            "messages_per_hour",
        ):
            assert row[name] == pytest.approx(want[name], rel=1e-12), (key, name)
        assert (row["peak_per_minute"], row["peak_per_hour"]) == (
            want["peak_per_minute"],
            want["peak_per_hour"],
        )
        assert row["first_published_at"] == want["first_published_at"]
        assert row["last_published_at"] == want["last_published_at"]


def test_its_latency_percentiles_are_within_one_percent(generated):
    h, _, _, run = generated
    expected = history.expected_events(h)
    for row in run.event_stats:
        latencies = expected[(row["queue"], row["event"])]["latencies"]
        assert len(latencies) > 50
        for q, name in ((0.5, "latency_p50_ms"), (0.95, "latency_p95_ms"), (0.99, "latency_p99_ms")):
            assert history.within_rank(latencies, q, row[name]), (row["queue"], row["event"], name)


def test_it_agrees_with_duckdb_on_the_same_parquet(generated):
    _, base, snapshot, run = generated
    assert_agrees_with_duckdb(duckdb_events(base / "archive", snapshot), run.event_stats)


def test_its_trends_per_hour_and_per_day_are_python_s(generated):
    h, _, _, run = generated
    expected = history.expected_events(h)
    hourly = {}
    for t in run.event_trends.to_pylist():
        if t["period"] == "hour":
            hourly.setdefault((t["queue"], t["event"]), {})[t["period_start"]] = t["messages"]
    assert hourly == {key: want["per_hour"] for key, want in expected.items()}
    # A day's latency percentiles are the day's, within 1 % of rank, from its hours' sketches
    daily = [t for t in run.event_trends.to_pylist() if t["period"] == "day"]
    assert {t["period_start"].hour for t in daily} == {0}
    for t in daily:
        day = t["period_start"]
        latencies = sorted(
            history.latency_ms(d)
            for d in h.deliveries
            if (d["queue"], d["event"]) == (t["queue"], t["event"])
            and d["status"] == "acked"
            and day <= d["created_at"] < day + timedelta(days=1)
        )
        assert t["acked"] == len(latencies)
        if latencies:
            assert history.within_rank(latencies, 0.95, t["latency_p95_ms"]), (t["queue"], t["event"], day)


def test_it_measures_every_subscribers_backlog_as_python_does(generated):
    h, _, _, run = generated
    expected = history.expected_subscribers(h)
    got = {r["subscriber"]: r for r in run.subscriber_stats}
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        row = got[name]
        for field in ("deliveries", "pending", "inflight", "acked", "dead"):
            assert row[field] == want[field], (name, field)
        assert row["oldest_pending_age_s"] == pytest.approx(want["oldest_pending_age_s"], abs=1e-6)
    # ... and at the end of each day, what it was owed then
    for t in run.subscriber_trends.to_pylist():
        if t["period"] != "day":
            continue
        end = t["period_start"] + timedelta(days=1)
        ds = [d for d in h.deliveries if d["subscriber"] == t["subscriber"] and d["created_at"] < end]
        owed = sum(
            1 for d in ds if d["status"] in ("pending", "inflight") or (d["acked_at"] or end) >= end
        ) - sum(1 for d in ds if d["status"] == "dead")
        assert t["backlog"] == owed, (t["subscriber"], t["period_start"])


def test_each_subscribers_latency_percentiles_are_within_one_percent(generated):
    """Which consumer is slow: each subscriber's publish-to-ack latency, from its own sketches
    (archive and hot tables merged), against its acked deliveries' latencies in plain Python."""
    h, _, _, run = generated
    expected = history.expected_subscribers(h)
    assert {r["subscriber"] for r in run.subscriber_stats} == expected.keys()
    for row in run.subscriber_stats:
        latencies = expected[row["subscriber"]]["latencies"]
        assert len(latencies) > 50
        for q, name in ((0.5, "latency_p50_ms"), (0.95, "latency_p95_ms"), (0.99, "latency_p99_ms")):
            assert history.within_rank(latencies, q, row[name]), (row["subscriber"], name)
    # ... and they differ by subscriber (not one figure copied to all)
    assert len({row["latency_p50_ms"] for row in run.subscriber_stats}) == len(run.subscriber_stats)


def test_the_arrow_parts_are_sparks(spark, generated):
    """The hot tables' parts come from Arrow when they are small and from Spark when they are
    big: the same rows either way."""
    _, base, snapshot, _ = generated
    messages, deliveries = layout.partition_days(snapshot.messages, snapshot.deliveries)
    layout.write_table(base / "hot", layout.MESSAGES, "part-0.parquet", messages, durable=False)
    layout.write_table(base / "hot", layout.DELIVERIES, "part-0.parquet", deliveries, durable=False)
    from_spark = job.compute_parts(
        spark,
        job.extract_snapshot(spark, base / "hot", layout.MESSAGES),
        job.extract_snapshot(spark, base / "hot", layout.DELIVERIES),
    )
    from_arrow = hours.parts(messages, deliveries)

    def rows(table, schema):
        out = []
        for r in table.cast(schema).to_pylist():
            if r.get("minute_counts") is not None:
                r["minute_counts"] = sorted((m["minute"], m["n"]) for m in r["minute_counts"])
            out.append(r)
        return sorted(out, key=lambda r: tuple(str(v) for v in r.values()))

    assert from_spark.keys() == from_arrow.keys() == hours.PART_SCHEMAS.keys()
    for name, schema in hours.PART_SCHEMAS.items():
        assert rows(from_spark[name], schema) == rows(from_arrow[name], schema), name
        assert len(from_arrow[name]) > 10


def test_the_production_plan_hashes_every_aggregate(spark, generated):
    """With adaptive execution on and several shuffle partitions, as a cluster runs it: the
    same figures, and no sort-based aggregate anywhere in the plan."""
    _, base, _, run = generated
    listing = partitions.list_archive(base / "archive")
    files = {k: [f for p in listing.values() for f in p.paths(k)] for k in partitions.KINDS}
    saved = {k: spark.conf.get(k) for k in ("spark.sql.adaptive.enabled", "spark.sql.shuffle.partitions")}
    spark.conf.set("spark.sql.adaptive.enabled", "true")
    spark.conf.set("spark.sql.shuffle.partitions", "8")
    try:
        job.configure(spark)
        messages = job.extract_archive(spark, base / "archive", layout.MESSAGES, files[layout.MESSAGES])
        deliveries = job.extract_archive(spark, base / "archive", layout.DELIVERIES, files[layout.DELIVERIES])
        plans = []
        for result in job.transforms(messages, deliveries).values():
            result.collect()
            plans.append(result._jdf.queryExecution().executedPlan().toString())
        events = analysis._derived(job.compute_parts(spark, messages, deliveries))["events"]
    finally:
        for key, value in saved.items():
            spark.conf.set(key, value)
    assert not any("SortAggregate" in p for p in plans), plans
    message_plan, cells_plan, sketch_plan, subscriber_sketch_plan = plans
    # The counts in a plain hash aggregate (generated code), the sketch in an object one
    assert "HashAggregate" in cells_plan and "ObjectHashAggregate" not in cells_plan
    assert "ObjectHashAggregate" in sketch_plan and "HashAggregate" in message_plan
    assert "ObjectHashAggregate" in subscriber_sketch_plan
    # ... and the archive's part of the figures is the same as the test session's plan gave
    archived = {
        r["fingerprint"]
        for r in pq.read_table(
            runs.run_path(base / "out", run.run_id) + "/" + analysis.EVENT_HOURS
        ).to_pylist()
    }
    assert len(archived) == len(listing)
    assert (
        events.num_rows
        == pq.read_metadata(runs.run_path(base / "out", run.run_id) + "/" + analysis.EVENT_HOURS).num_rows
    )


def test_big_hot_tables_go_to_spark_with_the_same_figures(generated, tmp_path, settings):
    """Past MQ_ANALYTICS_HOT_SPARK_ROWS deliveries the snapshot is reduced by Spark, not Arrow:
    the same figures."""
    _, base, snapshot, run = generated
    settings.MQ_ANALYTICS_HOT_SPARK_ROWS = 1
    big = analysis.compute(str(base / "archive"), str(tmp_path / "out"), snapshot, now=history.NOW)
    assert big.manifest["spark"]
    assert (big.event_stats, big.subscriber_stats, big.event_trends, big.subscriber_trends) == (
        run.event_stats,
        run.subscriber_stats,
        run.event_trends,
        run.subscriber_trends,
    )
    assert not (tmp_path / "out" / "runs" / big.run_id / "hot").exists()  # the snapshot's files go


# --- incremental, by day ---------------------------------------------------------------------------


def test_a_rerun_with_nothing_new_starts_no_spark_job_and_gives_the_same_figures(spark, tmp_path):
    h = history.generate(seed=11, n_messages=300)
    snapshot = history.write(h, tmp_path / "archive")
    archive, out = str(tmp_path / "archive"), str(tmp_path / "out")
    first = analysis.compute(archive, out, snapshot, now=history.NOW)
    runs.switch(out, first.run_id)
    assert first.manifest["spark"] and first.manifest["partitions"]["recomputed"] > 0

    again = analysis.compute(archive, out, snapshot, now=history.NOW)
    assert not again.manifest["spark"]
    assert again.manifest["partitions"]["recomputed"] == 0
    assert again.manifest["partitions"]["reused"] == first.manifest["partitions"]["total"]
    assert (again.event_stats, again.subscriber_stats, again.event_trends) == (
        first.event_stats,
        first.subscriber_stats,
        first.event_trends,
    )
    # Its hour rows are the first run's files, linked rather than written again, and stay
    # whole when the first run's folder is pruned.
    for name in (analysis.EVENT_HOURS, analysis.SUBSCRIBER_HOURS):
        mine, theirs = (Path(runs.run_path(out, r.run_id)) / name for r in (again, first))
        assert mine.samefile(theirs), name
    runs.switch(out, again.run_id)
    layout.remove_tree(runs.run_path(out, first.run_id))
    third = analysis.compute(archive, out, snapshot, now=history.NOW)
    assert third.manifest["partitions"]["recomputed"] == 0
    assert (third.event_stats, third.subscriber_trends) == (first.event_stats, again.subscriber_trends)


def test_a_small_archive_is_reduced_in_process_to_sparks_figures(generated, tmp_path, settings):
    """Up to MQ_ANALYTICS_LOCAL_BYTES to recompute, a folder's first run included, the
    archive's partitions are reduced with Arrow in this process, rule for rule like Spark: no
    Spark job, the same hour rows kept for the next run, and every figure the same."""
    _, base, snapshot, run = generated
    settings.MQ_ANALYTICS_LOCAL_BYTES = 1 << 30
    out = str(tmp_path / "out")
    local = analysis.compute(str(base / "archive"), out, snapshot, now=history.NOW)
    assert not local.manifest["spark"] and run.manifest["spark"]
    assert local.manifest["partitions"]["recomputed_in_process"] == local.manifest["partitions"]["total"] > 1
    assert local.manifest["rows"] == run.manifest["rows"]
    assert (local.event_stats, local.subscriber_stats, local.event_trends, local.subscriber_trends) == (
        run.event_stats,
        run.subscriber_stats,
        run.event_trends,
        run.subscriber_trends,
    )
    for name in (analysis.EVENT_HOURS, analysis.SUBSCRIBER_HOURS):
        kept = [pq.read_table(f"{o}/runs/{r.run_id}/{name}") for o, r in ((out, local), (base / "out", run))]
        assert _sorted_rows(kept[0]) == _sorted_rows(kept[1]), name


def _sorted_rows(table):
    out = []
    for r in table.to_pylist():
        if r.get("minute_counts") is not None:
            r["minute_counts"] = sorted((m["minute"], m["n"]) for m in r["minute_counts"])
        out.append(r)
    return sorted(out, key=lambda r: tuple(str(v) for v in r.values()))


@pytest.mark.parametrize("in_process", [False, True], ids=["spark", "in-process"])
def test_a_changed_day_alone_is_recomputed_and_merged_with_the_rest(spark, tmp_path, settings, in_process):
    # Given a run over the archive, current
    h = history.generate(seed=5, n_messages=300)
    snapshot = history.write(h, tmp_path / "archive")
    archive, out = str(tmp_path / "archive"), str(tmp_path / "out")
    runs.switch(out, analysis.compute(archive, out, snapshot, now=history.NOW).run_id)
    # When a message is archived late into a day already analysed (held back by a delivery
    # that took long to be acked), in a file of its own
    old = next(m for m in pq.read_table(tmp_path / "archive" / "messages").to_pylist() if m["queue"] == "db")
    late = {**next(m for m in h.messages if m["id"] == old["id"]), "id": 900_001}
    deliveries = [
        {**d, "id": 900_000 + i, "message_id": late["id"]}
        for i, d in enumerate((d for d in h.deliveries if d["message_id"] == old["id"]), start=2)
    ]
    layout.write_history(
        archive, "db", [h.message_tuple(late)], [h.delivery_tuple(d) for d in deliveries], durable=False
    )
    # (by Spark, or in this process: a few kilobytes to read)
    settings.MQ_ANALYTICS_LOCAL_BYTES = (1 << 20) if in_process else 0
    incremental = analysis.compute(archive, out, snapshot, now=history.NOW)
    # Then one partition is recomputed, and the figures are a full run's
    assert incremental.manifest["partitions"]["recomputed"] == 1
    assert incremental.manifest["partitions"]["recomputed_in_process"] == int(in_process)
    assert incremental.manifest["spark"] is not in_process
    settings.MQ_ANALYTICS_LOCAL_BYTES = 0
    full = analysis.compute(archive, str(tmp_path / "fresh"), snapshot, now=history.NOW)
    assert full.manifest["partitions"]["recomputed"] == full.manifest["partitions"]["total"] > 1
    assert incremental.event_stats == full.event_stats
    assert incremental.subscriber_stats == full.subscriber_stats
    assert incremental.event_trends == full.event_trends


def test_a_window_of_days_reads_only_its_partitions(spark, generated, tmp_path):
    h, base, snapshot, _ = generated
    day = (history.START + timedelta(days=1)).date()
    run = analysis.compute(
        str(base / "archive"), str(tmp_path / "out"), snapshot, now=history.NOW, since=day, until=day
    )
    listing = partitions.list_archive(base / "archive")
    assert run.manifest["partitions"]["total"] == sum(p.day == day.isoformat() for p in listing.values()) > 0
    assert run.manifest["partitions"]["recomputed"] == run.manifest["partitions"]["total"]
    # ... its messages and all their deliveries, the replayed ones made days later too
    assert_agrees_with_duckdb(
        duckdb_events(base / "archive", snapshot, where=f"day = '{day.isoformat()}'"), run.event_stats
    )
    # ... its trends: its messages' hours, and the later hours its replayed deliveries were made in
    assert {t["period_start"].date() for t in run.event_trends.to_pylist() if t["messages"]} == {day}
    later = [t for t in run.event_trends.to_pylist() if t["period_start"].date() != day]
    assert later and all(t["period_start"].date() > day and t["deliveries"] for t in later)
