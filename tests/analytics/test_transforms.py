"""Each step of analytics.job alone, in the Spark testing guide's shape: a few hand-made rows in,
the frame expected of that one step out, compared with pyspark.testing.assertDataFrameEqual
(schemas and rows, in any order). The whole job's figures are checked in test_job.py."""

from datetime import timedelta

import pyarrow.parquet as pq
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.testing import assertDataFrameEqual

from analytics import job, layout
from tests.analytics.frames import DELIVERY_FIELDS, MESSAGE_FIELDS, T0, frame, ts

DAY = T0.strftime("%Y-%m-%d")
HOUR = T0  # 12:00
NEXT_HOUR = ts(3600)
# Two days later, a replay (a subscription made "from" the past) makes a delivery of the day's
# message: it stays in its message's partition, DAY.
REPLAYED = ts(2 * 86400 + 5)
REPLAY_HOUR = ts(2 * 86400)


def schema(*fields):
    return T.StructType([T.StructField(name, kind) for name, kind in fields])


KEY = [("queue", T.StringType()), ("day", T.StringType()), ("event", T.StringType())]
MINUTES = T.ArrayType(
    T.StructType([T.StructField("minute", T.IntegerType()), T.StructField("n", T.LongType())])
)


def by_minute(hours):
    """The hours with their minute counts in minute order (collect_list keeps no order)."""
    return hours.withColumn("minute_counts", F.array_sort("minute_counts"))


def test_message_hours_count_each_hour_and_minute_of_each_event(spark):
    messages = frame(
        spark,
        "messages",
        MESSAGE_FIELDS,
        [
            ("db", "create", ts(0)),
            ("db", "create", ts(30)),
            ("db", "create", ts(90)),  # 12:01
            ("db", "create", ts(3700)),  # 13:01:40
            ("db", "delete", ts(10)),
        ],
    )
    expected = spark.createDataFrame(
        [
            ("db", DAY, "create", HOUR, 3, [(0, 2), (1, 1)], ts(0), ts(90)),
            ("db", DAY, "create", NEXT_HOUR, 1, [(1, 1)], ts(3700), ts(3700)),
            ("db", DAY, "delete", HOUR, 1, [(0, 1)], ts(10), ts(10)),
        ],
        schema(
            *KEY,
            ("hour", T.TimestampType()),
            ("messages", T.LongType()),
            ("minute_counts", MINUTES),
            ("first_at", T.TimestampType()),
            ("last_at", T.TimestampType()),
        ),
    )
    assertDataFrameEqual(by_minute(job.transform_message_hours(messages)), expected)


DELIVERIES = [
    ("db", "create", "logger", "acked", 1, ts(0), ts(0.25), DAY),
    ("db", "create", "logger", "acked", 2, ts(10), ts(3610), DAY),  # acked the next hour
    ("db", "create", "peer", "pending", 0, ts(20), None, DAY),
    ("db", "create", "peer", "pending", 1, ts(50), None, DAY),
    ("db", "create", "peer", "dead", 5, ts(60), None, DAY),
    ("db", "create", "replayer", "acked", 1, REPLAYED, REPLAYED + timedelta(seconds=0.5), DAY),
]


def test_delivery_cells_count_deliveries_by_subscriber_hour_ack_hour_and_state(spark):
    deliveries = frame(spark, "deliveries", (*DELIVERY_FIELDS, "day"), DELIVERIES)
    expected = spark.createDataFrame(
        [
            ("db", DAY, "create", "logger", HOUR, HOUR, "acked", 1, 1, ts(0)),
            ("db", DAY, "create", "logger", HOUR, NEXT_HOUR, "acked", 1, 2, ts(10)),
            ("db", DAY, "create", "peer", HOUR, None, "pending", 2, 1, ts(20)),
            ("db", DAY, "create", "peer", HOUR, None, "dead", 1, 5, ts(60)),
            # The replayed delivery: in the hour it was made, under its message's day
            ("db", DAY, "create", "replayer", REPLAY_HOUR, REPLAY_HOUR, "acked", 1, 1, REPLAYED),
        ],
        schema(
            *KEY,
            ("subscriber", T.StringType()),
            ("hour", T.TimestampType()),
            ("acked_hour", T.TimestampType()),
            ("status", T.StringType()),
            ("n", T.LongType()),
            ("attempts", T.LongType()),
            ("first_created_at", T.TimestampType()),
        ),
    )
    assertDataFrameEqual(job.transform_delivery_cells(deliveries), expected)


