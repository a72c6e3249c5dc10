"""The analytics' extract of the hot tables, before and after issue 19: extract_recent() (the
ORM, row by row, payloads included, into the archive's Hive layout) against hot_snapshot() +
write_snapshot() (the analytics columns only, COPY to Arrow, two Parquet files).

    .venv/bin/python bench/extract_snapshot.py [--db mqsite_extract_bench] [--repeat 3]
        [--only old,csv,binary,csv-one-line]

PostgreSQL only (127.0.0.1:5432, user postgres). The database is made once (about a minute)
with INSERT ... SELECT generate_series into the app's own tables after `migrate`, and kept: a
later run only migrates it. 200,000 messages in two queues (four events) with payloads of
about 500 bytes, fanned out to five subscribers: 1,000,000 deliveries, 97 % acked, 1 % each
pending, in flight and dead. Triggers are off during the load (session_replication_role =
replica): the kept counts are not needed here, so `recounttallies` is not run.

Each variant runs --repeat times, each in a fresh process (so that its peak memory is its
own), into a fresh folder; the table gives the median and best wall time, the CPU time (user +
system of the process; PostgreSQL's own is not in it) and the peak RSS:

    old           analytics.extract_recent(root)
    csv           hot_snapshot() (COPY ... CSV, pyarrow.csv) + write_snapshot(): what ships
    binary        the same SELECTs as binary COPY, rows parsed by psycopg, columns to Arrow
    csv-one-line  csv with pyarrow told no value holds a line break (its faster splitter):
                  what supporting a subscriber name with a newline costs

With --check, it first compares, column for column, what each variant reads with what
extract_recent() wrote (the files' columns that the snapshot keeps, the queue from the folder
names), and says whether all agree.

The machine is shared: say `uptime`'s load beside the numbers.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import psycopg

ROOT = Path(__file__).resolve().parent.parent
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
MESSAGES = 200_000
SUBSCRIBERS = 5
QUEUES = [("orders", ["created", "paid"]), ("audit", ["login", "logout"])]
PAYLOAD_BYTES = 500
VARIANTS = ["old", "csv", "binary", "csv-one-line"]


def ensure_history(db):
    """The database `db` with the history, made if missing. Returns its URL."""
    url = f"{PG_SERVER}/{db}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone():
            conn.execute(f"CREATE DATABASE {db}")
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url},
        check=True,
    )
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM queues_queue WHERE name = 'orders'").fetchone():
            return url
        started = time.monotonic()
        conn.execute("SET session_replication_role = replica")
        conn.execute("SET maintenance_work_mem = '512MB'")
        with conn.transaction():  # all or nothing: a half-made history would be kept as made
            _insert(conn)
        for table in ("queues_message", "delivery_delivery"):
            conn.execute(f"VACUUM ANALYZE {table}")
    print(f"made {db} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return url


def _insert(conn):
    per_queue = MESSAGES // len(QUEUES)
    for name, events in QUEUES:
        queue_id, event_ids = harness.insert_queue(conn, name, events, last_seq=per_queue)
        # Over the last two days, microseconds and all; the payload about PAYLOAD_BYTES of JSON.
        conn.execute(
            """
            INSERT INTO queues_message (queue_id, event_id, seq, payload_json, headers_json, key,
                                        publisher_id, created_at, receipt_wanted)
            SELECT %(q)s, (%(events)s::bigint[])[1 + g %% %(n_events)s], g,
                   '{"i":' || g || ',"pad":"' || repeat('x', %(pad)s) || '"}',
                   NULL, NULL, NULL,
                   now() - interval '2 days' + g * interval '800 ms' + (g %% 997) * interval '1 us',
                   false
            FROM generate_series(1, %(n)s) g
            """,
            {
                "q": queue_id,
                "events": event_ids,
                "n_events": len(event_ids),
                "n": per_queue,
                "pad": PAYLOAD_BYTES - 20,
            },
        )
    conn.execute(
        """
        INSERT INTO subscribers_subscriber (name, token_hash, token_hint, webhook_url, webhook_secret,
                                            publish_all, subscribe_all, is_active, created_at)
        SELECT 'reader-' || k, encode(sha256(('reader-' || k)::bytea), 'hex'), 'mq_rd' || k, '',
               md5(k::text), false, true, true, now() - interval '3 days'
        FROM generate_series(1, %s) k
        """,
        [SUBSCRIBERS],
    )
    conn.execute(
        "INSERT INTO subscribers_subscription (subscriber_id, queue_id, event_id, created_at)"
        " SELECT s.id, q.id, NULL, now() - interval '3 days'"
        " FROM subscribers_subscriber s CROSS JOIN queues_queue q ORDER BY s.id, q.id"
    )
    # Of each hundred seqs one pending, one in flight and one dead; the rest acked 1 to 900 ms
    # after publish.
    conn.execute(
        """
        INSERT INTO delivery_delivery
            (subscription_id, subscriber_id, message_id, queue_id, event_id, seq, status, attempt,
             next_attempt_at, ack_deadline, lease_holder, created_at, delivered_at, acked_at,
             last_error, receipt)
        SELECT s.id, s.subscriber_id, m.id, m.queue_id, m.event_id, m.seq,
               CASE m.seq % 100 WHEN 0 THEN 'dead' WHEN 1 THEN 'inflight' WHEN 2 THEN 'pending'
                    ELSE 'acked' END,
               CASE m.seq % 100 WHEN 0 THEN 10 WHEN 2 THEN 0 ELSE 1 END,
               m.created_at,
               CASE WHEN m.seq % 100 = 1 THEN now() + interval '1 day' END,
               '', m.created_at,
               CASE WHEN m.seq % 100 <> 2 THEN m.created_at + interval '1 ms' END,
               CASE WHEN m.seq % 100 > 2 THEN m.created_at + (1 + m.seq % 900) * interval '1 ms' END,
               CASE WHEN m.seq % 100 = 0 THEN 'HTTP 500 from the webhook' ELSE '' END,
               false
        FROM queues_message m JOIN subscribers_subscription s ON s.queue_id = m.queue_id
        ORDER BY m.queue_id, m.seq, s.id
        """
    )


def run_variant(variant, root):
    """In this process: one extract; prints its timings and counts as JSON."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    import django

    django.setup()
    from django.db import connection

    from analytics import extract

    connection.ensure_connection()
    before = os.times()
    started = time.perf_counter()
    result = {}
    if variant == "old":
        result["rows"] = extract_recent(root)
    else:
        if variant == "binary":
            extract._read_copy = _read_binary_copy
        elif variant == "csv-one-line":
            import pyarrow.csv as pacsv

            extract._CSV_PARSE = pacsv.ParseOptions(newlines_in_values=False)
        snapshot = extract.hot_snapshot()
        result["snapshot_secs"] = time.perf_counter() - started
        extract.write_snapshot(root, snapshot)
        result["rows"] = {"messages": snapshot.messages.num_rows, "deliveries": snapshot.deliveries.num_rows}
    result["wall_secs"] = time.perf_counter() - started
    after = os.times()
    result["cpu_secs"] = (after.user - before.user) + (after.system - before.system)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["bytes"] = sum(f.stat().st_size for f in Path(root).rglob("*.parquet"))
    print(json.dumps(result))


