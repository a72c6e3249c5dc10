"""The archive (analytics/archive.py, `manage.py archive`): acked history past retention moves to
Parquet in the contract's layout, nothing else moves, and a crash loses and doubles nothing.
No Spark here: the archive does not need it. DuckDB reads what it wrote."""

import io
import json
import os
import threading
import time
from datetime import UTC

import duckdb
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from analytics import archive, layout, tasks
from analytics.models import ArchiveBatch
from delivery import ledger, subscribing
from delivery.models import Delivery, Status
from queues.models import Message
from tests.analytics.archive_crash import crash_on_batch, files
from tests.analytics.locks import archive_held_elsewhere
from tests.support.history_rows import days_ago, delivery_of, publish_at, settle

pytestmark = pytest.mark.django_db


def parquet(root, kind, where="true"):
    """Rows of the archive as DuckDB reads the Hive layout, as dicts."""
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    # Through Arrow: DuckDB's own conversion of time zones to Python wants pytz.
    return (
        db.sql(
            f"SELECT * FROM read_parquet('{root}/{kind}/**/*.parquet', hive_partitioning = true, "
            f"filename = true) WHERE {where} ORDER BY id"
        )
        .to_arrow_table()
        .to_pylist()
    )


def run_archive(*args):
    out = io.StringIO()
    call_command("archive", *args, stdout=out)
    return json.loads(out.getvalue())


def test_it_moves_settled_history_past_retention_and_keeps_the_rest(archive_dir, db_queue, logger, peer):
    # Given, in a queue of 7 days' retention: an old message that no one was subscribed to
    lonely = publish_at(db_queue, "audit", days_ago(10), {"who": "nobody"})
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    # ... an old one acked by both, old ones each with a delivery still open or dead, and a
    # recent one acked by both
    done = publish_at(db_queue, "create", days_ago(10), {"path": "/srv/a", "size": 3, "é": None})
    settle(done, {logger: Status.ACKED, peer: Status.ACKED}, latency_ms=250, attempts=2)
    open_ = {}
    for status in (Status.PENDING, Status.INFLIGHT, Status.DEAD):
        open_[status] = publish_at(db_queue, "create", days_ago(9))
        settle(open_[status], {logger: Status.ACKED, peer: status})
    young = publish_at(db_queue, "create", days_ago(3))
    settle(young, {logger: Status.ACKED, peer: Status.ACKED})

    # When
    moved = archive.archive_history()

    # Then the two settled old messages moved, with their two deliveries
    assert moved == {"messages": 2, "deliveries": 2}
    assert not Message.objects.filter(id__in=[lonely, done]).exists()
    assert not Delivery.objects.filter(message_id__in=[lonely, done]).exists()
    # ... and everything else stays, as it was
    for status, message_id in open_.items():
        assert delivery_of(message_id, peer).status == status
        assert delivery_of(message_id, logger).status == Status.ACKED
    assert Delivery.objects.filter(message_id=young).count() == 2

    messages = parquet(archive_dir, "messages")
    assert [m["id"] for m in messages] == [lonely, done]
    day = days_ago(10).astimezone(UTC).strftime("%Y-%m-%d")
    for m in messages:
        path = os.path.relpath(m["filename"], archive_dir)
        assert path.startswith(f"messages/queue=db/day={day}/") and path.endswith(".parquet")
        assert (m["queue"], str(m["day"])) == ("db", day)
    assert json.loads(messages[1]["payload"]) == {"path": "/srv/a", "size": 3, "é": None}
    assert messages[0]["payload"] == '{"who":"nobody"}'
    assert (messages[0]["event"], messages[1]["event"]) == ("audit", "create")

    deliveries = parquet(archive_dir, "deliveries")
    assert {d["message_id"] for d in deliveries} == {done}
    for d in deliveries:
        assert d["subscriber"] in {"logger", "peer"} and d["event"] == "create"
        assert (d["status"], d["attempts"]) == ("acked", 2)
        assert os.path.relpath(d["filename"], archive_dir).startswith(f"deliveries/queue=db/day={day}/")
        # UTC timestamps, to the microsecond
        assert d["created_at"].utcoffset().total_seconds() == 0
        assert (d["acked_at"] - d["created_at"]).total_seconds() == 0.25


