"""A generated delivery history in the archive's own layout (analytics.layout), for the analytics
benchmarks, plus a small live set in the hot tables.

    .venv/bin/python bench/analytics_history.py archive DIR [--deliveries 5000000] [--files hourly]
    .venv/bin/python bench/analytics_history.py hot [--archive DIR]      # into DATABASE_URL

The archive is written straight to Parquet with pyarrow compute (vectorised, no Python loop
per row; 5 million deliveries in a few seconds):

    DIR/messages/queue=<q>/day=<d>/part-<first id>-<last id>.parquet
    DIR/deliveries/queue=<q>/day=<d>/part-<first id>-<last id>.parquet

with exactly layout.MESSAGE_SCHEMA and DELIVERY_SCHEMA, files named after the first and last
message id in them, as the archive names them. `hourly` is one file of each kind per queue and
hour (what the hourly archive task leaves: 1,440 per kind for 6 queues over 10 days);
`daily` one per queue and day (a compacted archive: 66 per kind, the 10 days from noon to
noon touching 11 dates).

A replayed subscription (issue 32): REPLAYER subscribed to REPLAY_QUEUE two days before END
"from" three days before that, so its deliveries were made days after their messages, in the
replay's hours, and archived in their messages' days (`replayed`).

The workload of issue 19: 6 queues, 3 events, 50 subscribers, 10 days ending at END, a
fan-out of 5 (each message goes to 5 distinct subscribers), payloads of about 100 bytes.
Message ids rise with publish time, and each message's deliveries take the next 5 delivery ids,
as the fan-out makes them. Archived deliveries are acked (only acked history is archived);
attempts are mostly 1; the publish-to-ack latency is log-normal (median 40 ms) with a long
tail: 2 % of deliveries waited for a retry, log-uniform from 1 s to 10 minutes.

The hot set (`hot`) is a live hour after END: HOT_MESSAGES messages with their deliveries,
pending, in flight, acked and dead, inserted with bulk SQL (the ORM's bulk_create, so the
tally triggers count them as they do for any insert). When given the archive, the last
OVERLAP_MESSAGES archived messages of each queue are also put in the hot tables with their
deliveries *pending*: what a snapshot taken before the archive moved them would hold. The
archive's copy (acked) must win.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analytics.layout import DELIVERY_SCHEMA, MESSAGE_SCHEMA  # noqa: E402

TS = pa.timestamp("us", tz="UTC")
# Noon: the archive's last day is open, so the hour added after END (analytics_run.py's
# "hour" run) lands in a day that already has files, as 23 of the hourly archive's 24 runs do.
END = datetime(2026, 11, 20, 12, tzinfo=UTC)
QUEUES = ["auth", "billing", "db", "filesystem", "mail", "network"]
EVENTS = ["create", "delete", "error"]
SUBSCRIBERS = [f"subscriber-{i:02d}" for i in range(50)]
DAYS = 10
FANOUT = 5
HOT_MESSAGES = 2000
OVERLAP_MESSAGES = 20  # per queue
# The hot set's ids start here, above any archive's (and the hour added after it).
HOT_ID_BASE = 100_000_000
HOUR_US = 3_600_000_000
# A subscriber that subscribed two days before END with "from" three days before that: its
# deliveries are made at the replay, days after their messages, and archived with them.
REPLAYER = "replayer"
# What a retried delivery's last attempt left (the fan-out's and the replay's).
RETRY_ERROR = "HTTP 503 from the webhook"
REPLAY_QUEUE = "db"
REPLAY_AGO = timedelta(days=2)
REPLAY_SPAN = timedelta(days=3)
REPLAY_STEP_US = 2_000  # the replay's pace: 500 deliveries a second
REPLAY_ID_BASE = 90_000_000  # above the fan-out's delivery ids, below the hot set's


# --- vectorised helpers (pyarrow compute) ---------------------------------------------------------


def _seq(n, start=0):
    """start, start + 1, ..., as int64."""
    return pc.add(pc.subtract(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n)), 1), start)


def _mod(values, k):
    return pc.subtract(values, pc.multiply(pc.divide(values, k), k))


def _pick(indices, names):
    """names[indices] as a plain string column."""
    return pc.take(pa.array(names), indices)


def _to_int(values):
    return pc.cast(pc.floor(values), pa.int64())


def _rand_int(n, high, seed):
    return _to_int(pc.multiply(pc.random(n, initializer=seed), high))


def _normal(n, seed):
    """Standard normal samples (Box-Muller)."""
    u1 = pc.subtract(1.0, pc.random(n, initializer=seed))  # (0, 1]: ln is finite
    u2 = pc.random(n, initializer=seed + 1)
    return pc.multiply(pc.sqrt(pc.multiply(pc.ln(u1), -2.0)), pc.cos(pc.multiply(u2, 2 * math.pi)))


def _repeat_each(values, k):
    """Each element k times in a row: [a, b] -> [a, a, b, b] for k = 2."""
    return pc.take(values, pc.divide(_seq(len(values) * k), k))


def latency_us(n, seed):
    """Publish-to-ack latencies: log-normal around 40 ms (sigma 1.2), and a 2 % tail of retried
    deliveries log-uniform between 1 s and 10 minutes."""
    body = pc.exp(pc.add(pc.multiply(_normal(n, seed), 1.2), math.log(40_000)))
    tail = pc.exp(pc.add(pc.multiply(pc.random(n, initializer=seed + 2), math.log(600)), math.log(1_000_000)))
    retried = pc.less(pc.random(n, initializer=seed + 3), 0.02)
    return pc.add(_to_int(pc.if_else(retried, tail, body)), 1), retried


def attempts_for(n, retried, seed):
    """Mostly 1; a retried delivery 2 to 5."""
    return pc.if_else(retried, pc.add(_rand_int(n, 4, seed), 2), pa.scalar(1, pa.int64()))


def payloads(mid, size):
    """About 100 bytes of JSON per message, each different."""
    text = pc.cast(mid, pa.string())
    return pc.binary_join_element_wise(
        '{"host":"bench-',
        pc.cast(_mod(mid, 97), pa.string()),
        '.example.net","path":"/srv/data/',
        text,
        '.dat","size":',
        pc.cast(size, pa.string()),
        ',"tag":"',
        pc.utf8_lpad(text, 8, "x"),
        '"}',
        "",
    )


# --- the archive --------------------------------------------------------------------------------


def history_tables(
    n_messages,
    *,
    start,
    end,
    queues=QUEUES,
    events=EVENTS,
    subscribers=SUBSCRIBERS,
    fanout=FANOUT,
    first_id=1,
    status_mix=None,
    seed=1,
):
    """(messages, deliveries) as Arrow tables: the layout's columns plus `queue`, `day` and
    `hour` (hours since the epoch). Messages in id order, ids rising with publish time;
    deliveries in id order, `fanout` per message (to distinct subscribers) in message order.

    status_mix: None for all acked (the archive), else [(status, share), ...] summing to 1.
    """
    start_us = int(start.timestamp() * 1_000_000)
    span_us = int((end - start).total_seconds() * 1_000_000)
    # Sorted uniform times: ids rise with time, as the database's autoincrement makes them.
    uniform = pc.random(n_messages, initializer=seed)
    uniform = pc.take(uniform, pc.array_sort_indices(uniform))
    created_us = pc.add(_to_int(pc.multiply(uniform, span_us)), start_us)
    mid = _seq(n_messages, start=first_id)
    created = pc.cast(created_us, TS)
    queue_idx = _rand_int(n_messages, len(queues), seed + 10)
    event = _pick(_rand_int(n_messages, len(events), seed + 11), events)
    queue = _pick(queue_idx, queues)
    day = pc.strftime(created, format="%Y-%m-%d")
    hour = pc.divide(created_us, HOUR_US)
    seq = _seq_within(queue_idx, len(queues))
    messages = pa.table(
        {
            "id": mid,
            "event": event,
            "seq": seq,
            "created_at": created,
            "payload": payloads(mid, _rand_int(n_messages, 100_000, seed + 12)),
            "key": pa.nulls(n_messages, pa.string()),
            "publisher": pc.if_else(
                pc.less(pc.random(n_messages, initializer=seed + 13), 0.5),
                _pick(_rand_int(n_messages, len(subscribers), seed + 14), subscribers),
                pa.scalar(None, pa.string()),
            ),
            "headers": pa.nulls(n_messages, pa.string()),
            "queue": queue,
            "day": day,
            "hour": hour,
        }
    )

    n = n_messages * fanout
    d_mid = _repeat_each(mid, fanout)
    d_created = _repeat_each(created, fanout)
    # `fanout` distinct subscribers per message: a random first one, then strides.
    base = _repeat_each(_rand_int(n_messages, len(subscribers), seed + 20), fanout)
    k = _mod(_seq(n), fanout)
    subscriber_idx = _mod(pc.add(base, pc.multiply(k, len(subscribers) // fanout)), len(subscribers))
    lat, retried = latency_us(n, seed + 30)
    if status_mix is None:
        status = pa.repeat(pa.scalar("acked"), n)
    else:
        roll = pc.random(n, initializer=seed + 40)
        bounds, total = [], 0.0
        for _, share in status_mix[:-1]:
            total += share
            bounds.append(pc.less(roll, total))
        status = pc.case_when(pc.make_struct(*bounds), *[s for s, _ in status_mix])
    acked = pc.equal(status, "acked")
    dead = pc.equal(status, "dead")
    pending = pc.equal(status, "pending")
    created_int = pc.cast(d_created, pa.int64())
    acked_at = pc.if_else(acked, pc.cast(pc.add(created_int, lat), TS), pa.scalar(None, TS))
    # Handed out some time before the ack; a pending one not yet.
    delivered_at = pc.if_else(
        pending, pa.scalar(None, TS), pc.cast(pc.add(created_int, pc.divide(lat, 2)), TS)
    )
    attempts = attempts_for(n, retried, seed + 50)
    attempts = pc.if_else(pending, pa.scalar(0, pa.int64()), attempts)
    attempts = pc.if_else(dead, pa.scalar(5, pa.int64()), attempts)
    deliveries = pa.table(
        {
            "id": pc.add(pc.multiply(pc.subtract(d_mid, 1), fanout), pc.add(k, 1)),
            "message_id": d_mid,
            "event": _repeat_each(event, fanout),
            "subscriber": _pick(subscriber_idx, subscribers),
            "seq": _repeat_each(seq, fanout),
            "status": status,
            "attempts": attempts,
            "created_at": d_created,
            "delivered_at": delivered_at,
            "acked_at": acked_at,
            "last_error": pc.if_else(
                pc.and_(retried, pc.or_(acked, dead)), pa.scalar(RETRY_ERROR), pa.scalar("")
            ),
            "queue": _repeat_each(queue, fanout),
            "day": _repeat_each(day, fanout),
            "hour": _repeat_each(hour, fanout),
        }
    )
    return messages, deliveries


def _seq_within(group_idx, groups):
    """1, 2, ... within each group, in row order."""
    out = pa.repeat(pa.scalar(0, pa.int64()), len(group_idx))
    for g in range(groups):
        mask = pc.equal(group_idx, g)
        out = pc.if_else(mask, pc.cumulative_sum(pc.cast(mask, pa.int64())), out)
    return out


FILES = {"hourly": "hour", "daily": "day"}


def write_files(root, messages, deliveries, files="hourly"):
    """Write the tables under root in the archive's layout, one file of each kind per queue and
    hour (`hourly`) or day (`daily`); returns the number of files written per kind."""
    unit = FILES[files]
    written = 0
    for kind, table, schema, id_col in (
        ("messages", messages, MESSAGE_SCHEMA, "id"),
        ("deliveries", deliveries, DELIVERY_SCHEMA, "message_id"),
    ):
        keys = [("queue", "ascending"), (unit, "ascending"), ("id", "ascending")]
        table = table.take(pc.sort_indices(table, sort_keys=keys))
        groups = (
            table.group_by(["queue", unit], use_threads=False)
            .aggregate([(id_col, "min"), (id_col, "max"), ("day", "min"), (id_col, "count")])
            .sort_by([("queue", "ascending"), (unit, "ascending")])
            .to_pylist()
        )
        body = table.select(schema.names).cast(schema)
        offset, written = 0, 0
        for g in groups:
            count = g[f"{id_col}_count"]
            folder = Path(root) / kind / f"queue={g['queue']}" / f"day={g['day_min']}"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"part-{g[f'{id_col}_min']:012d}-{g[f'{id_col}_max']:012d}.parquet"
            pq.write_table(body.slice(offset, count), folder / name)
            offset += count
            written += 1
    return written


def replayed(messages, *, at, since, first_id=REPLAY_ID_BASE, seed=7):
    """The deliveries of a subscription made at `at` with "from" `since` (the API's replay) to
    REPLAYER on REPLAY_QUEUE: one for each of the queue's messages published from `since` to
    `at`, made from `at` on at REPLAY_STEP_US apart (as the server pages through them), acked a
    latency later; filed under their message's day and hour (the archive moves a delivery with
    its message), ids from `first_id`."""
    start_us, at_us = int(since.timestamp() * 1_000_000), int(at.timestamp() * 1_000_000)
    created = pc.cast(messages["created_at"], pa.int64())
    owed = messages.filter(
        pc.and_(
            pc.equal(messages["queue"], REPLAY_QUEUE),
            pc.and_(pc.greater_equal(created, start_us), pc.less(created, at_us)),
        )
    )
    n = owed.num_rows
    made = pc.add(pc.multiply(_seq(n), REPLAY_STEP_US), at_us)
    lat, retried = latency_us(n, seed)
    return pa.table(
        {
            "id": _seq(n, start=first_id),
            "message_id": owed["id"],
            "event": owed["event"],
            "subscriber": pa.repeat(pa.scalar(REPLAYER), n),
            "seq": owed["seq"],
            "status": pa.repeat(pa.scalar("acked"), n),
            "attempts": attempts_for(n, retried, seed + 1),
            "created_at": pc.cast(made, TS),
            "delivered_at": pc.cast(pc.add(made, pc.divide(lat, 2)), TS),
            "acked_at": pc.cast(pc.add(made, lat), TS),
            "last_error": pc.if_else(retried, pa.scalar(RETRY_ERROR), pa.scalar("")),
            "queue": owed["queue"],
            "day": owed["day"],
            "hour": owed["hour"],
        }
    )


def generate_archive(root, deliveries=5_000_000, *, files="hourly", days=DAYS, end=END, seed=1):
    """The issue's archive under root: `deliveries` acked deliveries of deliveries // FANOUT
    messages over `days` days ending at `end`, and a replayed subscription's (replayed at
    REPLAY_AGO before `end`, or halfway through a shorter history, from REPLAY_SPAN before
    that or the history's start). Returns its description."""
    started = time.perf_counter()
    n_messages = deliveries // FANOUT
    start = end - timedelta(days=days)
    messages, dels = history_tables(n_messages, start=start, end=end, seed=seed)
    at = end - min(REPLAY_AGO, (end - start) / 2)  # a short history: halfway through it
    replay = replayed(messages, at=at, since=max(start, at - REPLAY_SPAN))
    dels = pa.concat_tables([dels, replay.cast(dels.schema)])
    per_kind = write_files(root, messages, dels, files)
    return {
        "messages": n_messages,
        "deliveries": len(dels),
        "replayed": {
            "subscriber": REPLAYER,
            "queue": REPLAY_QUEUE,
            "at": at.isoformat(),
            "deliveries": len(replay),
        },
        "files": files,
        "files_per_kind": per_kind,
        "days": days,
        "queues": len(QUEUES),
        "events": len(EVENTS),
        "subscribers": len(SUBSCRIBERS),
        "fanout": FANOUT,
        "end": end.isoformat(),
        "parquet_bytes": sum(f.stat().st_size for f in Path(root).rglob("*.parquet")),
        "generate_s": round(time.perf_counter() - started, 2),
    }


