"""The analytics benchmark's own parts (bench/analytics_history.py, bench/analytics_run.py): the
generated archive is in the archive's layout and schemas, and the check against DuckDB passes
right figures and catches wrong ones. No Spark and no database: the benchmark's verdicts on the
job are only worth something if these hold."""

import sys
from datetime import timedelta
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analytics import layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import analytics_history as history  # noqa: E402
import analytics_run as run  # noqa: E402


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench-analytics")
    info = history.generate_archive(base / "archive", 30_000, files="hourly", days=2)
    return base, info


def test_the_archive_is_in_the_layout_with_its_schemas(archive):
    base, info = archive
    files = {
        kind: sorted((base / "archive" / kind).rglob("*.parquet")) for kind in ("messages", "deliveries")
    }
    # One file of each kind per queue and hour, named after its first and last message id.
    assert len(files["messages"]) == len(files["deliveries"]) == info["files_per_kind"] == 6 * 2 * 24
    for path in files["messages"][:5] + files["deliveries"][:5]:
        assert path.parent.name.startswith("day=") and path.parent.parent.name.startswith("queue=")
        first, last = (int(x) for x in path.stem.removeprefix("part-").split("-"))
        table = pq.read_table(path, partitioning=None)
        ids = table["id" if "messages" in str(path) else "message_id"].to_pylist()
        assert (min(ids), max(ids)) == (first, last)
        schema = layout.MESSAGE_SCHEMA if "messages" in str(path) else layout.DELIVERY_SCHEMA
        assert table.schema.equals(schema)


def test_each_message_fans_out_to_five_subscribers_all_acked(archive):
    base, info = archive
    db = duckdb.connect()
    fanned = f"""(SELECT * FROM read_parquet('{base}/archive/deliveries/**/*.parquet')
        WHERE subscriber <> '{history.REPLAYER}')"""
    rows = db.execute(
        f"""SELECT count(*), count(DISTINCT id), count(DISTINCT message_id),
            min(n), max(n), count(*) FILTER (status <> 'acked')
        FROM {fanned} JOIN (SELECT message_id, count(DISTINCT subscriber) AS n FROM {fanned} GROUP BY 1)
            USING (message_id)"""
    ).fetchone()
    assert rows == (30_000, 30_000, 6_000, 5, 5, 0)


def test_the_replayed_subscription_owes_each_earlier_message_of_its_queue_once_made_at_the_replay(archive):
    """Its deliveries are made at the replay, a day after their messages here (halfway through
    two days), and filed in their messages' queue and day, as the archive files them."""
    base, info = archive
    replay = info["replayed"]
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    glob = lambda kind: f"read_parquet('{base}/archive/{kind}/**/*.parquet', hive_partitioning = true)"  # noqa: E731
    owed = db.execute(
        f"SELECT count(*) FROM {glob('messages')} WHERE queue = '{history.REPLAY_QUEUE}' "
        f"AND created_at < TIMESTAMPTZ '{replay['at']}'"
    ).fetchone()[0]
    rows = db.execute(
        f"""SELECT count(*), count(DISTINCT d.message_id), count(DISTINCT d.id),
            count(*) FILTER (d.created_at < TIMESTAMPTZ '{replay["at"]}'),
            count(*) FILTER (d.queue::VARCHAR <> '{history.REPLAY_QUEUE}' OR d.day::VARCHAR <> m.day::VARCHAR
                OR d.event <> m.event OR d.acked_at <= d.created_at),
            min(d.created_at - m.created_at) >= INTERVAL 1 MINUTE
        FROM {glob("deliveries")} d JOIN {glob("messages")} m ON m.id = d.message_id
        WHERE d.subscriber = '{history.REPLAYER}'"""
    ).fetchone()
    assert owed > 100
    assert rows == (owed, owed, owed, 0, 0, True)
    assert replay["deliveries"] == owed and info["deliveries"] == 30_000 + owed


def _hot(base, archive_root):
    """A hot set as dump-hot writes it: some live rows, and archived deliveries seen pending."""
    messages, deliveries = history.history_tables(
        100,
        start=history.END + timedelta(hours=1),
        end=history.END + timedelta(hours=2),
        first_id=history.HOT_ID_BASE,
        status_mix=history.HOT_MIX,
    )
    old_m, old_d = history._archived_tail(archive_root, 2)
    old_d = old_d.set_column(
        old_d.schema.get_field_index("status"), "status", pa.repeat(pa.scalar("pending"), len(old_d))
    )
    hot = base / "hot"
    hot.mkdir(exist_ok=True)
    cols_m = ["id", "queue", "event", "created_at"]
    cols_d = [
        "id",
        "message_id",
        "queue",
        "event",
        "subscriber",
        "status",
        "attempts",
        "created_at",
        "acked_at",
    ]
    pq.write_table(
        pa.concat_tables([old_m.select(cols_m), messages.select(cols_m)]), hot / "messages.parquet"
    )
    pq.write_table(
        pa.concat_tables([old_d.select(cols_d), deliveries.select(cols_d)]), hot / "deliveries.parquet"
    )
    return hot, len(old_d)


def _as_printed(want, pick=0.5):
    """The JSON analyze would print for DuckDB's own figures (percentiles inside the bounds)."""
    events = []
    for (queue, event), w in want["events"].items():
        b = w["bounds"]
        latency = {
            p: (b[2 * i] + pick * (b[2 * i + 1] - b[2 * i]) if b else None)
            for i, p in enumerate(("p50", "p95", "p99"))
        }
        events.append(
            {"queue": queue, "event": event, "latency_ms": latency}
            | {k: w[k] for k in ("messages", "deliveries", *run.COUNTS)}
        )
    subscribers = [{"subscriber": s} | w for s, w in want["subscribers"].items()]
    return {"events": events, "subscribers": subscribers}


def test_the_check_passes_right_figures_and_catches_wrong_ones(archive):
    base, info = archive
    hot, overlapping = _hot(base, base / "archive")
    want = run.expected(base / "archive", hot)
    # The archive's copy wins: the overlapping deliveries count once, as acked.
    assert want["deliveries"] == info["deliveries"] + 500  # the hot set adds 500
    assert sum(w["acked"] for w in want["events"].values()) > 30_000 - overlapping
    assert overlapping == 6 * 2 * 5
    right = _as_printed(want)
    assert run.compare(right, want) == []

    # The snapshot's copy kept for one delivery: one pending too many, one acked too few.
    wrong = _as_printed(want)
    wrong["events"][0]["pending"] += 1
    wrong["events"][0]["acked"] -= 1
    assert len(run.compare(wrong, want)) == 2

    # A p99 off by more than 1 % of rank.
    wrong = _as_printed(want)
    key = (wrong["events"][1]["queue"], wrong["events"][1]["event"])
    wrong["events"][1]["latency_ms"]["p99"] = want["events"][key]["bounds"][4] - 1
    assert [p for p in run.compare(wrong, want) if "p99" in p]

    # Extras left out are not checked; a field the contract promises is.
    wrong = _as_printed(want)
    for row in wrong["subscribers"]:
        del row["inflight"]
    assert run.compare(wrong, want) == []
    del wrong["subscribers"][0]["pending"]
    assert run.compare(wrong, want) == [
        f"subscriber {wrong['subscribers'][0]['subscriber']} pending: missing from analyze's JSON"
    ]

    # A subscriber missing.
    wrong = _as_printed(want)
    del wrong["subscribers"][0]
    assert any("missing" in p for p in run.compare(wrong, want))
