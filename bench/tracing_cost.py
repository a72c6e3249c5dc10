"""What OpenTelemetry tracing (mqsite.tracing, delivery.spans) costs a publish, on the database at
DATABASE_URL (a scratch one: it is migrated and emptied).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_tracing \
        .venv/bin/python bench/tracing_cost.py [--blocks 6] [--rounds 100] [--instrumented]

Each message carries a traceparent and tracestate and goes to 10 subscribers. The cases, in
alternating blocks (bench/cost_blocks.py), one message at a time on the event loop
(group_commit.apublish()) and a batch of 10 in a thread (group_commit.publish()):

- `bare`: the publish functions without their span hook (as before tracing existed);
- `off`: with the hook, tracing off (no OTEL_* exporter: the hook checks and calls through);
- `on`: our publish span recorded, through the SDK's batch processor and the scrubbing
  exporter, to an exporter that drops what it is given (the export's own cost is the
  collector's, in another thread, and varies with the network).

With --instrumented, the instrumentations are installed too (psycopg: a span per SQL
statement), and a sampler switched by the case records their spans in `on` only (in `bare` and
`off` they are made unsampled, which costs little): what a fully traced publish costs.
"""

import argparse
import asyncio
import os
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

import django  # noqa: E402

django.setup()

import cost_blocks  # noqa: E402
from django.core.management import call_command  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler  # noqa: E402

from delivery import group_commit, publishing, spans, subscribing  # noqa: E402
from delivery.models import Delivery  # noqa: E402
from mqsite import tracing  # noqa: E402
from queues.models import Message, Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

ORDER = {"id": 123456, "customer": {"id": "c-0042", "tier": "gold"}, "total": 149.9}
HEADERS = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "rojo=00f067aa0ba902b7",
}
SUBSCRIBERS = 10
BATCH = 10


class Dropped(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


class Switch(Sampler):
    """Samples while `on`: the instrumentations' spans are recorded in the `on` case only."""

    on = False

    def should_sample(self, *args, **kwargs):
        return (ALWAYS_ON if self.on else ALWAYS_OFF).should_sample(*args, **kwargs)

    def get_description(self):
        return "Switch"


def setup():
    call_command("migrate", verbosity=0)
    for model in (Delivery, Message, Subscriber, Queue):
        model.objects.all().delete()
    queue = Queue.objects.create(name="traced")
    publisher, _ = create_subscriber("trace-pub", publish=["traced"])
    for n in range(SUBSCRIBERS):
        subscriber, _ = create_subscriber(f"trace-sub-{n}", subscribe=["traced"])
        subscribing.subscribe(subscriber, queue)
    publishing.publish(queue, [publishing.prepare("order", ORDER, headers=HEADERS)], publisher)
    return queue, publisher


def cases(queue, publisher, tracer):
    def case(apublish, publish, tracer_now):
        async def one():
            tracing.tracer = tracer_now
            Switch.on = tracer_now is not None
            await apublish(queue, [publishing.prepare("order", ORDER, headers=HEADERS)], publisher)

        def batch():
            tracing.tracer = tracer_now
            Switch.on = tracer_now is not None
            publish(
                queue, [publishing.prepare("order", ORDER, headers=HEADERS) for _ in range(BATCH)], publisher
            )

        return one, batch

    hooked = (group_commit.apublish, group_commit.publish)
    bare = (group_commit.apublish.__wrapped__, group_commit.publish.__wrapped__)
    return {"bare": case(*bare, None), "off": case(*hooked, None), "on": case(*hooked, tracer)}


def hook_alone(tracer, number=20000):
    """The publish hook around a publish that does nothing, in microseconds a call: off, and on
    (a span with the message's trace extracted), without the database's noise."""
    queue = SimpleNamespace(name="traced", pk=1)
    outgoing = [publishing.prepare("order", ORDER, headers=HEADERS)]
    answers = [({"id": 1}, True)]

    def nothing(queue, outgoing, publisher=None):
        return answers

    hooked = spans.published("rest")(nothing)
    got = {}
    for name, fn, tracer_now in (("bare", nothing, None), ("off", hooked, None), ("on", hooked, tracer)):
        tracing.tracer = tracer_now
        Switch.on = tracer_now is not None
        best = min(timeit.repeat(lambda fn=fn: fn(queue, outgoing), number=number, repeat=5))
        got[name] = best / number * 1e6
    tracing.tracer = None
    print("the hook alone: " + "  ".join(f"{name} {us:.2f} µs" for name, us in got.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=100, help="measured single publishes of each block")
    parser.add_argument("--instrumented", action="store_true", help="the instrumentations installed too")
    args = parser.parse_args()
    provider = TracerProvider(sampler=Switch())
    provider.add_span_processor(BatchSpanProcessor(tracing.ScrubbingExporter(Dropped())))
    if args.instrumented:
        trace.set_tracer_provider(provider)
        tracing._instrument("web", {})
    queue, publisher = setup()
    times = asyncio.run(
        cost_blocks.measure(
            cases(queue, publisher, provider.get_tracer("mqsite")),
            batch=BATCH,
            blocks=args.blocks,
            rounds=args.rounds,
            warm=10,
            batch_share=10,
        )
    )
    hook_alone(provider.get_tracer("mqsite"))
    provider.shutdown()
    print("instrumentations installed" if args.instrumented else "no instrumentation")
    cost_blocks.report(times, [("off", "bare"), ("on", "bare"), ("on", "off")])


if __name__ == "__main__":
    main()
