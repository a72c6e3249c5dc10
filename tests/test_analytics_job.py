"""The PySpark job (analytics/job.py): its pure transforms on tiny hand-made data, and the whole
job on a generated history, every figure checked against plain Python and DuckDB reading the
same Parquet. No database: the job reads and writes Parquet only."""

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from django.db import connection
from pyspark.sql import types as T

from analytics import job, layout
from tests.analytics import history
from tests.conftest_spark import spark  # noqa: F401

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
ROOT = Path(__file__).resolve().parent.parent


def ts(seconds):
    return T0 + timedelta(seconds=seconds)


def message_rows(spark, rows):  # noqa: F811
    return spark.createDataFrame(
        [dict(zip(job.MESSAGE_COLUMNS, r, strict=True)) for r in rows],
        T.StructType([job.MESSAGE_SCHEMA[c] for c in job.MESSAGE_COLUMNS]),
    )


def delivery_rows(spark, rows):  # noqa: F811
    return spark.createDataFrame(
        [dict(zip(job.DELIVERY_COLUMNS, r, strict=True)) for r in rows],
        T.StructType([job.DELIVERY_SCHEMA[c] for c in job.DELIVERY_COLUMNS]),
    )


def as_dicts(frame, key):
    return {tuple(r[k] for k in key): r.asDict() for r in frame.collect()}


# --- tiny expected data ---------------------------------------------------------------------------


def test_it_computes_event_stats_of_a_tiny_history(spark):  # noqa: F811
    # Given two messages of db/create, one of db/delete, and their deliveries
    messages = message_rows(
        spark, [(1, "db", "create", ts(0)), (2, "db", "create", ts(90)), (3, "db", "delete", ts(3600))]
    )
    deliveries = delivery_rows(
        spark,
        [
            (11, "db", "create", "logger", "acked", 1, ts(0), ts(0.25)),
            (12, "db", "create", "peer", "acked", 3, ts(0), ts(2)),
            (13, "db", "create", "logger", "dead", 5, ts(90), None),
            (14, "db", "create", "peer", "pending", 0, ts(90), None),
            (15, "db", "delete", "logger", "inflight", 1, ts(3600), None),
        ],
    )
    # When
    per_minute = job.transform_rates(messages, "minute")
    per_hour = job.transform_rates(messages, "hour")
    stats = as_dicts(
        job.transform_event_stats(messages, deliveries, per_minute, per_hour), ("queue", "event")
    )
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


def test_it_counts_an_event_with_no_deliveries(spark):  # noqa: F811
    messages = message_rows(spark, [(1, "db", "create", ts(0))])
    deliveries = delivery_rows(spark, [])
    stats = job.transform_event_stats(
        messages, deliveries, job.transform_rates(messages, "minute"), job.transform_rates(messages, "hour")
    ).collect()
    assert [(r.messages, r.deliveries, r.acked, r.fanout, r.dead_letter_rate) for r in stats] == [
        (1, 0, 0, 0.0, None)
    ]


def test_it_measures_each_subscribers_backlog_and_lag(spark):  # noqa: F811
    deliveries = delivery_rows(
        spark,
        [
            (11, "db", "create", "logger", "pending", 0, ts(0), None),
            (12, "db", "create", "logger", "pending", 2, ts(30), None),
            (13, "db", "create", "logger", "inflight", 1, ts(-100), None),  # in flight: not pending
            (14, "db", "create", "logger", "acked", 1, ts(-200), ts(-199)),
            (15, "db", "create", "peer", "dead", 5, ts(0), None),
        ],
    )
    stats = as_dicts(job.transform_subscriber_stats(deliveries, now=ts(60)), ("subscriber",))
    logger, peer = stats[("logger",)], stats[("peer",)]
    assert (logger["pending"], logger["inflight"], logger["acked"], logger["dead"]) == (2, 1, 1, 0)
    assert logger["oldest_pending_age_s"] == 60.0
    assert (peer["pending"], peer["dead"], peer["oldest_pending_age_s"]) == (0, 1, None)


def test_it_keeps_each_id_once(spark):  # noqa: F811
    row = (11, "db", "create", "logger", "acked", 1, ts(0), ts(1))
    twice = delivery_rows(spark, [row, row, (12, *row[1:])])
    assert sorted(r.id for r in job.transform_unique(twice).collect()) == [11, 12]


def test_it_reads_the_layout_as_the_archive_writes_it():
    """The job's Spark schema is the layout's, plus the two partition columns."""
    assert job.MESSAGE_SCHEMA.names == [*layout.MESSAGE_SCHEMA.names, "queue", "day"]
    assert job.DELIVERY_SCHEMA.names == [*layout.DELIVERY_SCHEMA.names, "queue", "day"]


# --- the whole job on a generated history ---------------------------------------------------------


@pytest.fixture(scope="module")
def generated(spark, tmp_path_factory):  # noqa: F811
    base = tmp_path_factory.mktemp("generated")
    h = history.generate()
    history.write(h, base / "archive", base / "recent")
    job.run(spark, str(base / "archive"), str(base / "recent"), str(base / "out"), now=history.NOW)
    return h, base


def read_out(base, name):
    return pq.read_table(base / "out" / name).to_pylist()


