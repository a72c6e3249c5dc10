"""The analytics job: the archive's history reduced to a few rows per hour, with PySpark.

    spark-submit analytics/job.py --archive DIR --files LIST --out DIR

It reads the archive's Parquet files it is given (or, when the hot tables are large, their
snapshot) and computes three small parts, per queue, day and hour: `message_hours` (messages,
per minute, first and last), `delivery_cells` (deliveries counted by event, subscriber, state
and hour of ack) and `latency_sketches` (a mergeable sketch of the acked deliveries' latency).
Every figure of any window is a sum, a minimum, a maximum or a sketch merge of these
(analytics.hours, analytics.figures), so a day's parts are computed once and kept
(analytics.analysis): a run recomputes only the partitions that changed.

No global dedupe: each row is read once. The archive's batches are idempotent (a journal), so
the archive holds each id once; the only overlap, the hot tables' rows that are also archived,
is removed from the snapshot before it is aggregated (analytics.overlap: the archive's copy
wins).

Shape (the house style, and the Spark testing guide's): extract_* read, transform_* are pure
DataFrame -> DataFrame, load_* write; paths are arguments. The file imports nothing but
PySpark and the standard library, so spark-submit runs it as it is, and it uses no Python UDF,
so a cluster's executors need none of this project's code.
"""

import argparse
import logging
import os
import re
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
# What the transforms read: never the payload, nor ids (nothing is deduped). The day is the
# partition's, not the row's hour's: a delivery a replay or a seek made days after its message
# is filed under its message's day, and its hour rows must say so (a run keeps and drops them
# with that partition).
MESSAGE_COLUMNS = ("queue", "day", "event", "created_at")
DELIVERY_COLUMNS = ("queue", "day", "event", "subscriber", "status", "attempts", "created_at", "acked_at")
_KINDS = {"messages": (MESSAGE_SCHEMA, MESSAGE_COLUMNS), "deliveries": (DELIVERY_SCHEMA, DELIVERY_COLUMNS)}
STATUSES = ("pending", "inflight", "acked", "dead")

# The latency sketch of a group of n values: its exact latencies at ranks 1/m, 2/m, ..., 1,
# m = min(n, K) (K = SKETCH_POINTS), each point standing for n/m of the group's acked
# deliveries: all of its values when it has at most K (an hour of a quiet queue), so no sketch
# is bigger than its hour. Merged (analytics.sketch.Sketches), the points of any set of groups give any
# quantile within 1/K of rank: 0.5 %, inside the contract's 1 %. p50, p95 and p99 are points of
# the grid, so an hour's own are exact.
SKETCH_POINTS = 200

MESSAGE_HOUR_COLUMNS = ("queue", "day", "event", "hour", "messages", "minute_counts", "first_at", "last_at")
CELL_COLUMNS = (
    "queue", "day", "event", "subscriber", "hour", "acked_hour", "status", "n", "attempts",
    "first_created_at",
)  # fmt: skip
SKETCH_COLUMNS = ("queue", "day", "event", "hour", "latency_count", "latency_points")
# The same sketch per subscriber: which consumer is slow (analytics.figures' latency per subscriber).
SUBSCRIBER_SKETCH_COLUMNS = ("queue", "day", "subscriber", "hour", "latency_count", "latency_points")

# Set on the session by every run (configure()).
RUN_CONF = {
    "spark.sql.session.timeZone": "UTC",
    # The latency sketch is an object aggregate; past this many groups in a task Spark falls
    # back from hashing to sorting the rest of its input. A group is an hour of an event, and
    # its buffer holds the hour's acked latencies: hash them all.
    "spark.sql.objectHashAggregate.sortBased.fallbackThreshold": "1000000",
}
# Set too when the session's master is on this machine (local[N], local-cluster[...]): tuning
# for a local disk and a few cores, which a cluster's storage and executors do not want.
LOCAL_RUN_CONF = {
    # The caller lists the files; let the driver stat them instead of starting a Spark job to
    # (on object storage, the executors' listing in parallel is the quicker).
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "1000000",
    # The archive's files are small (one per queue and hour until compacted): Spark counts 4 MB
    # for opening each when it packs files into tasks, which made 45 tasks of 1,440 files of
    # 0.1 MB; at 64 KB it packs them into one task per core (measured: 25-40 % faster). On a
    # cluster, opening a remote file does cost about 4 MB of reading.
    "spark.sql.files.openCostInBytes": str(64 * 1024),
}


# --- the session ---------------------------------------------------------------------------------