def add_hour(root, *, queue, first_id, n_messages, start=END, seed=99):
    """One new hourly file of each kind for `queue` (the hour from `start`), as the hourly
    archive task adds it; message ids from first_id. Returns (messages, deliveries) added."""
    messages, dels = history_tables(
        n_messages, start=start, end=start + timedelta(hours=1), queues=[queue], first_id=first_id, seed=seed
    )
    write_files(root, messages, dels, "hourly")
    return len(messages), len(dels)


# --- the hot tables -------------------------------------------------------------------------------

HOT_MIX = [("pending", 0.40), ("inflight", 0.10), ("acked", 0.45), ("dead", 0.05)]


def _archived_tail(archive, per_queue):
    """The last `per_queue` archived messages of each queue, and their deliveries (tables)."""
    import pyarrow.dataset as ds

    def read(kind, where=None):
        return ds.dataset(Path(archive) / kind, format="parquet", partitioning="hive").to_table(filter=where)

    messages = read("messages")
    ids = []
    for q in pc.unique(messages["queue"]).to_pylist():
        of_queue = messages.filter(pc.equal(messages["queue"], q))
        top = pc.select_k_unstable(of_queue, per_queue, [("id", "descending")])
        ids += of_queue.take(top)["id"].to_pylist()
    wanted = pa.array(ids, pa.int64())
    return (
        messages.filter(pc.is_in(messages["id"], wanted)),
        read("deliveries", ds.field("message_id").isin(wanted)),
    )