def check(url):
    """Every variant's snapshot equals the old extract's rows, projected; prints the verdict."""
    os.environ["DATABASE_URL"] = url
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    import django

    django.setup()
    import pyarrow.csv as pacsv
    import pyarrow.dataset as ds

    from analytics import extract, layout

    root = tempfile.mkdtemp(prefix="extract-check-")
    try:
        extract_recent(root)
        old = {}
        kinds = (("messages", layout.HOT_MESSAGE_SCHEMA), ("deliveries", layout.HOT_DELIVERY_SCHEMA))
        for kind, schema in kinds:
            table = ds.dataset(f"{root}/{kind}", format="parquet", partitioning="hive").to_table()
            old[kind] = table.select(schema.names).cast(schema).sort_by("id")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    csv_read, csv_parse = extract._read_copy, extract._CSV_PARSE
    for variant in ("csv", "binary", "csv-one-line"):
        extract._read_copy = _read_binary_copy if variant == "binary" else csv_read
        one_line = pacsv.ParseOptions(newlines_in_values=False)
        extract._CSV_PARSE = one_line if variant == "csv-one-line" else csv_parse
        snapshot = extract.hot_snapshot()
        for kind, table in (("messages", snapshot.messages), ("deliveries", snapshot.deliveries)):
            same = table.sort_by("id").equals(old[kind])
            verdict = "same as" if same else "DIFFERENT FROM"
            print(f"check {variant} {kind}: {table.num_rows} rows, {verdict} old")
    extract._read_copy, extract._CSV_PARSE = csv_read, csv_parse


