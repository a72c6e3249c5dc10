"""Replays and seeks in the analytics. A subscription made "from" the past, or a seek, makes
deliveries of old messages now (their created_at), which the archive files under their message's
day: they are counted with their message's partition, whatever runs recompute, and a window of
days (--since/--until) takes them with their message. Every figure is checked against DuckDB
over the archive's files and the hot rows as the ORM reads them (tests/analytics/reference.py).

Latency runs from a delivery's own created_at to its ack (docs/analytics.md): from the replay
for a delivery a replay or seek made, from its first making for one a seek handed out again."""

import io
import json
from datetime import timedelta

import pyarrow as pa
import pytest
from django.core.management import call_command
from django.utils import timezone

from analytics import stored
from analytics.models import EventStats, SubscriberStats
from delivery.models import Delivery, Status
from queues.models import Message
from tests.analytics.reference import assert_agrees_with_duckdb, duckdb_events, duckdb_subscribers
from tests.support.history_rows import publish_at, settle
from tests.support.publish import publish
from tests.support.rest import ack, pull, seek, subscribe

pytestmark = pytest.mark.django_db

HOT_MESSAGES = pa.schema(
    [
        ("id", pa.int64()),
        ("queue", pa.string()),
        ("event", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)
HOT_DELIVERIES = pa.schema(
    [
        ("message_id", pa.int64()),
        ("queue", pa.string()),
        ("event", pa.string()),
        ("subscriber", pa.string()),
        ("status", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("acked_at", pa.timestamp("us", tz="UTC")),
    ]
)


class Hot:
    """The hot tables' rows as the ORM reads them now (not analytics.extract's snapshot)."""

    def __init__(self):
        self.messages = pa.Table.from_pylist(
            [
                dict(zip(HOT_MESSAGES.names, row, strict=True))
                for row in Message.objects.values_list("id", "queue__name", "event__name", "created_at")
            ],
            HOT_MESSAGES,
        )
        self.deliveries = pa.Table.from_pylist(
            [
                dict(zip(HOT_DELIVERIES.names, row, strict=True))
                for row in Delivery.objects.values_list(
                    "message_id",
                    "queue__name",
                    "event__name",
                    "subscriber__name",
                    "status",
                    "created_at",
                    "acked_at",
                )
            ],
            HOT_DELIVERIES,
        )


def ack_pulled(who, keep_open=()):
    """Lease everything `who` is owed (REST) and ack it, but the deliveries of the messages in
    `keep_open` (left in flight)."""
    deliveries = pull(who, "?limit=1000")
    assert deliveries
    ack(who, [d["id"] for d in deliveries if d["message_id"] not in keep_open])


def assert_stored_figures_agree_with_duckdb(archive_dir):
    hot = Hot()
    assert_agrees_with_duckdb(duckdb_events(archive_dir, hot), list(EventStats.objects.values()))
    stored = {s.subscriber: (s.deliveries, s.pending, s.acked, s.dead) for s in SubscriberStats.objects.all()}
    assert stored == duckdb_subscribers(archive_dir, hot)


def analyze(*args):
    out = io.StringIO()
    call_command("analyze", "--json", *args, stdout=out)
    return json.loads(out.getvalue())


def as_stats(events):
    """`analyze --json`'s events as stored statistics' fields (what the DuckDB check reads)."""
    return [{**e, **{f"latency_{k}_ms": v for k, v in e["latency_ms"].items()}} for e in events]


@pytest.mark.parametrize("in_process", [False, True], ids=["spark", "in-process"])
def test_replays_and_seeks_count_with_their_message_across_archives_and_runs(
    spark, archive_dir, db_queue, logger, peer, settings, in_process
):
    # Given a message of three days ago that nobody was subscribed to, then the logger
    # subscribed and two more it acked then, and one of today it acked at once
    old = (timezone.now() - timedelta(days=3)).replace(hour=12, minute=0)
    first = publish_at(db_queue, "create", old)
    logger_subscription = subscribe(logger, {"queue": "db"}).json()["id"]
    acked_then = [publish_at(db_queue, "create", old + timedelta(minutes=i)) for i in (5, 6)]
    for message_id in acked_then:
        settle(message_id, {logger: Status.ACKED}, latency_ms=40)
    publish(db_queue, event="delete")
    ack_pulled(logger)

    # When the peer subscribes from the start (its four deliveries made now) and acks all but
    # one, which keeps that message in the hot tables
    replay = subscribe(peer, {"queue": "db", "from": "all"})
    assert replay.status_code == 201 and replay.json()["replay"]["deliveries"] == 4
    ack_pulled(peer, keep_open={acked_then[1]})
    # ... and the logger seeks back to the first: the message it lacked is added (made now),
    # the three it acked are handed out again (made when they were), and it acks them all
    sought = seek(logger, logger_subscription, {"seq": 1})
    assert sought.status_code == 200 and sought.json()["replay"]["deliveries"] == 4
    ack_pulled(logger)
    made_now = Delivery.objects.filter(message_id=first, subscriber=logger).get().created_at
    assert made_now.date() != old.date()  # what the archive files under the message's day

    # ... then everything settled is archived, and the analysis runs
    call_command("archive", "--older-than-days", "0", stdout=io.StringIO())
    assert Message.objects.count() == 1  # the one the peer has not acked
    analyze()

    # Then every figure is DuckDB's, the replayed and sought deliveries counted once each
    assert_stored_figures_agree_with_duckdb(archive_dir)
    create = EventStats.objects.get(event="create")
    assert (create.messages, create.deliveries, create.acked) == (3, 6, 5)
    # ... latency from each delivery's making: the three made now were acked within a minute;
    # the two the seek handed out again were made with their messages, three days before
    assert create.latency_p50_ms < 60_000 and create.latency_p99_ms > 2 * 86_400_000

    # When a message of today is archived into today's partition (changed: recomputed alone,
    # by Spark or, a few kilobytes, in this process) and the analysis runs again
    settings.MQ_ANALYTICS_LOCAL_BYTES = (1 << 20) if in_process else 0
    publish(db_queue, event="delete")
    ack_pulled(logger)
    ack_pulled(peer, keep_open={acked_then[1]})
    call_command("archive", "--older-than-days", "0", stdout=io.StringIO())
    analyze()

    # Then the old day's rows are kept, the replayed ones with them, and still agree
    run = stored.last_run()
    assert (run.partitions_recomputed, run.partitions_reused, run.spark) == (1, 1, not in_process)
    assert_stored_figures_agree_with_duckdb(archive_dir)

    # ... and a window of the old day takes its messages with all their deliveries, made now
    # or then, archived or still hot
    day = old.date().isoformat()
    window = analyze("--since", day, "--until", day)
    assert_agrees_with_duckdb(
        duckdb_events(archive_dir, Hot(), where=f"day = '{day}'"), as_stats(window["events"])
    )
    assert sum(e["deliveries"] for e in window["events"]) == 6
