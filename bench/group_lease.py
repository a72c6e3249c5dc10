"""The ordered lease with message groups (issue 29): one subscription of an ordered queue with
a backlog of ROWS pending deliveries, in 1 group or in 10,000; the time of a lease of a window
of heads (ledger.lease_deliveries, what a socket and GET /api/deliveries call), and the plan of
its statement (EXPLAIN ANALYZE). The requirement: 10,000 groups lease as fast as one, since the
heads are found by an index (delivery_heads), not by scanning the backlog.

    python bench/group_lease.py [--rows 1000000] [--groups 1 10000] [--window 1 10 100]
                                [--leases 300] [--keep]

PostgreSQL only (the services mode). Each case gets its own database, migrated by the tree's
manage.py, filled by SQL (the messages) and the ledger's own fan-out (the deliveries, a chunk
per statement), then VACUUM ANALYZE. Each lease is given back (ledger.release_held) before the
next, so every lease sees the same backlog (and a VACUUM every 50 leases clears the
versions that leaves behind, as autovacuum would). Runs on a tree without groups too (the messages
then name none): the one-group case before and after, on the same machine.

Prints one JSON object: per case, the lease's median and p95 in ms per window size (the whole
sync call: its read, the statement's planning and execution), the statement's execution alone
(EXPLAIN ANALYZE, rolled back), and the plan of the lease statement for the largest window.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
PG_SERVER = os.environ.get("BENCH_PG_SERVER", "postgres://postgres@127.0.0.1:5432")
CHUNK = 100_000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 10_000])
    parser.add_argument("--window", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--leases", type=int, default=300)
    parser.add_argument("--keep", action="store_true", help="keep the databases (reused next run)")
    args = parser.parse_args()
    results = {"rows": args.rows, "git": _git("rev-parse", "--short", "HEAD"), "cases": {}}
    for groups in args.groups:
        db = f"mq_bench_group_lease_{args.rows}_{groups}"
        env = {**os.environ, "DATABASE_URL": f"{PG_SERVER}/{db}", "MQ_ASYNC_DB": "false"}
        fresh = _create(db, args.keep)
        if fresh:
            subprocess.run(
                [sys.executable, "manage.py", "migrate", "--noinput"],
                cwd=ROOT,
                env=env,
                check=True,
                capture_output=True,
            )
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--case",
                json.dumps([args.rows, groups, args.window, args.leases, fresh]),
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        results["cases"][f"{groups} group{'s' if groups > 1 else ''}"] = json.loads(out.stdout)
        if not args.keep:
            _drop(db)
    print(json.dumps(results, indent=2))


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _server():
    return psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True)


def _create(db, keep):
    with _server() as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone():
            if keep:
                return False
            conn.execute(f'DROP DATABASE "{db}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db}"')
    return True


def _drop(db):
    with _server() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


# --- one case, in a process of its own (Django set up on its database) ---------------------------


def case(rows, groups, windows, leases, fresh):
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    import django

    django.setup()
    from django.db import connection
    from django.utils import timezone

    from delivery import ledger, subscribing
    from queues.models import Event, Message, Queue
    from subscribers.models import Subscriber
    from subscribers.provisioning import create_subscriber

    grouped = any(f.name == "group" for f in Message._meta.fields)
    if fresh:
        queue = Queue.objects.create(name="line", ordered=True)
        event = Event.objects.create(queue=queue, name="e")
        subscriber, _ = create_subscriber("worker", publish=["*"], subscribe=["*"])
        subscribing.subscribe(subscriber, queue)
        started = time.monotonic()
        with connection.cursor() as cursor:
            # Groups in turn (message i in group i mod groups): each group's head is near the
            # front, and behind it a long line; one group: no group named (the default one).
            grp = ", CASE WHEN %s > 1 THEN 'g' || (i %% %s) END" if grouped else ""
            cursor.execute(
                f"""INSERT INTO queues_message (queue_id, event_id, seq, payload_json, created_at,
                        receipt_wanted{", grp" if grouped else ""})
                    SELECT %s, %s, i, '{{"n":1}}', now(), false{grp} FROM generate_series(1, %s) i""",
                [queue.pk, event.pk, *([groups, groups] if grouped else []), rows],
            )
            cursor.execute("UPDATE queues_queue SET last_seq = %s WHERE id = %s", [rows, queue.pk])
        now = timezone.now()
        for first in range(1, rows + 1, CHUNK):
            last = min(rows, first + CHUNK - 1)
            if grouped:
                ledger.fan_out(queue.pk, first, last, now, ordered=True)
            else:
                ledger.fan_out(queue.pk, first, last, now)
        build_s = time.monotonic() - started
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE")
    else:
        build_s = None
    queue = Queue.objects.get(name="line")
    subscriber = Subscriber.objects.get(name="worker")
    subscription_id = subscriber.subscriptions.get().pk
    out = {"build_s": build_s and round(build_s, 1), "lease_ms": {}}
    for window in windows:
        times, got = [], 0
        for n in range(leases):
            if n % 50 == 0:  # what autovacuum does meanwhile: the given-back versions are dead
                with connection.cursor() as cursor:
                    cursor.execute("VACUUM delivery_delivery")
            t = time.perf_counter()
            leased = ledger.lease_deliveries(subscriber, limit=window, queue=queue, holder="bench")
            times.append((time.perf_counter() - t) * 1000)
            got = len(leased)
            ledger.release_held(["bench"], wake=False)
        times.sort()
        out["lease_ms"][str(window)] = {
            "median": round(statistics.median(times), 3),
            "p95": round(times[int(len(times) * 0.95) - 1], 3),
            "leased": got,
        }
    # The statement alone, planned apart (the sync path plans each call, 2 to 4 ms here; the
    # socket's async pool prepares it once per connection): EXPLAIN ANALYZE's execution time,
    # rolled back, so no churn either.
    out["statement_exec_ms"] = {}
    for window in windows:
        runs = [
            _plan(ledger, connection, subscriber, subscription_id, window, timezone.now()) for _ in range(50)
        ]
        execs = sorted(
            float(line.split()[-2]) for plan in runs for line in plan if line.startswith("Execution Time")
        )
        out["statement_exec_ms"][str(window)] = {
            "median": round(statistics.median(execs), 3),
            "p95": execs[46],
        }
    out["plan"] = _plan(ledger, connection, subscriber, subscription_id, max(windows), timezone.now())
    print(json.dumps(out))


def _plan(ledger, connection, subscriber, subscription_id, window, now):
    """EXPLAIN (ANALYZE, BUFFERS) of the ordered lease's statement, rolled back."""
    from django.db import transaction

    try:
        op = ledger._lease_head_statement(subscriber.pk, subscription_id, None, "bench", now, False, window)
    except TypeError:  # a tree without groups: one head per statement
        op = ledger._lease_head_statement(subscriber.pk, subscription_id, None, "bench", now, False)
    sql, params = next(op)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}", params)
        plan = [row[0] for row in cursor.fetchall()]
        transaction.set_rollback(True)
    return plan


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        case(*json.loads(sys.argv[2]))
    else:
        main()