def test_it_keeps_each_queues_retention(archive_dir, make_queue, db_queue, logger):
    short = make_queue("network", retention_days=1)
    long = db_queue  # 7 days
    logger.subscribe_queues.add(short)  # a subscription is owed only what its right allows
    ids = {}
    for queue in (short, long):
        subscribing.subscribe(logger, queue)
        ids[queue.name] = publish_at(queue, "error", days_ago(3))
        settle(ids[queue.name], {logger: Status.ACKED})

    assert archive.archive_history() == {"messages": 1, "deliveries": 1}
    assert [m["id"] for m in parquet(archive_dir, "messages")] == [ids["network"]]
    assert Message.objects.filter(id=ids["db"]).exists()


def test_archive_older_than_days_0_moves_all_acked_history(archive_dir, subscribed, logger, peer):
    # Given fresh history: some settled, some not
    settled = []
    for _ in range(3):
        settled.append(publish_at(subscribed, "create", days_ago(0)))
        settle(settled[-1], {logger: Status.ACKED, peer: Status.ACKED})
    kept = publish_at(subscribed, "create", days_ago(0))
    settle(kept, {logger: Status.ACKED, peer: Status.DEAD})

    # When, and then: the command prints the contract's object
    assert run_archive("--older-than-days", "0") == {"messages": 3, "deliveries": 6}
    assert list(Message.objects.values_list("id", flat=True)) == [kept]
    assert sorted(Delivery.objects.values_list("status", flat=True)) == [Status.ACKED, Status.DEAD]
    assert [m["id"] for m in parquet(archive_dir, "messages")] == settled
    assert len(parquet(archive_dir, "deliveries")) == 6
    # ... and nothing moves twice
    assert run_archive("--older-than-days", "0") == {"messages": 0, "deliveries": 0}


def test_the_command_refuses_a_negative_age(archive_dir):
    with pytest.raises(CommandError, match="0 or more"):
        call_command("archive", "--older-than-days", "-1", stdout=io.StringIO())


def test_a_failure_between_write_and_delete_loses_nothing_and_a_rerun_completes_it(
    archive_dir, subscribed, logger, peer, monkeypatch
):
    # Given seven old settled messages, archived three at a time
    ids = []
    for i in range(7):
        ids.append(publish_at(subscribed, "create", days_ago(8 + i % 2), {"i": i}))
        settle(ids[-1], {logger: Status.ACKED, peer: Status.ACKED})
    real_delete = archive.delete_archived
    calls = []

    def crash_on_second_batch(message_ids, delivery_ids):
        calls.append(message_ids)
        if len(calls) == 2:
            raise RuntimeError("killed after the Parquet write, before the delete")
        return real_delete(message_ids, delivery_ids)

    monkeypatch.setattr(archive, "delete_archived", crash_on_second_batch)

    # When the run dies halfway
    with pytest.raises(RuntimeError, match="killed"):
        archive.archive_history(batch_size=3)

    # Then the first batch moved, the second is both written and still in the hot tables
    in_parquet = [m["id"] for m in parquet(archive_dir, "messages")]
    in_db = sorted(Message.objects.values_list("id", flat=True))
    assert in_parquet == ids[:6] and in_db == ids[3:]
    assert len(parquet(archive_dir, "deliveries")) == 12
    assert Delivery.objects.count() == 8
    # ... so every message is somewhere, and counted once by id
    assert sorted(set(in_parquet) | set(in_db)) == ids
    written = files(archive_dir)

    # When it runs again
    monkeypatch.setattr(archive, "delete_archived", real_delete)
    assert archive.archive_history(batch_size=3) == {"messages": 4, "deliveries": 8}

    # Then it finished the job: the same files again (overwritten, not doubled) and the last batch
    assert not Message.objects.exists() and not Delivery.objects.exists()
    assert set(written) <= set(files(archive_dir))
    messages = parquet(archive_dir, "messages")
    assert [m["id"] for m in messages] == ids
    deliveries = parquet(archive_dir, "deliveries")
    assert len(deliveries) == len({d["id"] for d in deliveries}) == 14
    assert not [f for f in files(archive_dir) if not f.endswith(".parquet")], "no temporary file left"


