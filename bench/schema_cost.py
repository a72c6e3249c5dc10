"""What an event's JSON Schema (queues.schemas) adds to a publish, on the database at
DATABASE_URL (a scratch one: it is migrated and emptied); issue 29 allows at most 10 %.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_schema \
        .venv/bin/python bench/schema_cost.py [--blocks 10] [--rounds 300]

The same order payload (a dozen fields, a nested address, three line items) is published to two
events of one queue, fanned out to two subscriptions each: `plain` has no schema, `typed` one
that checks every field (types, required, enum, pattern, bounds, additionalProperties: false).
Two ways, as the server publishes (bench/cost_blocks.py): one message at a time on the event
loop (group_commit.apublish()) and a batch of 100 in a thread (group_commit.publish()), the
events in alternating blocks. Prints the mean and median milliseconds of each, and typed/plain;
then what the check alone costs a message (publishing.acheck_schemas(), no database), which a
loaded machine's noise in the publishes (milliseconds) cannot hide.
"""

import argparse
import asyncio
import os
import sys
import time
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
from queues import schemas  # noqa: E402
from queues.models import Message, Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

ORDER = {
    "id": 123456,
    "customer": {"id": "c-0042", "email": "ann@example.com", "tier": "gold"},
    "currency": "EUR",
    "total": 149.9,
    "placed_at": "2026-11-28T08:00:00Z",
    "shipping": {"street": "1 Main St", "city": "Lyon", "postcode": "69001", "country": "FR"},
    "lines": [
        {"sku": "SKU-0001", "quantity": 2, "price": 19.95},
        {"sku": "SKU-0002", "quantity": 1, "price": 60.0},
        {"sku": "SKU-0003", "quantity": 5, "price": 10.0},
    ],
    "notes": None,
}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["id", "customer", "currency", "total", "placed_at", "shipping", "lines"],
    "additionalProperties": False,
    "$defs": {
        "line": {
            "type": "object",
            "required": ["sku", "quantity", "price"],
            "additionalProperties": False,
            "properties": {
                "sku": {"type": "string", "pattern": "^SKU-[0-9]{4}$"},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                "price": {"type": "number", "minimum": 0},
            },
        }
    },
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {
            "type": "object",
            "required": ["id", "email"],
            "properties": {
                "id": {"type": "string", "minLength": 1, "maxLength": 64},
                "email": {"type": "string", "format": "email"},
                "tier": {"enum": ["bronze", "silver", "gold"]},
            },
        },
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
        "total": {"type": "number", "exclusiveMinimum": 0},
        "placed_at": {"type": "string", "format": "date-time"},
        "shipping": {
            "type": "object",
            "required": ["street", "city", "country"],
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postcode": {"type": "string", "maxLength": 16},
                "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
        },
        "lines": {"type": "array", "minItems": 1, "maxItems": 500, "items": {"$ref": "#/$defs/line"}},
        "notes": {"type": ["string", "null"], "maxLength": 2000},
    },
}
EVENTS = ("plain", "typed")
BATCH = 100


def setup(aa=False):
    call_command("migrate", verbosity=0)
    for model in (Delivery, Message, Subscriber, Queue):
        model.objects.all().delete()
    queue = Queue.objects.create(name="schemas")
    publisher, _ = create_subscriber("schema-pub", publish=["schemas"], subscribe=["schemas"])
    other, _ = create_subscriber("schema-other", subscribe=["schemas"])
    for s in (publisher, other):
        subscribing.subscribe(s, queue)
    if not aa:
        schemas.set_event_schema(queue, "typed", SCHEMA)
    for event in EVENTS:  # made, and remembered by publishing
        publishing.publish(queue, [publishing.prepare(event, ORDER)], publisher)
    return queue, publisher


def cases(queue, publisher):
    def case(event):
        async def one():
            # Prepared per message, as a frame is: the payload as decoded, its text encoded.
            await group_commit.apublish(queue, [publishing.prepare(event, ORDER)], publisher)

        def batch():
            group_commit.publish(queue, [publishing.prepare(event, ORDER) for _ in range(BATCH)], publisher)

        return one, batch

    return {event: case(event) for event in EVENTS}


async def check_alone(queue, n=20_000):
    """Microseconds of acheck_schemas() per message, for each event (its schema kept)."""
    spent = {}
    for event in EVENTS * 2:  # the second pass counts, the first warms
        outgoing = [publishing.prepare(event, ORDER)]
        t0 = time.perf_counter()
        for _ in range(n):
            await publishing.acheck_schemas(queue, outgoing)
        spent[event] = (time.perf_counter() - t0) / n * 1e6
    return spent


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=300, help="measured single publishes of each block")
    parser.add_argument("--aa", action="store_true", help="no schema on either event: the noise floor")
    args = parser.parse_args()
    queue, publisher = setup(args.aa)
    times = asyncio.run(
        cost_blocks.measure(
            cases(queue, publisher),
            batch=BATCH,
            blocks=args.blocks,
            rounds=args.rounds,
            warm=20,
            batch_share=20,
        )
    )
    cost_blocks.report(times, [("typed", "plain")])
    alone = asyncio.run(check_alone(queue))
    print("the check alone: " + ", ".join(f"{e} {us:.1f} µs" for e, us in alone.items()) + " a message")


if __name__ == "__main__":
    main()