def build_session(
    master=None,
    app_name="mqsite-analytics",
    conf=None,
    *,
    remote=None,
    driver_memory=None,
    event_log_dir=None,
    class_archive=None,
    quick_jit=False,
):
    """A SparkSession. `remote` (a Spark Connect URL, sc://host:15002) connects to a Spark
    Connect server and `master` is ignored; else `master` None leaves it to spark-submit (or
    local[*]). `driver_memory` (e.g. "2g") and `event_log_dir` apply to a session whose driver
    is this process: they must be set before its JVM starts, and a Connect server has its own.
    `class_archive` is where a local driver keeps its classes' shared archive (_class_sharing);
    `quick_jit` asks a local driver for the quick compiler alone (a short run)."""
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
            # The throughput collector: the sketch's lists make short-lived garbage by the
            # million, and nothing here waits on a pause (measured on the 5 M archive, warm:
            # 5.4 s with G1, 4.7-5.1 s with it). `quick_jit`: the quick compiler alone, for a
            # short run (a JVM that starts and compiles sooner, but runs a long one slower:
            # on the 5 M archive, start and first pass 14.4 s -> 11.8 s, a later pass 5.3 s
            # -> 8.5 s); and it compiles at a tenth of the usual call counts, sooner still
            # (the 5 M archive's first pass, three runs each: 11.3-11.7 s against 12.0-13.2 s).
            quick = " -XX:TieredStopAtLevel=1 -XX:CompileThresholdScaling=0.1"
            java = "-XX:+UseParallelGC" + (quick if quick_jit else "")
            settings["spark.driver.extraJavaOptions"] = java + _class_sharing(class_archive)
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


def _class_sharing(class_archive):
    """The JVM option for Spark's classes' shared archive (AppCDS) at `class_archive`: use it
    when it exists, else make it when this JVM exits (when `make install` did not:
    analytics.class_archive, which also says what it saves). The classes then load mapped,
    already checked. A JVM whose classes no longer match (an upgrade) ignores the archive."""
    if not class_archive:
        return ""
    # Quiet: the JVM lists every class it leaves out (those of signed jars) as it exits.
    if os.path.exists(class_archive):
        return f" -XX:SharedArchiveFile={class_archive} -Xlog:cds=off"
    os.makedirs(os.path.dirname(os.path.abspath(class_archive)), exist_ok=True)
    return f" -XX:ArchiveClassesAtExit={class_archive} -Xlog:cds=off"


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
def session(master=None, conf=None, **options):
    """The active SparkSession if there is one (left running), else a new one (build_session's
    arguments) stopped after."""
    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    spark = build_session(master, conf=conf, **options)
    try:
        yield spark
    finally:
        try:
            spark.stop()
        finally:
            end_driver_jvm()


def end_driver_jvm(timeout=None):
    """End the JVM this process started for its driver, now rather than when the process exits
    (a local driver; nothing for Spark Connect's). It exits when its stdin closes, the gateway's
    way of dying with its Python, and takes most of a second: an analysis then does its last
    work in Python meanwhile. A session built after starts a new one. With `timeout`, waits for
    it to exit (it writes its class archive as it exits)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return
    SparkContext._gateway = SparkContext._jvm = None
    # Closed first, so that py4j no longer tells the JVM of Python's garbage (it would log an
    # error for each object collected once the JVM is gone).
    gateway.close(keep_callback_server=True)
    proc.stdin.close()
    if timeout is not None:
        proc.wait(timeout)


# --- extract -------------------------------------------------------------------------------------


def extract_archive(spark, root, kind, files):
    """The given Parquet files of one kind ("messages" or "deliveries") of the archive under
    `root`, with the queue and day of their partition, in the columns the transforms read.

    The caller lists the files (analytics.partitions): a path given is read, nothing else,
    so a run reads exactly the partitions it decided to recompute, and Spark lists nothing
    (no Hadoop call through the JVM gateway, which Spark Connect does not have).
    """
    configure(spark)  # before the read: the file listing's settings apply when it is made
    schema, columns = _KINDS[kind]
    if not files:
        return spark.createDataFrame([], T.StructType([schema[c] for c in columns]))
    return (
        spark.read.schema(schema)
        .option("basePath", f"{uri(root).rstrip('/')}/{kind}")
        .parquet(*(uri(f) for f in files))
        .select(*columns)
    )


def extract_snapshot(spark, root, kind):
    """The hot tables' snapshot (analytics.extract.write_snapshot: plain Parquet with queue and
    day columns, layout.partition_days), in the columns the transforms read."""
    configure(spark)
    schema, columns = _KINDS[kind]
    return spark.read.schema(schema).parquet(f"{uri(root).rstrip('/')}/{kind}").select(*columns)


# --- transform -----------------------------------------------------------------------------------


# Hours and minutes as whole numbers since the epoch (UTC): grouping by a number is cheaper than
# by date_trunc's timestamp, which goes through a calendar for every row; the hour's timestamp
# is made once per group, at the end.
HOUR_US = 3_600_000_000
MINUTE_US = 60_000_000


def _number(column, unit_us):
    return F.expr(f"unix_micros({column}) div {unit_us}")


def _hour(number):
    """The hour's start (a timestamp) from its number."""
    return F.timestamp_micros(F.col(number) * F.lit(HOUR_US)).alias("hour")