def test_running_it_again_rewrites_nothing(archive_dir, subscribed, logger, peer):
    old = publish_at(subscribed, "create", days_ago(30))
    settle(old, {logger: Status.ACKED, peer: Status.ACKED})
    assert archive.archive_history() == {"messages": 1, "deliveries": 2}
    before = {f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir)}

    assert archive.archive_history() == {"messages": 0, "deliveries": 0}
    assert {f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir)} == before


def test_a_second_run_at_once_is_refused(archive_dir, monkeypatch):
    monkeypatch.setattr(tasks, "LOCK_WAIT_SECS", 0.3)
    with archive_held_elsewhere():
        with pytest.raises(archive.ArchiveBusy):
            archive.archive_history()
        with pytest.raises(CommandError, match="another archive run"):
            call_command("archive", stdout=io.StringIO())
        assert tasks.archive_history() is None  # the beat's run waits a little, then steps aside
    assert archive.archive_history() == {"messages": 0, "deliveries": 0}


def test_the_beat_archives_hourly(archive_dir, subscribed, logger, peer):
    entry = settings.CELERY_BEAT_SCHEDULE["archive"]
    assert entry["task"] == "analytics.tasks.archive_history" and entry["schedule"] == 3600.0
    old = publish_at(subscribed, "create", days_ago(8))
    settle(old, {logger: Status.ACKED, peer: Status.ACKED})

    assert tasks.archive_history() == {"messages": 1, "deliveries": 2}
    assert tasks.archive_history() == {"messages": 0, "deliveries": 0}  # harmless twice


def assert_each_row_once_in_a_file(root):
    """Every message and delivery of the archive once, and every data file holding rows."""
    for kind in ("messages", "deliveries"):
        rows = parquet(root, kind)
        assert len(rows) == len({r["id"] for r in rows}), f"a {kind} row twice"
        with_rows = {os.path.relpath(r["filename"], root) for r in rows}
        assert with_rows == {f for f in files(root) if f.startswith(f"{kind}/")}, "a file without rows"
    assert all(f.endswith(".parquet") for f in files(root)), "a temporary file left"


def test_a_rerun_after_a_crash_writes_the_journaled_batch_again_whatever_it_would_pick(
    archive_dir, subscribed, logger, peer, monkeypatch
):
    # Given an old message still owed to peer (so not archivable), then seven settled ones
    late = publish_at(subscribed, "create", days_ago(9))
    settle(late, {logger: Status.ACKED, peer: Status.PENDING})
    ids = []
    for i in range(7):
        ids.append(publish_at(subscribed, "create", days_ago(8 + i % 2), {"i": i}))
        settle(ids[-1], {logger: Status.ACKED, peer: Status.ACKED})
    # ... and a run that dies after writing its second batch of three
    restore = crash_on_batch(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="killed"):
        archive.archive_history(batch_size=3)
    restore()
    assert [m["id"] for m in parquet(archive_dir, "messages")] == ids[:6]
    assert ArchiveBatch.objects.get().message_ids == ids[3:6]
    written = files(archive_dir)

    # When the late message becomes archivable (a lower id than the crashed batch's) and the
    # next run, with another cutoff, would cut its batches as [late, 3, 4], [5, 6]
    settle(late, {peer: Status.ACKED})
    assert archive.archive_history(older_than_days=5, batch_size=3) == {"messages": 5, "deliveries": 10}

    # Then the crashed batch was written again under its own names, and every row is in the
    # archive once, in a file that holds rows
    assert set(written) <= set(files(archive_dir))
    assert [m["id"] for m in parquet(archive_dir, "messages")] == sorted([late, *ids])
    assert len(parquet(archive_dir, "deliveries")) == 16
    assert_each_row_once_in_a_file(archive_dir)
    assert not Message.objects.exists() and not ArchiveBatch.objects.exists()

    # ... and a run with nothing to do rewrites nothing
    before = {f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir)}
    assert archive.archive_history() == {"messages": 0, "deliveries": 0}
    assert {f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir)} == before


