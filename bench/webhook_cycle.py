"""Where a webhook job's milliseconds go on an ordered queue, step by step, in one process on the
database at DATABASE_URL (a scratch one: it is migrated and emptied).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mqsite_bench_cycle \
        .venv/bin/python bench/webhook_cycle.py [--messages 500] [--rounds 3]

An ordered queue of `--messages` (W7's size), one subscriber whose webhook is a receiver in this
process answering 200 at once (webhook_rate.Receiver), and delivery.tasks' job run here as a
Celery worker runs it (its statements prepared, as run_sync prepares them), each step timed:
the whole lease, the post, the attempts and acks, the next head's lease. Checks that every
message came once, in order. Prints each round's messages a second and each step's count, median and total.
"""

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
os.environ["MQ_WEBHOOK_ALLOW_PRIVATE"] = "true"  # the receiver is on loopback

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from webhook_rate import Receiver  # noqa: E402  (bench/, the script's own directory)

from delivery import ledger, publishing, subscribing, tasks  # noqa: E402
from delivery.models import Delivery, DeliveryAttempt  # noqa: E402
from queues.models import Message, Queue  # noqa: E402
from subscribers.models import Subscriber  # noqa: E402
from subscribers.provisioning import provision_subscriber  # noqa: E402

STEPS = [
    (ledger, "lease_deliveries"),  # the whole lease: the subscriptions' read, then a statement each
    (tasks, "post_one"),
    (ledger, "settle_posts"),  # the attempt rows and the acks
    (ledger, "lease_heads_after"),  # the line's next head alone
]


def timed(times):
    """Wrap each step so that its calls are timed into `times`."""
    for module, name in STEPS:
        fn = getattr(module, name)

        @functools.wraps(fn)
        def step(*args, _fn=fn, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                times[_name].append(time.perf_counter() - started)

        setattr(module, name, step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    for model in (DeliveryAttempt, Delivery, Message, Subscriber, Queue):
        model.objects.all().delete()
    receiver = Receiver()
    queue = Queue.objects.create(name="cycle", ordered=True)
    subscriber, _, _, _ = provision_subscriber(
        "cycle-hook", publish=["cycle"], subscribe=["cycle"], webhook_url=receiver.url
    )
    subscribing.subscribe(subscriber, queue)
    times = collections.defaultdict(list)
    timed(times)
    try:
        for n in range(args.rounds):
            batch = [publishing.prepare("e", {"i": i, "pad": "x" * 100}) for i in range(args.messages)]
            publishing.publish(queue, batch, subscriber)
            times.clear()
            receiver.reset()
            started = time.perf_counter()
            posted = tasks._post_ready(subscriber.pk, "bench-cycle/webhook.0")
            took = time.perf_counter() - started
            arrived = [json.loads(body)["payload"]["i"] for _, _, body in receiver.snapshot()]
            assert arrived == list(range(args.messages)), "lost, doubled or out of order"
            each = took / posted * 1000
            print(f"round {n}: {posted} in {took:.3f} s, {posted / took:.0f}/s, {each:.2f} ms each")
            for name, spent in times.items():
                print(
                    f"  {name:18s} {len(spent):5d} calls, median {statistics.median(spent) * 1000:5.2f} ms,"
                    f" total {sum(spent):.3f} s"
                )
    finally:
        receiver.close()


if __name__ == "__main__":
    main()