def test_latency_sketches_hold_each_hours_acked_latencies_at_min_n_200_ranks(spark):
    deliveries = frame(spark, "deliveries", (*DELIVERY_FIELDS, "day"), DELIVERIES)
    # 12:00 has two acked, 250 ms and 3,600,000 ms: m = min(2, 200) = 2 points, the values
    # themselves (rank i/m is the ceil(2i/2)-th smallest). The replayed delivery's latency runs
    # from its replay (its own created_at), not from its message's publish two days before.
    expected = spark.createDataFrame(
        [
            ("db", DAY, "create", HOUR, 2, [250.0, 3_600_000.0]),
            ("db", DAY, "create", REPLAY_HOUR, 1, [500.0]),
        ],
        schema(
            *KEY,
            ("hour", T.TimestampType()),
            ("latency_count", T.LongType()),
            ("latency_points", T.ArrayType(T.DoubleType())),
        ),
    )
    assertDataFrameEqual(job.transform_latency_sketches(deliveries), expected)


def test_extract_reads_the_files_given_with_their_partitions_queue_and_day(spark, tmp_path):
    # Given a batch archived as the archive writes it: a message of DAY, its delivery made by
    # a replay two days later, and another day's message
    at = ts(0)
    messages = [
        (1, "create", 1, at, "{}", None, None, None),
        (2, "create", 2, at + timedelta(days=1), "{}", None, None, None),
    ]
    deliveries = [
        (10, 1, "create", "logger", 1, "acked", 1, at, at, at + timedelta(seconds=1), ""),
        (11, 1, "create", "replayer", 1, "acked", 1, REPLAYED, REPLAYED, REPLAYED, ""),
        (12, 2, "create", "logger", 2, "pending", 0, at + timedelta(days=1), None, None, ""),
    ]
    written = layout.write_history(tmp_path, "db", messages, deliveries, durable=False)
    first_day = [p for p in written if f"/day={DAY}/" in p and "/deliveries/" in p]

    # When only the first day's deliveries file is given
    extracted = job.extract_archive(spark, tmp_path, layout.DELIVERIES, first_day)

    # Then its rows come, each with the folder's queue and day, in the columns the transforms read
    expected = spark.createDataFrame(
        [
            ("db", DAY, "create", "logger", "acked", 1, at, at + timedelta(seconds=1)),
            ("db", DAY, "create", "replayer", "acked", 1, REPLAYED, REPLAYED),
        ],
        T.StructType([job.DELIVERY_SCHEMA[c] for c in job.DELIVERY_COLUMNS]),
    )
    assertDataFrameEqual(extracted, expected)


def test_load_writes_each_part_as_one_parquet_file_replacing_the_last(spark, tmp_path):
    messages = frame(spark, "messages", MESSAGE_FIELDS, [("db", "create", ts(0)), ("db", "create", ts(5))])
    deliveries = frame(spark, "deliveries", (*DELIVERY_FIELDS, "day"), DELIVERIES)
    parts = job.transforms(messages, deliveries)

    job.load_parts(parts, tmp_path)
    job.load_parts(parts, tmp_path)  # a rerun replaces, not adds

    for name, part in parts.items():
        files = list((tmp_path / name).glob("*.parquet"))
        assert len(files) == 1, name
        loaded = spark.read.parquet(str(tmp_path / name))
        if name == "message_hours":
            loaded, part = by_minute(loaded), by_minute(part)
        assertDataFrameEqual(loaded, part)
        assert pq.read_table(files[0]).num_rows == part.count() > 0
