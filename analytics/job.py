"""The analytics job: hourly aggregates of the archive with PySpark, merged by analytics.merge.

    spark-submit analytics/job.py --archive DIR --files LIST --out DIR

It reads the archive's Parquet files it is given (or, when the hot tables are large, their
snapshot) and computes, per (queue, day) partition, one row per queue, event and hour
(`event_hours`) and per queue, subscriber and hour (`subscriber_hours`): counts, minima,
maxima and a latency sketch, every one of which merges across hours and days. A day's rows are
computed once and kept (analytics.analysis); a run recomputes only the partitions that changed.

No global dedupe: each row is read once. The archive's batches are idempotent (a journal), so
the archive holds each id once; the only overlap, the hot tables' rows that are also archived,
is removed from the snapshot before it is aggregated (analytics.overlap: the archive's copy
wins).

Shape (../shared/STYLE.md): extract_* read, transform_* are pure DataFrame -> DataFrame; paths
are arguments. The file imports nothing but PySpark and the standard library, so spark-submit
runs it as it is, and it uses no Python UDF, so a cluster's executors need none of this
project's code.
"""

import argparse
import logging
import os
import sys
from contextlib import contextmanager

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
# What the transforms read: never the payload, nor ids (nothing is deduped).
MESSAGE_COLUMNS = ("queue", "day", "event", "created_at")
DELIVERY_COLUMNS = ("queue", "day", "event", "subscriber", "status", "attempts", "created_at", "acked_at")
_KINDS = {"messages": (MESSAGE_SCHEMA, MESSAGE_COLUMNS), "deliveries": (DELIVERY_SCHEMA, DELIVERY_COLUMNS)}
STATUSES = ("pending", "inflight", "acked", "dead")

# The latency sketch of a group: its latencies at ranks 1/K, 2/K, ..., 1 (K = SKETCH_POINTS),
# each point standing for 1/K of the group's acked deliveries. Merged (analytics.sketch), the
# points of any set of groups give any quantile within 1/K of rank plus percentile_approx's
# error (1/accuracy): 0.5 % + 0.01 %, inside the contract's 1 %. p50, p95 and p99 of a single
# group are points of the grid, so an hour's own are as exact as percentile_approx.
SKETCH_POINTS = 200
SKETCH_RANKS = tuple(i / SKETCH_POINTS for i in range(1, SKETCH_POINTS + 1))
PERCENTILE_ACCURACY = 10_000

EVENT_HOUR_COLUMNS = (
    "queue", "day", "event", "hour", "messages", "deliveries", *STATUSES, "attempts_sum",
    "minute_counts", "first_at", "last_at", "latency_points",
)  # fmt: skip
SUBSCRIBER_HOUR_COLUMNS = (
    "queue", "day", "subscriber", "hour", "published", *STATUSES, "acks", "oldest_pending_at",
)  # fmt: skip

# Set on the session by every run (configure()).
RUN_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # The latency sketch is an object aggregate; past this many groups in a task Spark falls
    # back from hashing to sorting the rest of its input. A group is an hour of an event, and
    # its buffer holds at most the hour's acked latencies: hash them all.
    "spark.sql.objectHashAggregate.sortBased.fallbackThreshold": "1000000",
    # The caller lists the files; let the driver stat them instead of starting a Spark job to.
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "1000000",
}


# --- the session ---------------------------------------------------------------------------------


def build_session(master=None, app_name="mqsite-analytics", conf=None):
    """A SparkSession; `master` None leaves it to spark-submit (or local[*])."""
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.ui.showConsoleProgress": "false",
    }
    cores = _local_cores(master)
    if cores:
        # Spark's 200 shuffle partitions are sized for a cluster; on one machine each costs a
        # task per stage for nothing (measured: 200k deliveries took 10 times as long).
        settings["spark.sql.shuffle.partitions"] = str(2 * cores)
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    # py4j logs every connection at INFO, through the root logger Django configures.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _local_cores(master):
    """N of local[N] (local[*]: this machine's CPUs), or None for a cluster's master."""
    if not master or not master.startswith("local"):
        return None
    inner = master[len("local") :].strip("[]").split(",")[0]
    if inner in ("", "*"):
        return (os.cpu_count() or 1) if inner == "*" else 1
    return int(inner)


