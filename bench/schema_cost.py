"""What an event's JSON Schema (queues.schemas) adds to a publish, on the database at
DATABASE_URL (a scratch one: it is migrated and emptied); issue 29 allows at most 10 %.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_schema \
        .venv/bin/python bench/schema_cost.py [--blocks 10] [--rounds 300]

The same order payload (a dozen fields, a nested address, three line items) is published to two
events of one queue, fanned out to two subscriptions each: `plain` has no schema, `typed` one
that checks every field (types, required, enum, pattern, bounds, additionalProperties: false).
Two ways, as the server publishes: one message at a time on the event loop
(group_commit.apublish(), a socket's publish) and a batch of 100 in a thread's transaction
(group_commit.publish(), a REST batch). The events alternate in blocks in one process, so that
the machine's other load falls on both alike; each block first runs 20 unmeasured rounds.
Prints the mean and median milliseconds of each, and typed/plain; then what the check alone
costs a message (publishing.acheck_schemas(), no database), which a loaded machine's noise in
the publishes (milliseconds) cannot hide.
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


async def singles(queue, publisher, event, n, times=None):
    for _ in range(n):
        # Prepared per message, as a frame is: the payload as decoded, its text encoded.
        t0 = time.perf_counter()
        await group_commit.apublish(queue, [publishing.prepare(event, ORDER)], publisher)
        if times is not None:
            times.append((time.perf_counter() - t0) * 1000)


def batches(queue, publisher, event, n, times=None):
    for _ in range(n):
        t0 = time.perf_counter()
        group_commit.publish(queue, [publishing.prepare(event, ORDER) for _ in range(BATCH)], publisher)
        if times is not None:
            times.append((time.perf_counter() - t0) * 1000)


async def measure(queue, publisher, blocks, n):
    times = {(way, e): [] for way in ("single", f"batch of {BATCH}") for e in EVENTS}
    for block in range(blocks):
        for event in EVENTS if block % 2 == 0 else reversed(EVENTS):
            await singles(queue, publisher, event, 20)
            await singles(queue, publisher, event, n, times[("single", event)])
            await adb.thread(batches)(queue, publisher, event, 2)
            await adb.thread(batches)(
                queue, publisher, event, max(n // 20, 3), times[(f"batch of {BATCH}", event)]
            )
    await adb.close_pool()
    return times


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
    times = asyncio.run(measure(queue, publisher, args.blocks, args.rounds))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for way in dict.fromkeys(w for w, _ in times):
        means = {}
        for event in EVENTS:
            ms = times[(way, event)]
            means[event] = statistics.mean(ms)
            print(
                f"{way:14s} {event:6s} mean {means[event]:7.3f} ms  median {statistics.median(ms):7.3f} ms"
                f"  ({len(ms)} publishes)"
            )
        print(f"{way:14s} typed/plain {means['typed'] / means['plain']:.3f}")
    alone = asyncio.run(check_alone(queue))
    print("the check alone: " + ", ".join(f"{e} {us:.1f} µs" for e, us in alone.items()) + " a message")


if __name__ == "__main__":
    main()
