"""Compaction (analytics/compaction.py, `manage.py compactarchive`): each closed (queue, day)
partition of the archive becomes one file, and what a reader of the archive gets never
changes, whatever step a crash stops it at. DuckDB reads the archive, as in the archive's
tests."""

import io
import json
import os

import duckdb
import pyarrow.parquet as pq
import pytest
from django.core.management import CommandError, call_command

from analytics import archive, compaction, layout, tasks
from analytics.models import ArchiveBatch
from delivery import subscribing
from delivery.models import Status
from queues.models import Message
from tests.analytics.archive_crash import crash_on_batch, files
from tests.analytics.locks import archive_held_elsewhere
from tests.support.history_rows import days_ago, publish_at, settle

pytestmark = pytest.mark.django_db


CLOSED_DAYS = (10, 9, 8)  # before yesterday: closed
OPEN_DAYS = (1, 0)  # yesterday and today: the hourly runs still write there


def day(days):
    return layout.day_of(days_ago(days))


def content(root):
    """Every row of the archive, every column (the Hive ones too), as DuckDB reads it."""
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    return {
        kind: db.sql(
            f"SELECT * FROM read_parquet('{root}/{kind}/**/*.parquet', hive_partitioning = true) "
            f"ORDER BY id, {order}"
        )
        .to_arrow_table()
        .to_pylist()
        for kind, order in (("messages", "id"), ("deliveries", "message_id"))
    }


def partition_files(root):
    """{(kind, queue, day): [file names]}"""
    found = {}
    for f in files(root):
        kind, queue, day_, name = f.split("/")
        if kind != compaction.STAGING:
            found.setdefault((kind, queue[len("queue=") :], day_[len("day=") :]), []).append(name)
    return found


def archive_in_small_batches(queue, logger, peer):
    """An archive of many small files: one message a batch, several a day, on closed and
    open days. Returns the message ids."""
    ids = []
    for n, days in enumerate(CLOSED_DAYS * 4 + OPEN_DAYS * 2):
        ids.append(publish_at(queue, "create", days_ago(days) if days else days_ago(0), {"n": n}))
        settle(ids[-1], {logger: Status.ACKED, peer: Status.ACKED}, latency_ms=10 + n, attempts=1 + n % 3)
    archive.archive_history(older_than_days=0, batch_size=1)
    assert not Message.objects.exists()
    return ids


def compact(*args):
    out = io.StringIO()
    call_command("compactarchive", *args, stdout=out)
    return out.getvalue()


def test_it_makes_each_closed_partition_one_file_and_changes_no_row(archive_dir, db_queue, logger, peer):
    # Given an archive of one file per message (one of them with no delivery)
    publish_at(db_queue, "audit", days_ago(CLOSED_DAYS[0]), {"who": "nobody"})
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    archive_in_small_batches(db_queue, logger, peer)
    before = content(archive_dir)
    parts = partition_files(archive_dir)
    open_ = {key: names for key, names in parts.items() if key[2] in {day(d) for d in OPEN_DAYS}}
    open_mtimes = {
        f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir) if "day=" + day(0) in f
    }
    closed = {key: names for key, names in parts.items() if key not in open_}
    assert len(closed) == 6 and all(len(names) > 1 for names in closed.values())

    # When
    result = json.loads(compact("--json"))

    # Then every closed partition is one file, named after its first and last message id, its
    # rows sorted by id; the open ones are as they were
    total = sum(map(len, parts.values()))
    assert result == {
        "partitions": 6,
        "files_before": total,
        "files_after": total - sum(map(len, closed.values())) + 6,
    }
    after = partition_files(archive_dir)
    for (kind, queue, day_), names in after.items():
        if (kind, queue, day_) in open_:
            assert names == open_[(kind, queue, day_)]
            continue
        assert len(names) == 1
        table = pq.read_table(archive_dir / kind / f"queue={queue}" / f"day={day_}" / names[0])
        column = "id" if kind == "messages" else "message_id"
        ids = table.column(column).to_pylist()
        assert names[0] == layout.part_name(min(ids), max(ids))
        assert table.column("id").to_pylist() == sorted(table.column("id").to_pylist())
        assert table.schema == (layout.MESSAGE_SCHEMA if kind == "messages" else layout.DELIVERY_SCHEMA)
    assert {f: os.stat(archive_dir / f).st_mtime_ns for f in open_mtimes} == open_mtimes
    # ... and a reader gets exactly the same rows, every column alike
    assert content(archive_dir) == before
    assert not (archive_dir / compaction.STAGING).exists()

    # When it runs again, then it has nothing to do and rewrites nothing
    mtimes = {f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir)}
    n = result["files_after"]
    assert compact() == f"compacted 0 partitions: {n} files in the archive, now {n}\n"
    assert {f: os.stat(archive_dir / f).st_mtime_ns for f in files(archive_dir)} == mtimes