def test_a_replay_leaves_out_what_an_operator_deleted_meanwhile(
    archive_dir, subscribed, logger, peer, monkeypatch
):
    # Given a batch of three, one of them alone in its day, written but not deleted
    alone = publish_at(subscribed, "create", days_ago(20))
    settle(alone, {logger: Status.ACKED, peer: Status.ACKED})
    pair = []
    for _ in range(2):
        pair.append(publish_at(subscribed, "create", days_ago(10)))
        settle(pair[-1], {logger: Status.ACKED, peer: Status.ACKED})
    restore = crash_on_batch(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="killed"):
        archive.archive_history()
    restore()
    assert len(parquet(archive_dir, "messages")) == 3

    # When an operator deletes the lone message and one of the pair, then the archive runs
    Message.objects.filter(id__in=[alone, pair[0]]).delete()
    assert archive.archive_history() == {"messages": 1, "deliveries": 2}

    # Then the archive holds the one that was left, once, and no file of the other two
    assert [m["id"] for m in parquet(archive_dir, "messages")] == [pair[1]]
    assert {d["message_id"] for d in parquet(archive_dir, "deliveries")} == {pair[1]}
    assert_each_row_once_in_a_file(archive_dir)
    day = days_ago(20).astimezone(UTC).strftime("%Y-%m-%d")
    assert not [f for f in files(archive_dir) if f"day={day}" in f]
    assert not ArchiveBatch.objects.exists()


def test_the_lock_can_be_waited_for(archive_dir):
    with archive_held_elsewhere() as release:
        # Given a holder: a short wait gives up after its time
        started = time.monotonic()
        with pytest.raises(archive.ArchiveBusy):
            with archive.exclusive(settings.MQ_ARCHIVE_DIR, wait_secs=0.5):
                pass
        assert time.monotonic() - started >= 0.5
        # ... and a longer one gets the lock once the holder lets go
        threading.Timer(0.5, release.set).start()
        with archive.exclusive(settings.MQ_ARCHIVE_DIR, wait_secs=30):
            assert release.is_set()


def test_a_message_reopened_before_the_delete_leaves_the_batchs_files(
    archive_dir, subscribed, logger, peer, monkeypatch
):
    # Given three old settled messages, the second reopened for peer (a seek) after the
    # batch's files are written, before its delete
    ids = []
    for _ in range(3):
        ids.append(publish_at(subscribed, "create", days_ago(10)))
        settle(ids[-1], {logger: Status.ACKED, peer: Status.ACKED})
    real_write = layout.write_history
    reopened = []

    def write_then_reopen(*args, **kwargs):
        written = real_write(*args, **kwargs)
        if not reopened:  # a seek, committed while the archive is between write and delete
            reopened.append(
                Delivery.objects.filter(message_id=ids[1], subscriber=peer).update(status=Status.PENDING)
            )
        return written

    monkeypatch.setattr(layout, "write_history", write_then_reopen)

    # When
    assert archive.archive_history() == {"messages": 2, "deliveries": 4}

    # Then the reopened message stays, and the archive holds no copy of it
    assert list(Message.objects.values_list("id", flat=True)) == [ids[1]]
    assert [m["id"] for m in parquet(archive_dir, "messages")] == [ids[0], ids[2]]
    assert {d["message_id"] for d in parquet(archive_dir, "deliveries")} == {ids[0], ids[2]}
    assert not ArchiveBatch.objects.exists()

    # ... and once settled again it is archived, once
    ledger.ack_deliveries(peer, [delivery_of(ids[1], peer).id])
    assert archive.archive_history() == {"messages": 1, "deliveries": 2}
    assert [m["id"] for m in parquet(archive_dir, "messages")] == ids
    assert_each_row_once_in_a_file(archive_dir)


