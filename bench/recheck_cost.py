"""What one pass of the receipts' recheck (delivery.receipts.recheck) costs with N receipts
awaited in a process, on the database at DATABASE_URL (a scratch PostgreSQL one: it is migrated
and filled with generate_series).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_recheck \\
        .venv/bin/python bench/recheck_cost.py [--most 640000]

N awaited messages, each with one receipt delivery, one in a hundred settled. Two passes:

- full: the one set query of settled_statement over the N ids (what every pass was before the
  log of moves; now only every FULL_RECHECK_SECS);
- incremental: k of them moved since the last pass (k ReceiptMove rows, as the ledger logs
  them): the range read of the log after the watermark, then settled_statement over the k.

N = 10,000 is what one subscriber may have awaited in a process (MQ_MAX_RECEIPTS_PER_SUBSCRIBER);
640,000 what it could before (10,000 per socket on 64 sockets).
"""

import argparse
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

from delivery import receipts, subscribing  # noqa: E402
from delivery.models import ReceiptMove  # noqa: E402
from mqsite import adb  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402


def fill(most):
    call_command("migrate", verbosity=0)
    Queue.objects.filter(name="bench-recheck").delete()
    Subscriber.objects.filter(name="bench-recheck").delete()
    queue = Queue.objects.create(name="bench-recheck", last_seq=most)
    subscriber, _ = create_subscriber("bench-recheck", publish=["bench-recheck"], subscribe=["bench-recheck"])
    subscription, _ = subscribing.subscribe(subscriber, queue)
    event = queue.events.create(name="create")
    with connection.cursor() as c:
        c.execute(
            "INSERT INTO queues_message (queue_id, event_id, seq, payload_json, publisher_id, created_at,"
            " receipt_wanted) SELECT %s, %s, n, '1', %s, now(), true FROM generate_series(1, %s) n",
            [queue.pk, event.pk, subscriber.pk, most],
        )
        c.execute(
            "INSERT INTO delivery_delivery (subscription_id, subscriber_id, message_id, queue_id,"
            " event_id, seq, status, attempt, next_attempt_at, lease_holder, created_at, last_error,"
            " receipt) SELECT %s, %s, m.id, m.queue_id, m.event_id, m.seq,"
            " CASE WHEN m.seq %% 100 = 0 THEN 'acked' ELSE 'pending' END, 0, now(), '', now(), '', true"
            " FROM queues_message m WHERE m.queue_id = %s",
            [subscription.pk, subscriber.pk, queue.pk],
        )
        c.execute("ANALYZE queues_message")
        c.execute("ANALYZE delivery_delivery")
        c.execute("SELECT id FROM queues_message WHERE queue_id = %s ORDER BY seq", [queue.pk])
        return queue, subscriber, [row[0] for row in c.fetchall()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--most", type=int, default=640_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    queue, subscriber, ids = fill(args.most)
    print(f"{connection.vendor}: one recheck pass, median of {args.rounds}")
    for n in (1_000, 10_000, 100_000, args.most):
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            settled = adb.run_sync(receipts.settled_statement(ids[:n]))
            times.append((time.perf_counter() - started) * 1000)
        print(
            f"  full pass, N = {n:>7,} awaited: {statistics.median(times):8.2f} ms, {len(settled):,} settled"
        )
    awaited = set(ids)
    for k in (1, 10, 100, 1_000):
        changed = ids[99::100][:k]  # settled ones (seq % 100 == 0)
        times = []
        for _ in range(args.rounds):
            ReceiptMove.objects.all().delete()
            after = adb.run_sync(receipts.last_move_statement())
            adb.run_sync(receipts.moved_statement(changed))
            started = time.perf_counter()
            rows = adb.run_sync(receipts.moves_statement(after, []))
            probe = sorted(awaited & {message_id for _, message_id in rows})
            settled = adb.run_sync(receipts.settled_statement(probe))
            times.append((time.perf_counter() - started) * 1000)
        print(
            f"  incremental, k = {k:>5,} changed of {len(ids):,} awaited: "
            f"{statistics.median(times):8.2f} ms, {len(settled):,} settled"
        )
    ReceiptMove.objects.all().delete()
    queue.delete()
    subscriber.delete()


if __name__ == "__main__":
    main()