def test_the_generated_history_has_the_overlaps_a_crash_leaves(generated):
    h, base = generated
    db = duckdb.connect()
    rows, unique = db.execute(
        "SELECT count(*), count(DISTINCT id) FROM read_parquet(?, hive_partitioning = true)",
        [[f"{base}/archive/deliveries/**/*.parquet", f"{base}/recent/deliveries/**/*.parquet"]],
    ).fetchone()
    assert unique == len(h.deliveries) and rows > unique


def test_it_counts_every_event_as_python_does(generated):
    h, base = generated
    expected = history.expected_events(h)
    got = {(r["queue"], r["event"]): r for r in read_out(base, "event_stats")}
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
    h, base = generated
    expected = history.expected_events(h)
    for row in read_out(base, "event_stats"):
        latencies = expected[(row["queue"], row["event"])]["latencies"]
        assert len(latencies) > 50
        for q, name in ((0.5, "latency_p50_ms"), (0.95, "latency_p95_ms"), (0.99, "latency_p99_ms")):
            assert history.within_rank(latencies, q, row[name]), (row["queue"], row["event"], name)


def test_it_agrees_with_duckdb_on_the_same_parquet(generated):
    """A second engine reads the archive and the recent rows as they are (Hive layout), dedupes
    by id, and computes the counts and exact percentiles."""
    _, base = generated
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")

    def source(kind):
        paths = [f"{base}/archive/{kind}/**/*.parquet", f"{base}/recent/{kind}/**/*.parquet"]
        return f"(SELECT DISTINCT ON (id) * FROM read_parquet({paths!r}, hive_partitioning = true))"

    # The quantiles 1 % of rank either side of each one asked for: Spark's must lie between.
    bounds = [0.49, 0.51, 0.94, 0.96, 0.98, 1.0]
    want = db.execute(
        f"""
        WITH m AS (SELECT queue, event, count(*) AS messages FROM {source("messages")} GROUP BY ALL),
        d AS (
            SELECT queue, event, count(*) AS deliveries,
                count(*) FILTER (status = 'acked') AS acked, count(*) FILTER (status = 'dead') AS dead,
                quantile_disc((epoch_us(acked_at) - epoch_us(created_at)) / 1000, {bounds})
                    FILTER (status = 'acked') AS q
            FROM {source("deliveries")} GROUP BY ALL)
        SELECT queue, event, messages, deliveries, acked, dead, q FROM m JOIN d USING (queue, event)
        ORDER BY ALL
        """
    ).fetchall()
    got = {(r["queue"], r["event"]): r for r in read_out(base, "event_stats")}
    assert got.keys() == {(w[0], w[1]) for w in want}
    for queue, event, messages, deliveries, acked, dead, q in want:
        row = got[(queue, event)]
        assert (row["messages"], row["deliveries"], row["acked"], row["dead"]) == (
            messages,
            deliveries,
            acked,
            dead,
        )
        for i, name in enumerate(("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")):
            assert q[2 * i] <= row[name] <= q[2 * i + 1], (queue, event, name, q, row[name])


def test_it_computes_rates_per_minute_and_per_hour(generated):
    h, base = generated
    expected = history.expected_events(h)
    for name, unit in (("event_rates_minute", "per_minute"), ("event_rates_hour", "per_hour")):
        got = {}
        for r in read_out(base, name):
            got.setdefault((r["queue"], r["event"]), {})[r["period_start"]] = r["messages"]
        assert got == {key: want[unit] for key, want in expected.items()}


def test_it_measures_every_subscribers_backlog_as_python_does(generated):
    h, base = generated
    expected = history.expected_subscribers(h)
    got = {r["subscriber"]: r for r in read_out(base, "subscriber_stats")}
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        row = got[name]
        for field in ("deliveries", "pending", "inflight", "acked", "dead"):
            assert row[field] == want[field], (name, field)
        assert row["oldest_pending_age_s"] == pytest.approx(want["oldest_pending_age_s"], abs=1e-6)


@pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="a second JVM for half a minute, with no database in it: the SQLite pass of make test runs it",
)
def test_it_runs_alone_under_spark_submit(tmp_path):
    """`spark-submit analytics/job.py ...` as it is: neither Django nor this project on the path."""
    h = history.generate(seed=3, n_messages=40)
    history.write(h, tmp_path / "archive", tmp_path / "recent")
    bin_dir = Path(sys.executable).parent
    done = subprocess.run(
        [
            str(bin_dir / "spark-submit"),
            "--master",
            "local[1]",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.sql.shuffle.partitions=1",
            "--driver-java-options",
            "-XX:TieredStopAtLevel=1",
            str(ROOT / "analytics" / "job.py"),
            "--archive",
            str(tmp_path / "archive"),
            "--recent",
            str(tmp_path / "recent"),
            "--out",
            str(tmp_path / "out"),
            "--now",
            history.NOW.isoformat(),
        ],
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYSPARK_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = pq.read_table(tmp_path / "out" / "event_stats").to_pylist()
    assert sum(r["messages"] for r in rows) == len(h.messages)
    assert sum(r["deliveries"] for r in rows) == len(h.deliveries)