def load_hot(
    archive=None, *, n_messages=HOT_MESSAGES, overlap=OVERLAP_MESSAGES, start=END + timedelta(hours=1)
):
    """Fill the hot tables of the configured database (DATABASE_URL, migrated): the queues,
    events, subscribers and subscriptions, a live hour of n_messages messages, and (with
    `archive`) the overlap. Returns what it inserted."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    import django

    django.setup()
    from django.core.management.color import no_style
    from django.db import connection, transaction

    from delivery.models import Delivery
    from queues.models import Event, Message, Queue
    from subscribers.models import Subscriber, Subscription

    messages, dels = history_tables(
        n_messages,
        start=start,
        end=start + timedelta(hours=1),
        first_id=HOT_ID_BASE,
        status_mix=HOT_MIX,
        seed=7,
    )
    overlap_m = overlap_d = 0
    if archive and overlap:
        old_m, old_d = _archived_tail(archive, overlap)
        # The snapshot saw them before their acks: pending, never handed out.
        old_d = old_d.set_column(
            old_d.schema.get_field_index("status"), "status", pa.repeat(pa.scalar("pending"), len(old_d))
        )
        for col, value in (("acked_at", pa.scalar(None, TS)), ("delivered_at", pa.scalar(None, TS))):
            old_d = old_d.set_column(old_d.schema.get_field_index(col), col, pa.repeat(value, len(old_d)))
        old_d = old_d.set_column(
            old_d.schema.get_field_index("attempts"),
            "attempts",
            pa.repeat(pa.scalar(0, pa.int64()), len(old_d)),
        )
        overlap_m, overlap_d = len(old_m), len(old_d)
        messages = pa.concat_tables(
            [old_m.select(messages.column_names[:-1]), messages.drop_columns(["hour"])]
        )
        dels = pa.concat_tables([old_d.select(dels.column_names[:-1]), dels.drop_columns(["hour"])])

    with transaction.atomic():
        queues = {q.name: q for q in Queue.objects.bulk_create([Queue(name=q) for q in QUEUES])}
        queues = {q.name: q for q in Queue.objects.filter(name__in=QUEUES)}
        Event.objects.bulk_create([Event(queue=queues[q], name=e) for q in QUEUES for e in EVENTS])
        events = {(e.queue.name, e.name): e.id for e in Event.objects.select_related("queue")}
        Subscriber.objects.bulk_create(
            [
                Subscriber(
                    name=s,
                    token_hash=hashlib.sha256(s.encode()).hexdigest(),
                    token_hint="mq_bench",
                    webhook_secret="bench",
                )
                for s in SUBSCRIBERS
            ]
        )
        subscribers = dict(Subscriber.objects.values_list("name", "id"))
        Subscription.objects.bulk_create(
            [Subscription(subscriber_id=subscribers[s], queue=queues[q]) for s in SUBSCRIBERS for q in QUEUES]
        )
        subscriptions = {
            (s, q): i for s, q, i in Subscription.objects.values_list("subscriber__name", "queue__name", "id")
        }
        Message.objects.bulk_create(
            [
                Message(
                    id=m["id"],
                    queue_id=queues[m["queue"]].id,
                    event_id=events[(m["queue"], m["event"])],
                    seq=m["seq"],
                    payload_json=m["payload"],
                    key=m["key"],
                    publisher_id=subscribers.get(m["publisher"]),
                    headers_json=m["headers"],
                    created_at=m["created_at"],
                )
                for m in messages.to_pylist()
            ],
            batch_size=1000,
        )
        Delivery.objects.bulk_create(
            [
                Delivery(
                    id=d["id"],
                    subscription_id=subscriptions[(d["subscriber"], d["queue"])],
                    subscriber_id=subscribers[d["subscriber"]],
                    message_id=d["message_id"],
                    queue_id=queues[d["queue"]].id,
                    event_id=events[(d["queue"], d["event"])],
                    seq=d["seq"],
                    status=d["status"],
                    attempt=d["attempts"],
                    next_attempt_at=d["created_at"],
                    ack_deadline=d["delivered_at"] + timedelta(seconds=30)
                    if d["status"] == "inflight"
                    else None,
                    lease_holder="bench" if d["status"] == "inflight" else "",
                    created_at=d["created_at"],
                    delivered_at=d["delivered_at"],
                    acked_at=d["acked_at"],
                    last_error=d["last_error"],
                )
                for d in dels.to_pylist()
            ],
            batch_size=1000,
        )
        for name, q in queues.items():
            top = max((m["seq"] for m in messages.to_pylist() if m["queue"] == name), default=0)
            Queue.objects.filter(id=q.id).update(last_seq=top)
        # Explicit ids: move PostgreSQL's sequences past them (a no-op on SQLite).
        with connection.cursor() as cursor:
            for sql in connection.ops.sequence_reset_sql(no_style(), [Message, Delivery]):
                cursor.execute(sql)
    # The rows went in through plain INSERTs, so the tally triggers counted them.
    return {
        "messages": len(messages),
        "deliveries": len(dels),
        "overlap_messages": overlap_m,
        "overlap_deliveries": overlap_d,
        "statuses": dict(
            zip(*[c.to_pylist() for c in pc.value_counts(dels["status"]).flatten()], strict=True)
        ),
    }


def dump_hot(out):
    """The hot tables' messages and deliveries, with names, to out/{messages,deliveries}.parquet:
    read through the ORM here, not through analytics.extract, so a check built on them is
    independent of the code it checks."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    import django

    django.setup()
    from delivery.models import Delivery
    from queues.models import Message

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m_cols = ("id", "queue__name", "event__name", "created_at")
    d_cols = (
        "id",
        "message_id",
        "queue__name",
        "event__name",
        "subscriber__name",
        "status",
        "attempt",
        "created_at",
        "acked_at",
    )
    for name, qs, cols, types in (
        (
            "messages",
            Message.objects.values_list(*m_cols),
            m_cols,
            [pa.int64(), pa.string(), pa.string(), TS],
        ),
        (
            "deliveries",
            Delivery.objects.values_list(*d_cols),
            d_cols,
            [pa.int64(), pa.int64(), pa.string(), pa.string(), pa.string(), pa.string(), pa.int64(), TS, TS],
        ),
    ):
        rows = list(qs)
        columns = list(zip(*rows, strict=True)) if rows else [[] for _ in cols]
        names = [c.split("__")[0] for c in cols]
        names = ["attempts" if c == "attempt" else c for c in names]
        pq.write_table(
            pa.table([pa.array(c, t) for c, t in zip(columns, types, strict=True)], names=names),
            out / f"{name}.parquet",
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("archive", help="write a generated archive under DIR")
    a.add_argument("dir")
    a.add_argument("--deliveries", type=int, default=5_000_000)
    a.add_argument("--files", choices=sorted(FILES), default="hourly")
    h = sub.add_parser("hot", help="fill the hot tables of DATABASE_URL (migrated, empty)")
    h.add_argument("--archive", help="the archive, to copy its last messages into the hot tables")
    h.add_argument("--messages", type=int, default=HOT_MESSAGES)
    h.add_argument("--overlap", type=int, default=OVERLAP_MESSAGES, help="archived messages per queue")
    d = sub.add_parser("dump-hot", help="the hot tables' rows to DIR/{messages,deliveries}.parquet")
    d.add_argument("dir")
    args = parser.parse_args()
    if args.command == "archive":
        print(json.dumps(generate_archive(args.dir, args.deliveries, files=args.files)))
    elif args.command == "hot":
        print(json.dumps(load_hot(args.archive, n_messages=args.messages, overlap=args.overlap)))
    else:
        dump_hot(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
