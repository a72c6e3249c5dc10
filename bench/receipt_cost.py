"""What receipts (delivery.receipts) cost the ack and the publish, on the database at
DATABASE_URL (a scratch one: it is migrated and filled).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_receipts \
        .venv/bin/python bench/receipt_cost.py [--rounds 300]

- the ack of clients without receipts: the ack UPDATE as it was (RETURNING id) against the one
  it is now (RETURNING id and a CASE on the row's own receipt column), alternated, batches of 1
  and 100 deliveries of 100 subscribers;
- the same acks with receipts: the UPDATE plus the check after its commit;
- the publish (fan-out of one message to 100 subscriptions) without and with a receipt;
- the ledger's own ack (ledger.ack_deliveries, one delivery), without and with a receipt: with,
  it also logs the move (ReceiptMove, the INSERT the sockets' recheck reads) and checks after.
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
from django.utils import timezone  # noqa: E402

from delivery import ledger, publishing, receipts, subscribing  # noqa: E402
from delivery.models import Delivery, Status  # noqa: E402
from mqsite import adb  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

SUBSCRIBERS = 100
OLD_RETURNING = "RETURNING id"
NEW_RETURNING = "RETURNING id, CASE WHEN receipt THEN message_id END"


def setup():
    call_command("migrate", verbosity=0)
    Queue.objects.filter(name="bench-receipts").delete()
    Subscriber.objects.filter(name__startswith="bench-r-").delete()
    queue = Queue.objects.create(name="bench-receipts")
    subs = []
    for i in range(SUBSCRIBERS):
        s, _ = create_subscriber(f"bench-r-{i}", publish=["bench-receipts"], subscribe=["bench-receipts"])
        subscribing.subscribe(s, queue)
        subs.append(s)
    return queue, subs


def ack_statement(ids, returning):
    table = Delivery._meta.db_table
    return (
        f"UPDATE {table} SET status = %s, acked_at = %s, ack_deadline = NULL, lease_holder = ''"
        f" WHERE id IN ({', '.join(['%s'] * len(ids))}) AND status <> %s {returning}",
        [Status.ACKED, connection.ops.adapt_datetimefield_value(timezone.now()), *ids, Status.ACKED],
    )


def _once(sql, params):
    """One statement as the ledger runs it (its rows all fetched: SQLite finishes an UPDATE ...
    RETURNING only as they are read)."""
    return (yield sql, params)


def _ack(statement):
    return adb.run_sync(_once(*statement))


def _ack_and_check(statement):
    """The ack with receipts: the UPDATE, then the check after its commit."""
    messages = {row[1] for row in _ack(statement) if row[1] is not None}
    adb.run_sync(receipts.settled_statement(messages))


def timed(fn, *args):
    started = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - started) * 1000


def reopen(ids):
    Delivery.objects.filter(id__in=ids).update(status=Status.INFLIGHT, acked_at=None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=300)
    rounds = parser.parse_args().rounds
    queue, _ = setup()
    plain = [publishing.prepare("create", i) for i in range(100)]
    wanted = [publishing.Outgoing(o.event, o.payload_json, None, receipt=True) for o in plain]
    publishing.publish(queue, plain)
    publishing.publish(queue, wanted)
    ids_plain = list(
        Delivery.objects.filter(queue=queue, receipt=False).order_by("id").values_list("id", flat=True)
    )
    ids_wanted = list(
        Delivery.objects.filter(queue=queue, receipt=True).order_by("id").values_list("id", flat=True)
    )
    times = {}
    for batch in (1, 100):
        for r in range(rounds):
            ids = ids_plain[(r * batch) % len(ids_plain) :][:batch]
            for name, returning in (("old", OLD_RETURNING), ("new", NEW_RETURNING)):
                reopen(ids)
                times.setdefault((name, batch), []).append(timed(_ack, ack_statement(ids, returning)))
            ids = ids_wanted[(r * batch) % len(ids_wanted) :][:batch]
            reopen(ids)
            statement = ack_statement(ids, NEW_RETURNING)
            times.setdefault(("receipt", batch), []).append(timed(_ack_and_check, statement))
    owner = dict(Delivery.objects.filter(queue=queue).values_list("id", "subscriber_id"))
    for r in range(rounds):
        for name, ids in (("ledger ack plain", ids_plain), ("ledger ack receipt", ids_wanted)):
            d = ids[r % len(ids)]
            reopen([d])
            subscriber = Subscriber(pk=owner[d])
            times.setdefault(name, []).append(timed(ledger.ack_deliveries, subscriber, [d]))
    for n in range(rounds):
        times.setdefault("publish plain", []).append(
            timed(lambda n=n: publishing.publish(queue, [publishing.prepare("create", n)]))
        )
        times.setdefault("publish receipt", []).append(
            timed(lambda: publishing.publish(queue, [publishing.Outgoing("create", "1", None, receipt=True)]))
        )
    print(f"{connection.vendor}, {rounds} rounds, {SUBSCRIBERS} subscriptions; median (p90) ms")
    for key, values in times.items():
        values.sort()
        print(f"  {key!s:24} {statistics.median(values):7.3f} ({values[int(len(values) * 0.9)]:.3f})")
    Queue.objects.filter(name="bench-receipts").delete()
    Subscriber.objects.filter(name__startswith="bench-r-").delete()


if __name__ == "__main__":
    main()
