"""What the ack latency histogram (delivery.observe) costs an ack on the database at DATABASE_URL
(a scratch one: it is migrated and filled), against the ack as it was, alternated per round.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_acks \
        .venv/bin/python bench/ack_latency_cost.py [--rounds 300]

Acks of 1 and of 100 in-flight deliveries (of a message fanned out to 100 subscriptions):
- `before`: the ack UPDATE as it was (RETURNING id and the receipt CASE);
- `after`: with observe.ack_returning()'s columns too (the queue, and the seconds since the wait
  began: the row's created_at, or its message's deliver_at where the delivery was not ready at
  once);
- `after+observe`: that, and the observation of each row (observe.acked_statement);
- `after, retried`: `after` on deliveries nacked once (their deliver_at is looked up).
Prints the median and p90 milliseconds of each.
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

from delivery import observe, publishing, subscribing  # noqa: E402
from delivery.models import Delivery, Status  # noqa: E402
from mqsite import adb  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

SUBSCRIBERS = 100
BEFORE = "RETURNING id, CASE WHEN receipt THEN message_id END"
AFTER = f"{BEFORE}, {observe.ack_returning()}"


def setup():
    call_command("migrate", verbosity=0)
    Queue.objects.filter(name="bench-acks").delete()
    Subscriber.objects.filter(name__startswith="bench-a-").delete()
    queue = Queue.objects.create(name="bench-acks")
    for i in range(SUBSCRIBERS):
        s, _ = create_subscriber(f"bench-a-{i}", subscribe=["bench-acks"])
        subscribing.subscribe(s, queue)
    return queue


def statement(ids, returning, now):
    of_ids, params = adb.one_of("id", ids)
    return (
        f"UPDATE {Delivery._meta.db_table} SET status = %s, acked_at = %s, ack_deadline = NULL,"
        f" lease_holder = '' WHERE {of_ids} AND status <> %s {returning}",
        [Status.ACKED, connection.ops.adapt_datetimefield_value(now), *params, Status.ACKED],
    )


def _ack(sql, params, now, observed):
    rows = yield sql, params
    if observed:
        yield from observe.acked_statement(rows)
    return rows


def timed(ids, returning, observed=False):
    now = timezone.now()
    started = time.perf_counter()
    adb.run_sync(_ack(*statement(ids, returning, now), now, observed))
    return (time.perf_counter() - started) * 1000


def reopen(ids, retried=False):
    moved = {"status": Status.INFLIGHT, "acked_at": None}
    if retried:  # as a nack and a new lease leave it: ready later than it was made
        Delivery.objects.filter(id__in=ids).update(next_attempt_at=timezone.now(), **moved)
    else:
        from django.db.models import F

        Delivery.objects.filter(id__in=ids).update(next_attempt_at=F("created_at"), **moved)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=300)
    rounds = parser.parse_args().rounds
    queue = setup()
    if connection.vendor == "postgresql":
        # As the ledger's acks commit (without waiting for the WAL flush): the flush's time, which
        # varies with the machine's other writes, would hide a difference of microseconds.
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO off")
    publishing.publish(queue, [publishing.prepare("create", i) for i in range(100)])
    ids = list(Delivery.objects.filter(queue=queue).order_by("id").values_list("id", flat=True))
    cases = {
        "before": (BEFORE, False, False),
        "after": (AFTER, False, False),
        "after+observe": (AFTER, True, False),
        "after, retried": (AFTER, False, True),
    }
    times = {}
    for batch in (1, 100):
        for r in range(rounds):
            chosen = ids[(r * batch) % len(ids) :][:batch]
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                returning, observed, retried = cases[name]
                reopen(chosen, retried)
                times.setdefault((name, batch), []).append(timed(chosen, returning, observed))
    print(f"{connection.vendor}, {rounds} rounds; load average {os.getloadavg()[0]:.2f}; median (p90) ms")
    for (name, batch), values in times.items():
        values.sort()
        print(
            f"  ack of {batch:3d} {name:15s} {statistics.median(values):7.3f}"
            f" ({values[int(len(values) * 0.9)]:.3f})"
        )
    Queue.objects.filter(name="bench-acks").delete()
    Subscriber.objects.filter(name__startswith="bench-a-").delete()


if __name__ == "__main__":
    main()
