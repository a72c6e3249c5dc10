"""demo: publish a few realistic messages a second to the demo queues, and let the demo
subscribers (logger, dashboard, monitor) take and ack them, so the dashboard has something
to show. Runs until stopped (SIGTERM or Ctrl-C), or with --count until that many messages
are published and everything owed to the demo subscribers is settled."""

import json
import signal
import time

from django.core.management.base import BaseCommand, CommandError
from rest_framework.utils.encoders import JSONEncoder

from dashboard.demo import DemoTraffic

TICK_SECS = 0.2
REPORT_EVERY_SECS = 10


class Command(BaseCommand):
    help = "Publish demo messages and ack them as the demo subscribers, so counters move."

    def add_arguments(self, parser):
        parser.add_argument("--rate", type=float, default=4.0, help="messages per second (default 4)")
        parser.add_argument("--count", type=int, help="publish this many, settle them, then stop")
        parser.add_argument(
            "--seconds", type=float, help="stop after this long (default: never; 60 with --count)"
        )
        parser.add_argument(
            "--poison-every",
            type=int,
            default=25,
            help="every Nth message is a malformed network error the monitor refuses, so it dies (0: none)",
        )
        parser.add_argument("--seed", type=int, help="random seed, for a repeatable run")

    def handle(self, *args, **options):
        if options["rate"] <= 0:
            raise CommandError("--rate must be above 0")
        import random

        traffic = DemoTraffic(
            rate=options["rate"],
            poison_every=max(options["poison_every"], 0),
            rng=random.Random(options["seed"]),
        )
        if not traffic.queues or not traffic.subscribers:
            raise CommandError(
                "the demo queues (db, filesystem, network) or subscribers (logger, dashboard, monitor) "
                "are missing: they are made by `manage.py bootstrap` on a fresh install"
            )
        count = options["count"]
        seconds = options["seconds"] if options["seconds"] is not None else (60.0 if count else None)
        stopping = []
        previous = {
            sig: signal.signal(sig, lambda *_: stopping.append(True))
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        started = last = last_report = time.monotonic()
        reported = (0, 0)
        if count is None:
            self.stdout.write(f"demo: publishing about {options['rate']:g} messages a second; Ctrl-C stops")
        try:
            while not stopping:
                now = time.monotonic()
                if seconds is not None and now - started >= seconds:
                    break
                left = None if count is None else count - traffic.published
                if left is None or left > 0:
                    traffic.publish_due(now - last, limit=left)
                last = now
                traffic.consume(now)
                if (
                    count is not None
                    and traffic.published >= count
                    and not traffic.held
                    and not traffic.owed()
                ):
                    break
                if count is None and now - last_report >= REPORT_EVERY_SECS:
                    published, acked = traffic.published - reported[0], traffic.acked - reported[1]
                    self.stdout.write(
                        f"demo: {published} published, {acked} acked in the last {now - last_report:.0f} s"
                    )
                    reported, last_report = (traffic.published, traffic.acked), now
                time.sleep(TICK_SECS)
            traffic.settle_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write(json.dumps(traffic.summary(), cls=JSONEncoder))