@contextmanager
def session(master=None, conf=None):
    """The active SparkSession if there is one (left running), else a new one stopped after."""
    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    spark = build_session(master, conf=conf)
    try:
        yield spark
    finally:
        spark.stop()


# --- extract -------------------------------------------------------------------------------------


def extract_archive(spark, root, kind, files):
    """The given Parquet files of one kind ("messages" or "deliveries") of the archive under
    `root`, with the queue and day of their partition, in the columns the transforms read.

    The caller lists the files (analytics.partitions): a path given is read, nothing else,
    so a run reads exactly the partitions it decided to recompute, and Spark lists nothing
    (no Hadoop call through the JVM gateway, which Spark Connect does not have).
    """
    schema, columns = _KINDS[kind]
    if not files:
        return spark.createDataFrame([], T.StructType([schema[c] for c in columns]))
    return (
        spark.read.schema(schema)
        .option("basePath", f"{str(root).rstrip('/')}/{kind}")
        .parquet(*files)
        .select(*columns)
    )


def extract_snapshot(spark, root, kind):
    """The hot tables' snapshot (analytics.extract.write_snapshot: plain Parquet with a queue
    column), with the day each row would be archived under."""
    schema, columns = _KINDS[kind]
    snapshot_schema = T.StructType([f for f in schema if f.name != "day"])
    frame = spark.read.schema(snapshot_schema).parquet(f"{str(root).rstrip('/')}/{kind}")
    return frame.withColumn("day", F.date_format("created_at", "yyyy-MM-dd")).select(*columns)


# --- transform -----------------------------------------------------------------------------------


def transform_event_hours(messages: DataFrame, deliveries: DataFrame) -> DataFrame:
    """One row per queue, day, event and hour (EVENT_HOUR_COLUMNS): the hour's messages, its
    first and last, its messages per minute; its deliveries by state, the attempts of the settled
    ones; and the latency sketch of its acked deliveries.

    Every figure of every window is a sum, min or max of these rows, or a merge of their
    sketches (analytics.sketch), so a day's rows are computed once and kept.

    The counts are plain aggregates, which Spark runs as generated code in a hash aggregate;
    the percentile is an object aggregate, kept apart over the acked deliveries alone so that
    it does not take the counts out of generated code.
    """
    by_minute = messages.groupBy(
        "queue", "day", "event", F.date_trunc("minute", "created_at").alias("minute")
    ).agg(
        F.count(F.lit(1)).alias("n"),
        F.min("created_at").alias("first_at"),
        F.max("created_at").alias("last_at"),
    )
    published = by_minute.groupBy("queue", "day", "event", F.date_trunc("hour", "minute").alias("hour")).agg(
        F.sum("n").alias("messages"),
        # Each busy minute's count, so that the busiest minute of any window is exact even
        # when the archive and the hot tables each hold part of one minute.
        F.collect_list(F.struct(F.minute("minute").alias("minute"), F.col("n"))).alias("minute_counts"),
        F.min("first_at").alias("first_at"),
        F.max("last_at").alias("last_at"),
    )
    status = F.col("status")
    hour = F.date_trunc("hour", "created_at").alias("hour")
    delivered = deliveries.groupBy("queue", "day", "event", hour).agg(
        F.count(F.lit(1)).alias("deliveries"),
        *[F.sum((status == s).cast("long")).alias(s) for s in STATUSES],
        F.sum(F.when(status.isin("acked", "dead"), F.col("attempts"))).alias("attempts_sum"),
    )
    latency_ms = (F.unix_micros("acked_at") - F.unix_micros("created_at")) / F.lit(1000.0)
    latency = (
        deliveries.where(status == "acked")
        .groupBy("queue", "day", "event", hour)
        .agg(F.percentile_approx(latency_ms, list(SKETCH_RANKS), PERCENTILE_ACCURACY).alias("latency_points"))
    )
    keys = ["queue", "day", "event", "hour"]
    joined = published.join(delivered, keys, "full_outer").join(latency, keys, "left")
    zero = F.lit(0).cast("long")
    return joined.select(
        *keys,
        *[F.coalesce(F.col(c), zero).alias(c) for c in ("messages", "deliveries", *STATUSES, "attempts_sum")],
        "minute_counts",
        "first_at",
        "last_at",
        "latency_points",
    )