def test_it_keeps_one_copy_of_a_batch_an_older_archive_holds_twice(archive_dir, subscribed, logger, peer):
    """Before the journal, a rerun after a crash could write a batch again under other file
    names; the analytics no longer dedupe, so compaction leaves one copy of each row."""
    archive_in_small_batches(subscribed, logger, peer)
    before = content(archive_dir)
    parts = partition_files(archive_dir)
    (kind, queue, day_), names = next((k, n) for k, n in parts.items() if k[2] == day(CLOSED_DAYS[0]))
    folder = archive_dir / kind / f"queue={queue}" / f"day={day_}"
    pq.write_table(pq.read_table(folder / names[0]), folder / "part-000000000000-999999999999.parquet")
    assert len(content(archive_dir)[kind]) > len(before[kind])

    compact()

    assert content(archive_dir) == before


def test_it_replays_the_archives_journal_first(archive_dir, subscribed, logger, peer, monkeypatch):
    # Given an archive run that died after writing a batch, before deleting it
    ids = archive_in_small_batches(subscribed, logger, peer)
    more = [publish_at(subscribed, "create", days_ago(9)) for _ in range(2)]
    for message_id in more:
        settle(message_id, {logger: Status.ACKED, peer: Status.ACKED})
    restore = crash_on_batch(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="killed"):
        archive.archive_history()
    restore()

    # When
    compact()

    # Then the batch was finished, and every row is in the archive once
    assert not Message.objects.exists() and not ArchiveBatch.objects.exists()
    rows = content(archive_dir)
    assert [m["id"] for m in rows["messages"]] == sorted(ids + more)
    assert len({d["id"] for d in rows["deliveries"]}) == len(rows["deliveries"]) == 2 * len(ids + more)
    assert len(partition_files(archive_dir)[("messages", "db", day(9))]) == 1


class Killed(Exception):
    pass


def crash_at(monkeypatch, step):
    """Make compaction die at `step`, once, during its second partition (the first done)."""
    started = []
    real_write, real_exchange, real_remove_dir = (
        layout.write_file,
        compaction._exchange,
        compaction._remove_dir,
    )
    real_manifest, real_remove_file, real_move_in = (
        compaction._write_manifest,
        layout.remove_file,
        compaction._move_in,
    )
    state = {"armed": True, "swapped": False}

    def armed():
        if state["armed"] and len(started) == 2:
            state["armed"] = False
            return True
        return False

    def write_file(fs, folder, name, table, durable):
        if compaction.STAGING in folder:
            started.append(folder)
        if step == "writing the new file" and armed():
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f".{name}.half.tmp"), "wb") as f:
                f.write(b"PAR1")
            raise Killed(step)
        return real_write(fs, folder, name, table, durable)

    def exchange(a, b):
        if step == "before the swap" and armed():
            raise Killed(step)
        done = real_exchange(a, b)
        state["swapped"] = done
        if step == "after the swap" and armed():
            raise Killed(step)
        return done

    def remove_dir(fs, path):
        if step == "deleting the old files" and state["swapped"] and armed():
            victim = sorted(os.listdir(path))[0]
            os.remove(os.path.join(path, victim))
            raise Killed(step)
        return real_remove_dir(fs, path)

    def write_manifest(fs, staged, manifest):
        real_manifest(fs, staged, manifest)
        if step == "after the manifest" and armed():
            raise Killed(step)

    def remove_file(fs, path):
        removed = real_remove_file(fs, path)
        if step == "among the deletes" and armed():
            raise Killed(step)
        return removed

    def move_in(fs, source, target):
        if step == "before the move" and armed():
            raise Killed(step)
        return real_move_in(fs, source, target)

    monkeypatch.setattr(layout, "write_file", write_file)
    monkeypatch.setattr(compaction, "_exchange", exchange)
    monkeypatch.setattr(compaction, "_remove_dir", remove_dir)
    monkeypatch.setattr(compaction, "_write_manifest", write_manifest)
    monkeypatch.setattr(layout, "remove_file", remove_file)
    monkeypatch.setattr(compaction, "_move_in", move_in)


