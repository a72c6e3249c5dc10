"""The analytics job: delivery statistics over the archive and the recent rows, with PySpark.

    spark-submit analytics/job.py --archive DIR --recent DIR --out DIR [--now ISO-TIME]

It reads Parquet only (the archive, and the snapshot of the hot tables that
analytics.extract writes in the same layout), and writes Parquet only, under --out:

    event_stats/          per queue and event: messages, deliveries by state, fan-out,
                          publish-to-ack latency p50/p95/p99 (ms), attempts_mean,
                          dead_letter_rate, messages per minute and per hour (mean and peak)
    event_rates_minute/   per queue, event and minute: messages published
    event_rates_hour/     per queue, event and hour: messages published
    subscriber_stats/     per subscriber: deliveries by state, oldest_pending_age_s

Shape (../shared/STYLE.md): extract_* read, transform_* are pure DataFrame -> DataFrame, load_*
write; paths and the reference time are arguments. The file imports nothing but PySpark and
the standard library, so spark-submit runs it as it is, and it uses no Python UDF, so a
cluster's executors need none of this project's code.
"""

import argparse
import logging
import os
import sys
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

# The Parquet schema of analytics.layout, plus the Hive partition columns. Given explicitly:
# inference would read a queue named "2024" as a number, and a missing column of an older
# file comes back as nulls instead of failing the read.
MESSAGE_SCHEMA = T.StructType(
    [
        T.StructField("id", T.LongType()),
        T.StructField("event", T.StringType()),
        T.StructField("seq", T.LongType()),
        T.StructField("created_at", T.TimestampType()),
        T.StructField("payload", T.StringType()),
        T.StructField("key", T.StringType()),
        T.StructField("publisher", T.StringType()),
        T.StructField("headers", T.StringType()),  # files written before issue 16: null
        T.StructField("queue", T.StringType()),
        T.StructField("day", T.StringType()),
    ]
)
DELIVERY_SCHEMA = T.StructType(
    [
        T.StructField("id", T.LongType()),
        T.StructField("message_id", T.LongType()),
        T.StructField("event", T.StringType()),
        T.StructField("subscriber", T.StringType()),
        T.StructField("seq", T.LongType()),
        T.StructField("status", T.StringType()),
        T.StructField("attempts", T.LongType()),
        T.StructField("created_at", T.TimestampType()),
        T.StructField("delivered_at", T.TimestampType()),
        T.StructField("acked_at", T.TimestampType()),
        T.StructField("last_error", T.StringType()),
        T.StructField("queue", T.StringType()),
        T.StructField("day", T.StringType()),
    ]
)
MESSAGE_COLUMNS = ("id", "queue", "event", "created_at")
DELIVERY_COLUMNS = ("id", "queue", "event", "subscriber", "status", "attempts", "created_at", "acked_at")
STATUSES = ("pending", "inflight", "acked", "dead")

PERCENTILES = (0.5, 0.95, 0.99)
# percentile_approx's rank error is at most 1/accuracy: 0.01 %, far inside the contract's 1 %.
PERCENTILE_ACCURACY = 10_000

OUTPUTS = ("event_stats", "event_rates_minute", "event_rates_hour", "subscriber_stats")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# --- the session ---------------------------------------------------------------------------------


def build_session(
    master=None,
    app_name="mqsite-analytics",
    conf=None,
    *,
    remote=None,
    driver_memory=None,
    event_log_dir=None,
):
    """A SparkSession. `remote` (a Spark Connect URL, sc://host:15002) connects to a Spark
    Connect server and `master` is ignored; else `master` None leaves it to spark-submit (or
    local[*]). `driver_memory` (e.g. "2g") and `event_log_dir` apply to a session whose driver
    is this process: they must be set before its JVM starts, and a Connect server has its own."""
    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    elif master:
        builder = builder.master(master)
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.ui.showConsoleProgress": "false",
    }
    if not remote:
        cores = _local_cores(master)
        if cores:
            # Spark's 200 shuffle partitions are sized for a cluster; on one machine each costs
            # a task per stage for nothing (measured: 200k deliveries took 10 times as long).
            settings["spark.sql.shuffle.partitions"] = str(2 * cores)
        if driver_memory:
            settings["spark.driver.memory"] = driver_memory
        if event_log_dir:
            settings["spark.eventLog.enabled"] = "true"
            settings["spark.eventLog.dir"] = event_log_dir
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    # py4j logs every connection at INFO, through the root logger Django configures.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = builder.getOrCreate()
    if not remote:
        # A Spark Connect session has no SparkContext (nor JVM) on this side.
        spark.sparkContext.setLogLevel("WARN")
    return spark


