"""demo: publish a few realistic messages a second to the demo queues, and let the demo
subscribers (logger, dashboard, monitor) take and ack them, so the dashboard has something
to show. Beside a running server they are its real clients (websockets and REST, with the
tokens in var/demo_tokens), so they show as connected; when no server answers, this process
serves them through the ledger instead, and says so. Runs until stopped (SIGTERM or Ctrl-C),
or with --count until that many messages are published and everything owed to the demo
subscribers is settled."""

import random
import signal
import time

from django.conf import settings
from django.core.management.base import CommandError

from dashboard.demo import DemoServer, DemoTraffic, read_tokens, tokens_file
from mqsite.commands import ReportCommand

TICK_SECS = 0.2
REPORT_EVERY_SECS = 10
# `DEMO=1 make run` starts the demo beside the server, which takes a few seconds to answer.
SERVER_WAIT_SECS = 15.0


class Command(ReportCommand):
    help = "Publish demo messages and ack them as the demo subscribers, so counters move."
    json_help = "print only the summary at the end on stdout (what it says meanwhile goes to stderr)"

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
        parser.add_argument(
            "--url",
            help=f"the running server (default http://127.0.0.1:{settings.PORT}, as `make run` serves)",
        )
        parser.add_argument(
            "--server-wait",
            type=float,
            default=SERVER_WAIT_SECS,
            help="how long to wait for the server to answer before doing without it "
            f"(default {SERVER_WAIT_SECS:g} s)",
        )

    def report(self, *args, **options):
        if options["rate"] <= 0:
            raise CommandError("--rate must be above 0")
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
        try:
            url = options["url"] or f"http://127.0.0.1:{settings.PORT}"
            self.connect(traffic, url, options["server_wait"], stopping)
            self.run(traffic, options["rate"], count, seconds, stopping)
        finally:
            traffic.settle_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return traffic.summary()  # printed as JSON, --json or not

    def tell(self, line):
        """What it is doing: on stdout, or with --json (stdout holds the summary) on stderr."""
        if self.json:
            self.note(line)
        else:
            self.say(line)

    def connect(self, traffic, url, wait_secs, stopping):
        """Hand the demo subscribers to the server at `url` when it answers; say how they are served."""
        server = DemoServer(url)
        deadline = time.monotonic() + wait_secs
        why = server.unreachable()
        if why and wait_secs > 0:
            self.tell(f"demo: waiting up to {wait_secs:g} s for the server at {url}")
            while why and time.monotonic() < deadline and not stopping:
                time.sleep(0.5)
                why = server.unreachable()
        tokens = read_tokens()
        if not why and not tokens:
            why = f"no demo tokens in {tokens_file()} (`manage.py bootstrap` writes them on a fresh install)"
        if why:
            self.tell(
                f"demo: {why}. Without the server, this process publishes and consumes through the "
                "ledger: counters move, but no demo client shows as connected. Start `make run` "
                "and this again for real clients."
            )
            return
        for note in traffic.use_server(server, tokens):
            self.tell(f"demo: {note}")
        via = traffic.transports()
        sockets = [name for name, how in via.items() if how == "websocket"]
        pulling = [name for name, how in via.items() if how == "pull"]
        said = []
        if sockets:
            said.append(f"{' and '.join(sockets)} on websockets to {server.ws}")
        if pulling:
            said.append(f"{' and '.join(pulling)} pulling over REST")
        published = "over REST" if traffic.publish_tokens else "through the ledger"
        self.tell(f"demo: clients of {server.http}: {'; '.join(said)}; publishing {published}")

    def run(self, traffic, rate, count, seconds, stopping):
        started = last = last_report = time.monotonic()
        reported = (0, 0)
        troubles = []
        if count is None:
            self.tell(f"demo: publishing about {rate:g} messages a second; Ctrl-C stops")
        while not stopping:
            now = time.monotonic()
            if seconds is not None and now - started >= seconds:
                break
            left = None if count is None else count - traffic.published
            if left is None or left > 0:
                traffic.publish_due(now - last, limit=left)
            last = now
            traffic.consume(now)
            if count is not None and traffic.published >= count and not traffic.held and not traffic.owed():
                break
            if traffic.troubles() != troubles:
                troubles = traffic.troubles()
                for trouble in troubles:
                    self.tell(f"demo: trouble with the server: {trouble}")
            if count is None and now - last_report >= REPORT_EVERY_SECS:
                summary = traffic.summary()
                published, acked = summary["published"] - reported[0], summary["acked"] - reported[1]
                self.tell(f"demo: {published} published, {acked} acked in the last {now - last_report:.0f} s")
                reported, last_report = (summary["published"], summary["acked"]), now
            time.sleep(TICK_SECS)