def assert_each_row_at_most_once(root, before):
    for kind, rows in content(root).items():
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)), f"a {kind} row twice"
        assert all(r in before[kind] for r in rows)


@pytest.mark.parametrize(
    "step", ["writing the new file", "before the swap", "after the swap", "deleting the old files"]
)
def test_a_crash_at_any_step_of_the_swap_loses_and_doubles_nothing(
    archive_dir, subscribed, logger, peer, monkeypatch, step
):
    # Given a compaction that dies at this step of its second partition
    archive_in_small_batches(subscribed, logger, peer)
    before = content(archive_dir)
    crash_at(monkeypatch, step)
    with pytest.raises(Killed):
        compaction.compact_archive()

    # Then a reader sees every row once meanwhile: the swap is one step
    assert content(archive_dir) == before
    assert (archive_dir / compaction.STAGING).exists()

    # When the next run comes, then it cleans up and finishes
    result = compaction.compact_archive()
    swapped = step in ("after the swap", "deleting the old files")
    assert result["partitions"] == (4 if swapped else 5)  # of 6, the first done before the crash
    assert content(archive_dir) == before
    assert not (archive_dir / compaction.STAGING).exists()
    assert all(len(n) == 1 for (_, _, d), n in partition_files(archive_dir).items() if d <= day(2))
    assert all(f.endswith(".parquet") for f in files(archive_dir))


@pytest.mark.parametrize(
    "step", ["writing the new file", "after the manifest", "among the deletes", "before the move"]
)
def test_without_an_atomic_swap_a_crash_at_any_step_loses_and_doubles_nothing(
    archive_dir, subscribed, logger, peer, monkeypatch, step
):
    # Given a filesystem with no RENAME_EXCHANGE (as an object store), and a compaction that
    # dies at this step of its second partition
    archive_in_small_batches(subscribed, logger, peer)
    before = content(archive_dir)
    monkeypatch.setattr(compaction, "_libc", lambda: object())
    crash_at(monkeypatch, step)
    with pytest.raises(Killed):
        compaction.compact_archive()

    # Then no row is twice; some may be out of a reader's sight until the next run (not atomic
    # to readers there, as its documentation says)
    assert_each_row_at_most_once(archive_dir, before)

    # When the next run comes, then it rolls the switch forward or back, and finishes
    compaction.compact_archive()
    assert content(archive_dir) == before
    assert not (archive_dir / compaction.STAGING).exists()
    assert all(len(n) == 1 for (_, _, d), n in partition_files(archive_dir).items() if d <= day(2))


def test_the_beat_archives_then_compacts(archive_dir, subscribed, logger, peer):
    # Given history archived in many small batches, and more now past retention
    archive_in_small_batches(subscribed, logger, peer)
    old = publish_at(subscribed, "create", days_ago(9))
    settle(old, {logger: Status.ACKED, peer: Status.ACKED})
    before = content(archive_dir)

    # When the hourly task runs
    assert tasks.archive_history() == {"messages": 1, "deliveries": 2}

    # Then the new message is archived and every closed partition is one file
    rows = content(archive_dir)
    assert [m["id"] for m in rows["messages"]] == sorted([m["id"] for m in before["messages"]] + [old])
    assert all(len(n) == 1 for (_, _, d), n in partition_files(archive_dir).items() if d <= day(2))


def test_it_waits_for_no_one(archive_dir):
    with archive_held_elsewhere():
        with pytest.raises(CommandError, match="another archive run"):
            compact("--json")
    assert json.loads(compact("--json")) == {"partitions": 0, "files_before": 0, "files_after": 0}


def test_a_local_disk_swaps_two_folders_in_one_step(tmp_path):
    # The atomic way is the one taken here (no silent fall back to the manifest's)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "new").write_text("new")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "old").write_text("old")
    assert compaction._exchange(str(tmp_path / "a"), str(tmp_path / "b")) is True
    assert os.listdir(tmp_path / "b") == ["new"] and os.listdir(tmp_path / "a") == ["old"]
    with pytest.raises(FileNotFoundError):
        compaction._exchange(str(tmp_path / "a"), str(tmp_path / "missing"))