def transform_subscriber_hours(deliveries: DataFrame) -> DataFrame:
    """One row per queue, day, subscriber and hour (SUBSCRIBER_HOUR_COLUMNS): the deliveries
    made in the hour (`published`) by their state now, the oldest still pending, and the acks
    made in the hour (`acks`, by acked_at: what the backlog trend subtracts)."""
    status = F.col("status")
    keys = ["queue", "day", "subscriber", "hour"]
    made = deliveries.groupBy(
        "queue", "day", "subscriber", F.date_trunc("hour", "created_at").alias("hour")
    ).agg(
        F.count(F.lit(1)).alias("published"),
        *[F.sum((status == s).cast("long")).alias(s) for s in STATUSES],
        F.min(F.when(status == "pending", F.col("created_at"))).alias("oldest_pending_at"),
    )
    acks = (
        deliveries.where(status == "acked")
        .groupBy("queue", "day", "subscriber", F.date_trunc("hour", "acked_at").alias("hour"))
        .agg(F.count(F.lit(1)).alias("acks"))
    )
    zero = F.lit(0).cast("long")
    return made.join(acks, keys, "full_outer").select(
        *keys,
        *[F.coalesce(F.col(c), zero).alias(c) for c in ("published", *STATUSES, "acks")],
        "oldest_pending_at",
    )


# --- the whole job -------------------------------------------------------------------------------


def configure(spark):
    """What every run needs of the session, whoever built it."""
    for key, value in RUN_CONF.items():
        spark.conf.set(key, value)


def compute_hours(spark, messages, deliveries):
    """(event hours, subscriber hours) of these rows, as Arrow tables (they are small: a row
    per hour and key, whatever the rows)."""
    configure(spark)
    return (
        transform_event_hours(messages, deliveries).toArrow(),
        transform_subscriber_hours(deliveries).toArrow(),
    )


def main(argv=None):
    """spark-submit entry: the hour rows of the given archive files, as Parquet under --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", required=True, help="the archive root (MQ_ARCHIVE_DIR)")
    parser.add_argument(
        "--files", required=True, help="a text file listing the archive files to read, one a line"
    )
    parser.add_argument("--out", required=True, help="where event_hours/ and subscriber_hours/ go")
    parser.add_argument("--master", default=None, help="Spark master; default spark-submit's, or local[*]")
    args = parser.parse_args(argv)
    with open(args.files) as f:
        files = [line.strip() for line in f if line.strip()]
    spark = build_session(args.master)
    try:
        configure(spark)
        by_kind = {kind: [p for p in files if f"/{kind}/" in p] for kind in _KINDS}
        messages = extract_archive(spark, args.archive, "messages", by_kind["messages"])
        deliveries = extract_archive(spark, args.archive, "deliveries", by_kind["deliveries"])
        out = args.out.rstrip("/")
        transform_event_hours(messages, deliveries).coalesce(1).write.mode("overwrite").parquet(
            f"{out}/event_hours"
        )
        transform_subscriber_hours(deliveries).coalesce(1).write.mode("overwrite").parquet(
            f"{out}/subscriber_hours"
        )
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