def _read_binary_copy(cursor, select, schema):
    """The alternative to CSV: binary COPY, each row parsed by psycopg into a tuple (C code),
    a chunk of rows at a time into Arrow arrays."""
    import pyarrow as pa

    from analytics import extract

    sql, params = select
    pg_types = {
        pa.int64(): "int8",
        pa.string(): "text",
        pa.timestamp("us", tz="UTC"): "timestamptz",
    }
    # attempts is an integer column, the rest as named
    types = [pg_types[field.type] for field in schema]
    if "attempts" in schema.names:
        types[schema.names.index("attempts")] = "int4"
    batches = []
    with cursor.cursor.copy(f"COPY ({sql}) TO STDOUT (FORMAT binary)", params or None) as copy:
        copy.set_types(types)
        rows = []
        for row in copy.rows():
            rows.append(row)
            if len(rows) == extract.CHUNK_ROWS:
                batches.append(_batch(rows, schema))
                rows = []
        if rows:
            batches.append(_batch(rows, schema))
    return pa.Table.from_batches(batches, schema=schema)


def _batch(rows, schema):
    import pyarrow as pa

    columns = zip(*rows, strict=True)
    arrays = [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)]
    return pa.record_batch(arrays, schema=schema)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="mqsite_extract_bench")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--check", action="store_true", help="compare with the old's rows first")
    parser.add_argument("--run", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a child
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check_only:
        check(f"{PG_SERVER}/{args.db}")
        return
    if args.run:
        run_variant(args.run, args.root)
        return
    url = ensure_history(args.db)
    if args.check:
        subprocess.run([sys.executable, __file__, "--db", args.db, "--check-only"], cwd=ROOT, check=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"{'variant':<13} {'median s':>9} {'best s':>7} {'snapshot s':>10} {'cpu s':>6} {'peak MB':>8}"
          f" {'files MB':>8}  rows")  # fmt: skip
    for variant in args.only.split(","):
        runs = []
        for _ in range(args.repeat):
            root = tempfile.mkdtemp(prefix=f"extract-{variant}-")
            try:
                out = subprocess.run(
                    [sys.executable, __file__, "--run", variant, "--root", root],
                    cwd=ROOT,
                    env={**os.environ, "DATABASE_URL": url},
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs.append(json.loads(out.strip().splitlines()[-1]))
        walls = [r["wall_secs"] for r in runs]
        snap = statistics.median(r.get("snapshot_secs", float("nan")) for r in runs)
        print(
            f"{variant:<13} {statistics.median(walls):>9.2f} {min(walls):>7.2f} {snap:>10.2f}"
            f" {statistics.median(r['cpu_secs'] for r in runs):>6.2f}"
            f" {max(r['peak_rss_mb'] for r in runs):>8.0f} {runs[0]['bytes'] / 1e6:>8.1f}  {runs[0]['rows']}"
        )
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()


# --- the extract before issue 19, the baseline measured above (analytics/extract.py at cb70f79) ---

CHUNK_MESSAGES = 20_000


def extract_recent(root, *, chunk=CHUNK_MESSAGES):
    """Write every message and delivery now in the hot tables under `root`; returns
    {"messages": n, "deliveries": n} written."""
    from django.db.models import Max

    from analytics import layout
    from analytics.archive import DELIVERY_FIELDS, MESSAGE_FIELDS
    from delivery.models import Delivery
    from queues.models import Message, Queue

    counts = {"messages": 0, "deliveries": 0}
    # Messages published after this are left to the next run, with their deliveries.
    top = Message.objects.aggregate(top=Max("id"))["top"] or 0
    for queue in Queue.objects.order_by("name"):
        after = 0
        while True:
            messages = list(
                Message.objects.filter(queue=queue, id__gt=after, id__lte=top)
                .order_by("id")
                .values_list(*MESSAGE_FIELDS)[:chunk]
            )
            if not messages:
                break
            first, last = messages[0][0], messages[-1][0]
            present = {m[0] for m in messages}
            deliveries = [
                d
                for d in Delivery.objects.filter(queue=queue, message_id__gte=first, message_id__lte=last)
                .order_by("id")
                .values_list(*DELIVERY_FIELDS)
                # Only deliveries of messages read above: one committed in between (ids are
                # taken before commit) is left whole to the next run.
                if d[1] in present
            ]
            layout.write_history(root, queue.name, messages, deliveries, durable=False)
            counts["messages"] += len(messages)
            counts["deliveries"] += len(deliveries)
            after = last
    return counts
