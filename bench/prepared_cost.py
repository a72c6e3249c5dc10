"""What prepared statements save the socket's hot operations (mqsite/adb.py's async pool), on
the database at DATABASE_URL (a scratch one: it is migrated and emptied).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_prepared \
        .venv/bin/python bench/prepared_cost.py [--blocks 10] [--rounds 200]

One message at a time on the event loop, as a socket does: group_commit.apublish() of one
message (fanned out to two subscriptions), alease_deliveries(limit=1), aack_deliveries() of it.
The pool runs them with client-side binding (as before prepared statements: planned on every
call) and with its own settings (prepared), in alternating blocks in one process, so that the
machine's other load falls on both alike; each block first runs 30 unmeasured rounds (the
statements prepared, PostgreSQL's generic plans chosen after five runs). Prints the mean and
median milliseconds of each operation.
"""

import argparse
import asyncio
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

import psycopg  # noqa: E402
from django.core.management import call_command  # noqa: E402

from delivery import group_commit, ledger, publishing, subscribing  # noqa: E402
from delivery.models import Delivery  # noqa: E402
from mqsite import adb  # noqa: E402
from queues.models import Message, Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

WAYS = {
    "client-side binding": {"cursor_factory": psycopg.AsyncClientCursor, "prepare_threshold": None},
    "prepared": {},  # the pool's own
}
OPERATIONS = ("publish", "lease", "ack")


def setup():
    """A queue with two subscribers and 20,000 deliveries of acked history, so that the plans
    meet a table of some size. (Not a backlog of the other's: with few subscriptions, the
    lease's first read then scans the table for the measured one's ready rows, custom plan or
    generic alike, and its 20 ms hide what this measures.)"""
    call_command("migrate", verbosity=0)
    for model in (Delivery, Message, Subscriber, Queue):
        model.objects.all().delete()
    queue = Queue.objects.create(name="prepared")
    subscriber, _ = create_subscriber("prepared-sub", subscribe=["prepared"], publish=["prepared"])
    other, _ = create_subscriber("prepared-other", subscribe=["prepared"])
    for s in (subscriber, other):
        subscribing.subscribe(s, queue)
    for _ in range(20):
        batch = [publishing.prepare("e", {"i": i, "pad": "x" * 100}) for i in range(500)]
        publishing.publish(queue, batch, subscriber)
    for s in (subscriber, other):
        ledger.ack_deliveries(s, list(Delivery.objects.filter(subscriber=s).values_list("id", flat=True)))
    return queue, subscriber


async def rounds(queue, subscriber, n, times=None):
    outgoing = [publishing.prepare("e", {"i": 1, "pad": "x" * 100})]
    for _ in range(n):
        t0 = time.perf_counter()
        await group_commit.apublish(queue, outgoing, subscriber)
        t1 = time.perf_counter()
        [leased] = await ledger.alease_deliveries(subscriber, limit=1, holder="bench")
        t2 = time.perf_counter()
        await ledger.aack_deliveries(subscriber, [leased["id"]])
        t3 = time.perf_counter()
        if times is not None:
            for name, spent in zip(OPERATIONS, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[name].append(spent * 1000)


async def measure(queue, subscriber, blocks, n):
    times = {way: {name: [] for name in OPERATIONS} for way in WAYS}
    loop = asyncio.get_running_loop()
    for block in range(blocks):
        for way in WAYS if block % 2 == 0 else reversed(WAYS):
            await adb.close_pool()
            adb._pools[loop] = pool = adb._Pool()  # a new pool, then its settings for this way
            pool.kwargs.update(WAYS[way])
            await rounds(queue, subscriber, 30)
            await rounds(queue, subscriber, n, times[way])
    await adb.close_pool()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200, help="measured rounds of each block")
    args = parser.parse_args()
    queue, subscriber = setup()
    times = asyncio.run(measure(queue, subscriber, args.blocks, args.rounds))
    for way, spent in times.items():
        print(way)
        spent["round"] = [sum(r) for r in zip(*spent.values(), strict=True)]
        for name, ms in spent.items():
            print(f"  {name:8s} mean {statistics.mean(ms):6.3f} ms  median {statistics.median(ms):6.3f} ms")


if __name__ == "__main__":
    main()