def transform_message_hours(messages: DataFrame) -> DataFrame:
    """One row per queue, day, event and hour (MESSAGE_HOUR_COLUMNS): the hour's messages, each
    busy minute's count (so that the busiest minute of any window is exact even when the archive
    and the hot tables each hold part of one minute), the first and the last."""
    by_minute = messages.groupBy("queue", "day", "event", _number("created_at", MINUTE_US).alias("m")).agg(
        F.count(F.lit(1)).alias("n"),
        F.min("created_at").alias("first_at"),
        F.max("created_at").alias("last_at"),
    )
    hours = by_minute.groupBy("queue", "day", "event", (F.col("m") / 60).cast("long").alias("h")).agg(
        F.sum("n").alias("messages"),
        F.collect_list(F.struct((F.col("m") % 60).cast("int").alias("minute"), F.col("n"))).alias(
            "minute_counts"
        ),
        F.min("first_at").alias("first_at"),
        F.max("last_at").alias("last_at"),
    )
    return hours.select(
        "queue", "day", "event", _hour("h"), "messages", "minute_counts", "first_at", "last_at"
    )


def transform_delivery_cells(deliveries: DataFrame) -> DataFrame:
    """One row per queue, day (the partition's), event, subscriber, hour made, hour of ack and
    state (CELL_COLUMNS): how many deliveries, their attempts, the earliest made. A delivery is
    made at its message's publish (the fan-out), or by a replay or a seek later (its created_at).

    Every count of the event hours and the subscriber hours is a sum over these cells
    (analytics.hours), so the deliveries are read once for all of them, by one aggregate of
    plain functions that Spark runs as generated code. There are few cells: at most one per
    subscription, hour and state, and a second hour for acks that came after their hour.
    """
    cells = deliveries.groupBy(
        "queue",
        "day",
        "event",
        "subscriber",
        _number("created_at", HOUR_US).alias("h"),
        _number("acked_at", HOUR_US).alias("acked_h"),
        "status",
    ).agg(
        F.count(F.lit(1)).alias("n"),
        F.sum("attempts").alias("attempts"),
        F.min("created_at").alias("first_created_at"),
    )
    acked_hour = F.timestamp_micros(F.col("acked_h") * F.lit(HOUR_US)).alias("acked_hour")
    return cells.select(
        "queue",
        "day",
        "event",
        "subscriber",
        _hour("h"),
        acked_hour,
        "status",
        "n",
        "attempts",
        "first_created_at",
    )


def transform_latency_sketches(deliveries: DataFrame) -> DataFrame:
    """One row per queue, day, event and hour with acked deliveries (SKETCH_COLUMNS): the
    latency sketch of its acked deliveries, from each one's making (created_at: the publish,
    or the replay that made it; docs/analytics.md) to its ack, in ms: the exact latencies at the
    ranks 1/m, 2/m, ..., 1 (m = min(n, K): all of them up to K), from the hour's latencies
    sorted.

    An aggregate of its own (collect_list, an object aggregate), kept apart from the counts so
    that it does not take them out of generated code. Exact rather than percentile_approx:
    measured faster here (the hour's values are few, and sorting them beats feeding a
    quantile summary row by row), and its points carry no error of their own. It holds an
    hour's acked latencies in memory at once: 8 bytes each.
    """
    return _latency_sketches(deliveries, "event")


def transform_subscriber_latency_sketches(deliveries: DataFrame) -> DataFrame:
    """One row per queue, day, subscriber and hour with acked deliveries
    (SUBSCRIBER_SKETCH_COLUMNS): the same sketch as transform_latency_sketches, of the
    subscriber's acked deliveries. Its own points, not a merge of the event sketches: a
    subscriber's hour's p50, p95 and p99 are exact too."""
    return _latency_sketches(deliveries, "subscriber")


