"""What subscription filters (subscribers.filters) add to a publish, on the database at
DATABASE_URL (a scratch one: it is migrated and emptied); issue 29 allows at most 1.5 times.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_filters \
        .venv/bin/python bench/filter_cost.py [--blocks 6] [--rounds 100]

100 subscribers, each subscribed to three queues: `plain` without a filter, `filtered` with a
filter of two keys (a nested payload field and a header) that every message matches, and
`missed` with the same filter, which no message matches. The same order payload is published to
each: plain and filtered make 100 deliveries a message, missed none. Two ways, as the server
publishes: one message at a time on the event loop (group_commit.apublish(), a socket's
publish) and a batch of 10 in a thread's transaction (group_commit.publish(), a REST batch).
The queues alternate in blocks in one process, so that the machine's other load falls on all
alike; each block first runs 10 unmeasured rounds. Prints the mean and median milliseconds of
each, and filtered/plain.
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

from django.core.management import call_command  # noqa: E402

from delivery import group_commit, publishing, subscribing  # noqa: E402
from delivery.models import Delivery  # noqa: E402
from mqsite import adb  # noqa: E402
from queues.models import Message, Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

ORDER = {
    "id": 123456,
    "customer": {"id": "c-0042", "email": "ann@example.com", "tier": "gold"},
    "currency": "EUR",
    "total": 149.9,
    "lines": [{"sku": "SKU-0001", "quantity": 2, "price": 19.95}],
}
HEADERS = {"tenant": "acme", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
FILTER = {"payload.customer.tier": ["gold", "silver"], "headers.tenant": ["acme", "globex"]}
MISSED = {"payload.customer.tier": ["bronze"], "headers.tenant": ["acme", "globex"]}
QUEUES = {"plain": None, "filtered": FILTER, "missed": MISSED}
SUBSCRIBERS = 100
BATCH = 10


def setup():
    call_command("migrate", verbosity=0)
    for model in (Delivery, Message, Subscriber, Queue):
        model.objects.all().delete()
    queues = {name: Queue.objects.create(name=name) for name in QUEUES}
    publisher, _ = create_subscriber("filter-pub", publish=list(QUEUES))
    for n in range(SUBSCRIBERS):
        subscriber, _ = create_subscriber(f"filter-sub-{n}", subscribe=list(QUEUES))
        for name, flt in QUEUES.items():
            subscribing.subscribe(subscriber, queues[name], filter=flt)
    for queue in queues.values():  # the event made, and remembered by publishing
        publishing.publish(queue, [publishing.prepare("order", ORDER, headers=HEADERS)], publisher)
    return queues, publisher


async def singles(queue, publisher, n, times=None):
    for _ in range(n):
        t0 = time.perf_counter()
        await group_commit.apublish(queue, [publishing.prepare("order", ORDER, headers=HEADERS)], publisher)
        if times is not None:
            times.append((time.perf_counter() - t0) * 1000)


def batches(queue, publisher, n, times=None):
    for _ in range(n):
        t0 = time.perf_counter()
        group_commit.publish(
            queue, [publishing.prepare("order", ORDER, headers=HEADERS) for _ in range(BATCH)], publisher
        )
        if times is not None:
            times.append((time.perf_counter() - t0) * 1000)


async def measure(queues, publisher, blocks, n):
    times = {(way, q): [] for way in ("single", f"batch of {BATCH}") for q in QUEUES}
    for block in range(blocks):
        for name in QUEUES if block % 2 == 0 else reversed(QUEUES):
            queue = queues[name]
            await singles(queue, publisher, 10)
            await singles(queue, publisher, n, times[("single", name)])
            await adb.thread(batches)(queue, publisher, 2)
            await adb.thread(batches)(queue, publisher, max(n // 10, 3), times[(f"batch of {BATCH}", name)])
    await adb.close_pool()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=100, help="measured single publishes of each block")
    args = parser.parse_args()
    queues, publisher = setup()
    times = asyncio.run(measure(queues, publisher, args.blocks, args.rounds))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for way in dict.fromkeys(w for w, _ in times):
        means = {}
        for name in QUEUES:
            ms = times[(way, name)]
            means[name] = statistics.mean(ms)
            print(
                f"{way:11s} {name:8s} mean {means[name]:7.3f} ms  median {statistics.median(ms):7.3f} ms"
                f"  ({len(ms)} publishes)"
            )
        print(
            f"{way:11s} filtered/plain {means['filtered'] / means['plain']:.3f}"
            f"  missed/plain {means['missed'] / means['plain']:.3f}"
        )


if __name__ == "__main__":
    main()
