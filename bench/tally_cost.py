"""What the kept counts (delivery.tallies: triggers appending to delivery_tallychange) cost the
hot path, on the database at DATABASE_URL (a scratch one: it is migrated and filled).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_tally \
        .venv/bin/python bench/tally_cost.py [--rounds 300]

Rounds alternate between the triggers enabled and disabled (ALTER TABLE ... DISABLE TRIGGER),
so both sides see the same machine load; each round times, through the ledger's own functions:
a publish of one message fanned out to 10 subscriptions, a publish of a batch of 100 (1,000
deliveries), a lease of 10 by one subscriber, and the ack of those 10 one at a time and all at
once. Medians in ms. The folds run between rounds, as the sweep's would.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from delivery import ledger, publishing, subscribing, tallies  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

SUBSCRIBERS = 10
TRIGGERS = {
    "delivery_delivery": ["delivery_tally_insert", "delivery_tally_update", "delivery_tally_delete"],
    "queues_message": ["message_tally_insert", "message_tally_delete"],
}


def setup():
    call_command("migrate", verbosity=0)
    Queue.objects.filter(name="bench-tally").delete()
    Subscriber.objects.filter(name__startswith="bench-t-").delete()
    queue = Queue.objects.create(name="bench-tally")
    subs = []
    for i in range(SUBSCRIBERS):
        s, _ = create_subscriber(f"bench-t-{i}", publish=["bench-tally"], subscribe=["bench-tally"])
        subscribing.subscribe(s, queue)
        subs.append(s)
    return queue, subs


def triggers(on):
    with connection.cursor() as cursor:
        for table, names in TRIGGERS.items():
            for name in names:
                cursor.execute(f"ALTER TABLE {table} {'ENABLE' if on else 'DISABLE'} TRIGGER {name}")


def timed(fn):
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def one_round(queue, subs, times):
    one = [publishing.prepare("e", {"n": 1})]
    batch = [publishing.prepare("e", {"n": i}) for i in range(100)]
    times["publish 1 (10 deliveries)"].append(timed(lambda: publishing.publish(queue, one, subs[0])))
    times["publish 100 (1,000 deliveries)"].append(timed(lambda: publishing.publish(queue, batch, subs[0])))
    leased = []
    times["lease 10"].append(timed(lambda: leased.extend(ledger.lease_deliveries(subs[1], limit=10))))
    ids = [d["id"] for d in leased]
    started = time.perf_counter()
    for i in ids[:5]:
        ledger.ack_deliveries(subs[1], [i])
    times["ack 1"].append((time.perf_counter() - started) * 1000 / 5)
    times["ack 5 at once"].append(timed(lambda: ledger.ack_deliveries(subs[1], ids[5:])))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        sys.exit("run it on PostgreSQL (DATABASE_URL): SQLite's triggers are row-level and another matter")
    queue, subs = setup()
    names = (
        "publish 1 (10 deliveries)",
        "publish 100 (1,000 deliveries)",
        "lease 10",
        "ack 1",
        "ack 5 at once",
    )
    results = {True: {name: [] for name in names}, False: {name: [] for name in names}}
    try:
        for i in range(args.rounds):
            on = i % 2 == 0
            triggers(on)
            one_round(queue, subs, results[on])
            tallies.fold()
    finally:
        triggers(True)
    table = {
        name: {
            "without_ms": round(statistics.median(results[False][name]), 3),
            "with_ms": round(statistics.median(results[True][name]), 3),
        }
        for name in results[True]
    }
    print(f"{'operation':34} {'without':>9} {'with':>9} {'ratio':>7}")
    for name, row in table.items():
        ratio = row["with_ms"] / row["without_ms"]
        print(f"{name:34} {row['without_ms']:9.3f} {row['with_ms']:9.3f} {ratio:7.3f}")
    print(json.dumps({"rounds": args.rounds, "medians": table}))


if __name__ == "__main__":
    main()