def _latency_sketches(deliveries, key):
    """The sketch of the acked deliveries per queue, `key` (event or subscriber) and hour."""
    latency_ms = (F.unix_micros("acked_at") - F.unix_micros("created_at")) / F.lit(1000.0)
    # The latency is a column before the aggregate, not its argument: an object aggregate
    # evaluates its arguments interpreted, row by row, while a projection is generated code.
    hours = (
        deliveries.where(F.col("status") == "acked")
        .select(
            "queue", "day", key, _number("created_at", HOUR_US).alias("h"), latency_ms.alias("latency_ms")
        )
        .groupBy("queue", "day", key, "h")
        .agg(F.sort_array(F.collect_list("latency_ms")).alias("latencies"))
    )
    # m = min(n, K) points: the point of rank i/m is the ceil(i * n / m)-th smallest value
    # (integer arithmetic, as hours.latency_sketches computes it); an hour of at most K
    # values keeps them all, exact, rather than K points repeating them.
    m = f"greatest(1, least(size(latencies), {SKETCH_POINTS}))"
    rank = f"greatest(1, cast((cast(i as long) * size(latencies) + {m} - 1) div {m} as int))"
    points = F.expr(f"transform(sequence(1, {m}), i -> element_at(latencies, {rank}))")
    return hours.select(
        "queue",
        "day",
        key,
        _hour("h"),
        F.size("latencies").cast("long").alias("latency_count"),
        points.alias("latency_points"),
    )


# --- the whole job -------------------------------------------------------------------------------


def configure(spark):
    """What every run needs of the session, whoever built it (and the local tuning on a local
    master)."""
    for key, value in run_conf(_master_of(spark)).items():
        spark.conf.set(key, value)


def run_conf(master):
    """RUN_CONF, and LOCAL_RUN_CONF when `master` runs on this machine."""
    return {**RUN_CONF, **LOCAL_RUN_CONF} if is_local(master) else dict(RUN_CONF)


def is_local(master):
    """Whether a master runs on this machine: local, local[N], local[N,F], local-cluster[...]."""
    return _local_cores(master) is not None


def _master_of(spark):
    # A Spark Connect client asks its server, which answers with its own master.
    try:
        return spark.conf.get("spark.master", None)
    except Exception:  # a server that does not say: tuned as a cluster
        return None


def uri(path):
    """A path as Spark must be given it: a local one as an absolute file:// URI. Spark resolves a
    path without a scheme against Hadoop's default filesystem (fs.defaultFS), which on a YARN
    or Hadoop-configured cluster is HDFS, not this disk. A URI (s3a://, hdfs://, file:) is kept."""
    path = str(path)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", path):
        return path
    return "file://" + os.path.abspath(path)


def transforms(messages, deliveries):
    """{name: DataFrame} of the parts of these rows."""
    return {
        "message_hours": transform_message_hours(messages),
        "delivery_cells": transform_delivery_cells(deliveries),
        "latency_sketches": transform_latency_sketches(deliveries),
        "subscriber_latency_sketches": transform_subscriber_latency_sketches(deliveries),
    }


def compute_parts(spark, messages, deliveries):
    """{name: Arrow table} of the parts of these rows: small (a few rows per hour and
    key, whatever the rows), so they come back to the driver whole."""
    configure(spark)
    return {name: frame.toArrow() for name, frame in transforms(messages, deliveries).items()}


# --- load --------------------------------------------------------------------------------------


def load_parts(parts, out):
    """Write the parts ({name: DataFrame}, transforms()) as Parquet under `out`, one folder each
    (message_hours/, delivery_cells/, latency_sketches/), replacing what a run before wrote
    there: what spark-submit leaves for a reader. One file each: the parts are small."""
    for name, frame in parts.items():
        frame.coalesce(1).write.mode("overwrite").parquet(f"{uri(out).rstrip('/')}/{name}")


def main(argv=None):
    """spark-submit entry: the hour rows of the given archive files, as Parquet under --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", required=True, help="the archive root (MQ_ARCHIVE_DIR)")
    parser.add_argument(
        "--files", required=True, help="a text file listing the archive files to read, one a line"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="where message_hours/, delivery_cells/, latency_sketches/, subscriber_latency_sketches/ go",
    )
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
        load_parts(transforms(messages, deliveries), args.out)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
