"""The archive's retention (MQ_ARCHIVE_RETENTION_DAYS, analytics/retention.py): whole (queue,
day) partitions older than it leave the archive, by `manage.py prunearchive` and on beat after
the archive run, and the analytics then count what the archive keeps."""

import io
import json

import duckdb
import pytest
from django.core.management import CommandError, call_command

from analytics import archive, layout, tasks
from analytics.models import EventStats
from analytics.stored import last_run
from delivery import subscribing
from delivery.models import Status
from mqsite.commands import EXIT_BUSY, EXIT_USAGE
from tests.analytics.locks import archive_held_elsewhere
from tests.support.history_rows import days_ago, publish_at, settle

pytestmark = pytest.mark.django_db

DAYS = (20, 12, 9, 3, 1)  # days ago, one message each (two on the oldest)


@pytest.fixture
def archived(archive_dir, db_queue, make_queue, logger):
    """Every day of DAYS archived, in two queues; returns {days ago: message ids}."""
    network = make_queue("network")
    logger.subscribe_queues.add(network)
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(logger, network)
    ids = {}
    for days in DAYS:
        for queue in (db_queue, network):
            ids.setdefault(days, []).append(publish_at(queue, "create", days_ago(days)))
    ids[DAYS[0]].append(publish_at(db_queue, "create", days_ago(DAYS[0])))
    for message_ids in ids.values():
        for message_id in message_ids:
            settle(message_id, {logger: Status.ACKED})
    archive.archive_history(older_than_days=0)
    return ids


def archived_days(root):
    """{kind: sorted (queue, day)} of the archive's rows, as DuckDB reads them."""
    db = duckdb.connect()
    return {
        kind: sorted(
            db.sql(
                f"SELECT DISTINCT queue, day::VARCHAR FROM read_parquet('{root}/{kind}/**/*.parquet', "
                "hive_partitioning = true)"
            ).fetchall()
        )
        for kind in (layout.MESSAGES, layout.DELIVERIES)
    }


def day(days):
    return layout.day_of(days_ago(days))


def prune(*args):
    out = io.StringIO()
    call_command("prunearchive", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_by_default_the_archive_is_kept_forever(archived, archive_dir):
    before = archived_days(archive_dir)
    assert json.loads(prune("--json")) == {"partitions": 0, "files": 0, "bytes": 0}
    assert archived_days(archive_dir) == before


def test_it_deletes_whole_partitions_older_than_the_retention(archived, archive_dir, settings):
    settings.MQ_ARCHIVE_RETENTION_DAYS = 10
    sizes = sum(p.stat().st_size for p in archive_dir.glob("*/queue=*/day=*/*.parquet") if day(20) in str(p))

    result = json.loads(prune("--json"))

    # Then the days 20 and 12 ago are gone, both kinds, both queues; 9, 3 and 1 are kept
    kept = {day(d) for d in (9, 3, 1)}
    expected = sorted((q, d) for q in ("db", "network") for d in kept)
    assert archived_days(archive_dir) == {layout.MESSAGES: expected, layout.DELIVERIES: expected}
    assert result["partitions"] == 4
    assert result["files"] == 8  # a message file and a delivery file in each
    assert result["bytes"] > sizes > 0
    assert not list(archive_dir.glob(f"*/queue=*/day={day(20)}"))
    # ... and a second run has nothing left to do
    assert prune() == "deleted 0 partitions: 0 files, 0 bytes\n"


def test_older_than_days_overrides_the_setting(archived, archive_dir, settings):
    settings.MQ_ARCHIVE_RETENTION_DAYS = 10
    json.loads(prune("--json", "--older-than-days", "2"))
    expected = sorted((q, day(1)) for q in ("db", "network"))
    assert archived_days(archive_dir)[layout.MESSAGES] == expected
    with pytest.raises(CommandError) as raised:
        prune("--older-than-days", "0")
    assert raised.value.returncode == EXIT_USAGE


def test_a_busy_archive_is_left_alone(archived, archive_dir, settings):
    settings.MQ_ARCHIVE_RETENTION_DAYS = 2
    before = archived_days(archive_dir)
    with archive_held_elsewhere():
        with pytest.raises(CommandError, match="another archive run") as raised:
            prune()
    assert raised.value.returncode == EXIT_BUSY
    assert archived_days(archive_dir) == before


def test_the_beat_prunes_after_archiving(archive_dir, db_queue, logger, settings):
    settings.MQ_ARCHIVE_RETENTION_DAYS = 10
    subscribing.subscribe(logger, db_queue)
    db_queue.retention_days = 1
    db_queue.save()
    for days in (15, 5):
        settle(publish_at(db_queue, "create", days_ago(days)), {logger: Status.ACKED})

    tasks.archive_history()

    # The old day was archived, then deleted in the same run; the newer one is kept
    assert archived_days(archive_dir)[layout.MESSAGES] == [("db", day(5))]


def test_the_analytics_then_count_what_the_archive_keeps(spark, archived, archive_dir, settings):
    call_command("analyze", stdout=io.StringIO(), stderr=io.StringIO())
    assert EventStats.objects.get(queue="db").messages == len(DAYS) + 1

    settings.MQ_ARCHIVE_RETENTION_DAYS = 10
    prune()
    out = io.StringIO()
    call_command("analyze", "--json", stdout=out, stderr=io.StringIO())

    # The two oldest days' messages are no longer counted; nothing was recomputed for it
    assert EventStats.objects.get(queue="db").messages == len(DAYS) - 2
    assert EventStats.objects.get(queue="network").messages == len(DAYS) - 2
    assert last_run().partitions_recomputed == 0
    assert {e["queue"]: e["messages"] for e in json.loads(out.getvalue())["events"]} == {
        "db": len(DAYS) - 2,
        "network": len(DAYS) - 2,
    }