@pytest.mark.django_db(transaction=True)
def test_a_seek_racing_the_delete_is_either_seen_or_finds_the_message_archived(
    archive_dir, subscribed, logger, peer, monkeypatch
):
    # Given an old settled message, and a seek of peer's delivery of it (the UPDATE that
    # ledger.replay runs) sent from another connection just after the archive has read the
    # deliveries it is about to delete
    message_id = publish_at(subscribed, "create", days_ago(10))
    settle(message_id, {logger: Status.ACKED, peer: Status.ACKED})
    ids = set(Delivery.objects.filter(message_id=message_id).values_list("id", flat=True))
    reopened, failures = [], []

    def seek():
        try:
            reopened.append(
                Delivery.objects.filter(message_id=message_id, subscriber=peer).update(status=Status.PENDING)
            )
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failures.append(e)
        finally:
            connection.close()

    seeker = threading.Thread(target=seek)

    def hook(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.startswith("SELECT") and 'FROM "delivery_delivery"' in sql and deleting and not seeker.ident:
            seeker.start()
            seeker.join(1)  # committed at once unless a lock makes it wait for the archive
        return result

    real_delete = archive.delete_archived
    deleting = []

    def delete_archived(*args):
        deleting.append(True)
        with connection.execute_wrapper(hook):
            return real_delete(*args)

    monkeypatch.setattr(archive, "delete_archived", delete_archived)

    # When the archive runs
    moved = archive.archive_history()
    seeker.join(30)
    assert not failures and seeker.ident

    # Then either the seek came first (the message stays, pending for peer, and has no copy in
    # the archive) or it found it gone: never a reopened delivery deleted
    hot = dict(Delivery.objects.filter(message_id=message_id).values_list("id", "status"))
    archived = {d["id"] for d in parquet(archive_dir, "deliveries")}
    if reopened == [1]:
        assert moved == {"messages": 0, "deliveries": 0}
        assert set(hot) == ids and Status.PENDING in hot.values() and not archived
    else:
        assert reopened == [0]
        assert moved == {"messages": 1, "deliveries": 2}
        assert not hot and archived == ids


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="row locks: SQLite's IMMEDIATE transactions run the seek and the archive one after the other",
)
@pytest.mark.django_db(transaction=True)
def test_a_seek_under_way_makes_the_archive_give_way_not_deadlock(archive_dir, subscribed, logger, peer):
    # Given two old settled messages, peer owed nothing of the second (its delivery gone), and
    # a seek of peer's subscription under way: it has reopened the first's delivery and added
    # one for the second, and commits only once the archive has tried
    from subscribers.models import Subscription
    from subscribers.replay import Point

    ids = [publish_at(subscribed, "create", days_ago(10)) for _ in range(2)]
    settle(ids[0], {logger: Status.ACKED, peer: Status.ACKED})
    settle(ids[1], {logger: Status.ACKED})
    Delivery.objects.filter(message_id=ids[1], subscriber=peer).delete()
    subscription = Subscription.objects.get(subscriber=peer, queue=subscribed)
    held, release, failures, replayed = threading.Event(), threading.Event(), [], []

    def seek():
        try:
            with transaction.atomic():
                replayed.append(subscribing.seek(subscription, Point("all")))
                held.set()
                release.wait(30)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failures.append(e)
        finally:
            held.set()
            connection.close()

    seeker = threading.Thread(target=seek)
    seeker.start()
    assert held.wait(30)

    # When the archive runs meanwhile, it gives way (tries again, then leaves the batch to the
    # next run) instead of waiting on the seek's rows while holding their messages
    with pytest.raises(RuntimeError, match="kept changing"):
        archive.archive_history()
    release.set()
    seeker.join(30)

    # Then the seek committed (no deadlock), nothing was deleted, and both messages are owed
    # to peer again; the next run replays the journaled batch, finds them unsettled, and takes
    # their copies out of the files the tries wrote
    assert not failures and replayed
    assert dict(
        Delivery.objects.filter(subscriber=peer).order_by("message_id").values_list("message_id", "status")
    ) == {ids[0]: Status.PENDING, ids[1]: Status.PENDING}
    assert archive.archive_history() == {"messages": 0, "deliveries": 0}
    assert Message.objects.filter(id__in=ids).count() == 2
    assert not [f for f in files(archive_dir) if f.endswith(".parquet")] and not ArchiveBatch.objects.exists()
