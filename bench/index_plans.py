"""EXPLAIN (ANALYZE, BUFFERS, WAL) of the delivery table's hot statements on the W5 history.

Run against the database bench/growth.py makes (`mqsite_cmp_growth`, 10 million deliveries):

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_cmp_growth \
        .venv/bin/python bench/index_plans.py [--out FILE]

Each operation runs on the queue `history` (a million messages, ten subscribers, 90 % of their
deliveries acked, 10 % pending) inside a transaction that is rolled back, so the database is
the same before and after and two schemas can be compared on the same rows: a lease of 100, an
ack of those 100, the sweeper's expiry of 1,000 overdue leases, a fan-out of 100 messages to
the ten subscriptions, an idle recheck, and the webhook sweep's due query. Prints one JSON line
per statement (time, buffers, WAL records and bytes, the indexes named) and writes the plans
to FILE.
"""

import argparse
import json
import os
import re
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

from django.conf import settings  # noqa: E402

settings.DATABASES["default"].get("OPTIONS", {}).pop("pool", None)

import django  # noqa: E402

django.setup()

from django.db import connection, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from delivery import ledger, publishing, tasks  # noqa: E402
from queues.models import Queue  # noqa: E402

PAYLOAD = {"i": 1, "host": "bench-01.example.net", "path": "/srv/bench/00000001.dat", "pad": "x" * 120}
DML = ("SELECT", "UPDATE", "INSERT", "DELETE", "WITH")


class _Rollback(Exception):
    pass


def run(setup, measured):
    """Run setup() then measured() in a transaction that is rolled back; return the SQL of each."""
    out = {}
    try:
        with transaction.atomic():
            for name, fn in (("setup", setup), ("measured", measured)):
                with CaptureQueriesContext(connection) as q:
                    fn()
                out[name] = [x["sql"] for x in q.captured_queries]
            raise _Rollback
    except _Rollback:
        return out["setup"], out["measured"]


def explain(setup_sql, measured_sql):
    """Replay the setup's statements, then EXPLAIN ANALYZE the measured ones, all rolled back."""
    plans = []
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for sql in setup_sql:
                if sql.lstrip().split(None, 1)[0].upper() in DML:
                    cursor.execute(sql)
            for sql in measured_sql:
                if sql.lstrip().split(None, 1)[0].upper() not in DML:
                    continue
                cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, WAL) {sql}")
                plans.append((sql, "\n".join(r[0] for r in cursor.fetchall())))
            raise _Rollback
    except _Rollback:
        return plans


def summary(plan):
    """The top node's totals: execution ms, shared buffers, WAL records and bytes, indexes used."""
    top = plan.split("\n")

    def first(pattern, default=0):
        for line in top:
            m = re.search(pattern, line)
            if m:
                return m.groups()
        return default

    hit, read, dirtied = (
        int(first(rf"Buffers: shared .*?{k}=(\d+)", ("0",))[0]) for k in ("hit", "read", "dirtied")
    )
    records, wal_bytes = (int(x) for x in first(r"WAL: records=(\d+)(?: fpi=\d+)? bytes=(\d+)", ("0", "0")))
    return {
        "ms": float(first(r"Execution Time: ([\d.]+)", ("0",))[0]),
        "buffers": hit + read,
        "dirtied": dirtied,
        "wal_records": records,
        "wal_bytes": wal_bytes,
        "indexes": sorted(set(re.findall(r"[Ii]ndex (?:Only )?Scan (?:Backward )?(?:using|on) (\w+)", plan))),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the plans here")
    args = parser.parse_args()
    history = Queue.objects.get(name="history")
    subscription = history.subscriptions.select_related("subscriber").order_by("id").first()
    hist = subscription.subscriber
    now = timezone.now()
    past = now - timedelta(hours=1)
    leased = {}

    def lease_100():
        leased["ids"] = [d["id"] for d in ledger.lease_deliveries(hist, limit=100, holder="bench!plans")]

    def overdue_1000():
        ledger.lease_deliveries(hist, limit=1000, holder="bench!old", now=past)

    runs = {
        "lease_100": (lambda: None, lease_100),
        "ack_100": (lease_100, lambda: ledger.ack_deliveries(hist, leased["ids"])),
        "nack_100": (lease_100, lambda: ledger.nack_deliveries(hist, leased["ids"], retry_in=60)),
        "expire_1000": (overdue_1000, lambda: ledger.expire_overdue_leases(now)),
        "fan_out_100": (
            lambda: None,
            lambda: publishing.publish(history, [publishing.prepare("create", PAYLOAD)] * 100),
        ),
        "idle_recheck": (lambda: None, lambda: ledger.subscribers_with_work([hist.pk], now)),
        "release_held_100": (lease_100, lambda: ledger.release_held(["bench!plans"])),
        "webhook_sweep_due": (lambda: None, lambda: tasks.next_due_at(hist.pk, now)),
    }
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM delivery_delivery")
        rows = cursor.fetchone()[0]
    lines = [
        f"EXPLAIN (ANALYZE, BUFFERS, WAL) on {rows:,} delivery rows, {now.isoformat(timespec='seconds')}\n"
    ]
    for name, (setup, measured) in runs.items():
        setup_sql, measured_sql = run(setup, measured)
        for k, (sql, plan) in enumerate(explain(setup_sql, measured_sql)):
            print(json.dumps({"op": name, "statement": k + 1, **summary(plan)}), flush=True)
            lines.append(f"\n===== {name} #{k + 1}\n{sql}\n\n{plan}\n")
    if args.out:
        Path(args.out).write_text("".join(lines))


if __name__ == "__main__":
    main()