def _local_cores(master):
    """The cores of a master on this machine: N of local[N] and local[N,F] (local[*]: this
    machine's CPUs, local: 1), N*C of local-cluster[N,C,M]; None for a cluster's master."""
    if not master:
        return None
    if master.startswith("local-cluster["):
        workers, cores = master[len("local-cluster[") :].rstrip("]").split(",")[:2]
        return int(workers) * int(cores)
    if not master.startswith("local"):
        return None
    inner = master[len("local") :].strip("[]").split(",")[0].strip()
    if inner == "*":
        return os.cpu_count() or 1
    return int(inner) if inner else 1


@contextmanager
def session(master=None, conf=None, *, remote=None, driver_memory=None, event_log_dir=None):
    """The active SparkSession if there is one (left running), else a new one stopped after."""
    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    spark = build_session(
        master, conf=conf, remote=remote, driver_memory=driver_memory, event_log_dir=event_log_dir
    )
    try:
        yield spark
    finally:
        spark.stop()


# --- extract -------------------------------------------------------------------------------------


def extract_messages(spark, *roots):
    return _read_all(spark, roots, "messages", MESSAGE_SCHEMA).select(*MESSAGE_COLUMNS)


def extract_deliveries(spark, *roots):
    return _read_all(spark, roots, "deliveries", DELIVERY_SCHEMA).select(*DELIVERY_COLUMNS)


def _read_all(spark, roots, kind, schema):
    frames = [_read(spark, f"{str(root).rstrip('/')}/{kind}", schema) for root in roots if root]
    frames = [f for f in frames if f is not None]
    if not frames:
        return spark.createDataFrame([], schema)
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out


def _read(spark, path, schema):
    # Nothing archived yet (or nothing recent): no folder. Asked of Hadoop's filesystem, which
    # knows every scheme Spark reads (file, hdfs, s3a, ...).
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    if not hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).exists(hadoop_path):
        return None
    return spark.read.schema(schema).parquet(path)


# --- transform -----------------------------------------------------------------------------------


def transform_unique(rows: DataFrame) -> DataFrame:
    """Each id once. A crash between the archive's write and its delete leaves a batch both
    in the archive and in the hot tables; a batch written again after its boundaries moved can
    sit in two files. The copies are the same row (only acked history is archived, and acked
    is final), so any one will do."""
    return rows.dropDuplicates(["id"])


def transform_rates(messages: DataFrame, unit: str) -> DataFrame:
    """Messages published per queue, event and `unit` ("minute" or "hour"), as
    (queue, event, period_start, messages); periods with none are absent."""
    return messages.groupBy("queue", "event", F.date_trunc(unit, "created_at").alias("period_start")).agg(
        F.count(F.lit(1)).alias("messages")
    )


def transform_event_stats(
    messages: DataFrame, deliveries: DataFrame, per_minute: DataFrame, per_hour: DataFrame
) -> DataFrame:
    """One row per queue and event. Latency is publish to ack of acked deliveries, in ms (a
    delivery's created_at is its message's publish time: the fan-out makes both at once).
    attempts_mean is over settled (acked or dead) deliveries; dead_letter_rate = dead /
    deliveries; messages_per_minute (per_hour) is the mean over the minutes (hours) from the
    first message's to the last's, both included, and peak_* the busiest one."""
    published = messages.groupBy("queue", "event").agg(
        F.count(F.lit(1)).alias("messages"),
        F.min("created_at").alias("first_published_at"),
        F.max("created_at").alias("last_published_at"),
    )
    status = F.col("status")
    latency_ms = F.when(
        status == "acked", (F.unix_micros("acked_at") - F.unix_micros("created_at")) / F.lit(1000.0)
    )
    delivered = deliveries.groupBy("queue", "event").agg(
        F.count(F.lit(1)).alias("deliveries"),
        *[F.sum((status == s).cast("long")).alias(s) for s in STATUSES],
        F.percentile_approx(latency_ms, list(PERCENTILES), PERCENTILE_ACCURACY).alias("latency"),
        F.avg(F.when(status.isin("acked", "dead"), F.col("attempts"))).alias("attempts_mean"),
    )
    peaks = (
        per_minute.groupBy("queue", "event")
        .agg(F.max("messages").alias("peak_per_minute"))
        .join(
            per_hour.groupBy("queue", "event").agg(F.max("messages").alias("peak_per_hour")),
            ["queue", "event"],
        )
    )
    joined = published.join(delivered, ["queue", "event"], "full_outer").join(
        peaks, ["queue", "event"], "left"
    )
    n_messages = F.coalesce(F.col("messages"), F.lit(0))
    n_deliveries = F.coalesce(F.col("deliveries"), F.lit(0))
    return joined.select(
        "queue",
        "event",
        n_messages.alias("messages"),
        n_deliveries.alias("deliveries"),
        *[F.coalesce(F.col(s), F.lit(0)).alias(s) for s in STATUSES],
        F.when(n_messages > 0, n_deliveries / n_messages).alias("fanout"),
        *[F.col("latency")[i].alias(f"latency_p{_pct(p)}_ms") for i, p in enumerate(PERCENTILES)],
        "attempts_mean",
        F.when(n_deliveries > 0, F.coalesce(F.col("dead"), F.lit(0)) / n_deliveries).alias(
            "dead_letter_rate"
        ),
        (n_messages / _periods("minute", 60)).alias("messages_per_minute"),
        (n_messages / _periods("hour", 3600)).alias("messages_per_hour"),
        F.coalesce(F.col("peak_per_minute"), F.lit(0)).alias("peak_per_minute"),
        F.coalesce(F.col("peak_per_hour"), F.lit(0)).alias("peak_per_hour"),
        "first_published_at",
        "last_published_at",
    )


