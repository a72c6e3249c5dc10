"""Hand-made input frames for analytics.job's transforms: rows as tuples of named fields, in the
job's Spark schema (job.MESSAGE_SCHEMA, DELIVERY_SCHEMA).

    frame(spark, "deliveries", DELIVERY_FIELDS, [("db", "create", "logger", "acked", 1, ts(0), ts(1))])

A row's `day` (its partition's) is its created_at's unless the fields name it: a delivery a
replay made later names its message's.
"""

from datetime import UTC, datetime, timedelta

from pyspark.sql import types as T

from analytics import job

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
MESSAGE_FIELDS = ("queue", "event", "created_at")
DELIVERY_FIELDS = ("queue", "event", "subscriber", "status", "attempts", "created_at", "acked_at")


def ts(seconds):
    return T0 + timedelta(seconds=seconds)


def frame(spark, kind, fields, rows):
    schema = {"messages": job.MESSAGE_SCHEMA, "deliveries": job.DELIVERY_SCHEMA}[kind]
    columns = fields if "day" in fields else (*fields, "day")
    dicts = [dict(zip(fields, r, strict=True)) for r in rows]
    for d in dicts:
        d.setdefault("day", d["created_at"].strftime("%Y-%m-%d"))
    return spark.createDataFrame(dicts, T.StructType([schema[c] for c in columns]))
