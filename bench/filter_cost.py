"""What subscription filters (subscribers.filters) add to a publish, on the database at
DATABASE_URL (a scratch one: it is migrated and emptied); issue 29 allows at most 1.5 times.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_filters \
        .venv/bin/python bench/filter_cost.py [--blocks 6] [--rounds 100]

100 subscribers, each subscribed to three queues: `plain` without a filter, `filtered` with a
filter of two keys (a nested payload field and a header) that every message matches, and
`missed` with the same filter, which no message matches. The same order payload is published to
each: plain and filtered make 100 deliveries a message, missed none. Two ways, as the server
publishes (bench/cost_blocks.py): one message at a time on the event loop
(group_commit.apublish()) and a batch of 10 in a thread (group_commit.publish()), the queues in
alternating blocks. Prints the mean and median milliseconds of each, and filtered/plain.
"""

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

import django  # noqa: E402

django.setup()

import cost_blocks  # noqa: E402
from django.core.management import call_command  # noqa: E402

from delivery import group_commit, publishing, subscribing  # noqa: E402
from delivery.models import Delivery  # noqa: E402
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


def cases(queues, publisher):
    def case(queue):
        async def one():
            await group_commit.apublish(
                queue, [publishing.prepare("order", ORDER, headers=HEADERS)], publisher
            )

        def batch():
            outgoing = [publishing.prepare("order", ORDER, headers=HEADERS) for _ in range(BATCH)]
            group_commit.publish(queue, outgoing, publisher)

        return one, batch

    return {name: case(queues[name]) for name in QUEUES}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=100, help="measured single publishes of each block")
    args = parser.parse_args()
    queues, publisher = setup()
    times = asyncio.run(
        cost_blocks.measure(
            cases(queues, publisher),
            batch=BATCH,
            blocks=args.blocks,
            rounds=args.rounds,
            warm=10,
            batch_share=10,
        )
    )
    cost_blocks.report(times, [("filtered", "plain"), ("missed", "plain")])


if __name__ == "__main__":
    main()