def _periods(unit, seconds):
    """How many `unit`s from the first message's to the last's, both included."""
    first = F.unix_seconds(F.date_trunc(unit, "first_published_at"))
    last = F.unix_seconds(F.date_trunc(unit, "last_published_at"))
    return (last - first) / F.lit(seconds) + F.lit(1)


def _pct(p):
    return f"{p * 100:g}".replace(".", "_")


def transform_subscriber_stats(deliveries: DataFrame, now: datetime) -> DataFrame:
    """One row per subscriber: its deliveries by state (backlog: pending and inflight) and
    the age in seconds at `now` of its oldest pending delivery (lag; null when none)."""
    status = F.col("status")
    now_us = (now - EPOCH) // timedelta(microseconds=1)
    stats = deliveries.groupBy("subscriber").agg(
        F.count(F.lit(1)).alias("deliveries"),
        *[F.sum((status == s).cast("long")).alias(s) for s in STATUSES],
        F.min(F.when(status == "pending", F.col("created_at"))).alias("oldest_pending_at"),
    )
    return stats.withColumn(
        "oldest_pending_age_s", (F.lit(now_us) - F.unix_micros("oldest_pending_at")) / F.lit(1_000_000.0)
    )


# --- load ----------------------------------------------------------------------------------------


def load_parquet(results, out):
    """Write each result under `out`, replacing the last run's."""
    for name, frame in results.items():
        # Small results: one file each. The per-minute rates can be long, so they keep Spark's.
        if name != "event_rates_minute":
            frame = frame.coalesce(1)
        frame.write.mode("overwrite").parquet(f"{str(out).rstrip('/')}/{name}")


# --- the whole job -------------------------------------------------------------------------------


def run(spark, archive, recent, out, now=None):
    """Read the archive and the recent snapshot, compute every result, write them under `out`."""
    now = now or datetime.now(UTC)
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    # Let adaptive execution size the partitions of what is computed from the cached frames
    # too; Spark leaves a cached plan's partitioning alone by default, and every result here
    # is computed from one (measured: 7 times faster with this on).
    spark.conf.set("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")
    # Persisted: each feeds several results, and deduping is the job's one big shuffle.
    messages = transform_unique(extract_messages(spark, archive, recent)).persist()
    deliveries = transform_unique(extract_deliveries(spark, archive, recent)).persist()
    per_minute = transform_rates(messages, "minute").persist()
    per_hour = transform_rates(messages, "hour").persist()
    try:
        load_parquet(
            {
                "event_stats": transform_event_stats(messages, deliveries, per_minute, per_hour),
                "event_rates_minute": per_minute,
                "event_rates_hour": per_hour,
                "subscriber_stats": transform_subscriber_stats(deliveries, now),
            },
            out,
        )
    finally:
        for frame in (messages, deliveries, per_minute, per_hour):
            frame.unpersist()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", required=True, help="the archive root (MQ_ARCHIVE_DIR)")
    parser.add_argument("--recent", default="", help="the snapshot of the hot tables (analytics.extract)")
    parser.add_argument("--out", required=True, help="where the results go")
    parser.add_argument("--now", type=_iso_time, default=None, help="reference time for ages (UTC)")
    parser.add_argument("--master", default=None, help="Spark master; default spark-submit's, or local[*]")
    args = parser.parse_args(argv)
    spark = build_session(args.master)
    try:
        run(spark, args.archive, args.recent, args.out, now=args.now)
    finally:
        spark.stop()
    return 0


def _iso_time(text):
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


if __name__ == "__main__":
    sys.exit(main())
