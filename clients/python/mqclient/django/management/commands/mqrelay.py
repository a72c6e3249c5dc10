"""manage.py mqrelay: send the outbox's waiting rows, in a loop (a worker process) or once
(--once, for cron). It sends what the committing processes' own threads did not: the rows of a
process that died, and those waiting while the server was down."""

import signal
import threading
import time

from django.core.management.base import BaseCommand, CommandError
from django.db import connections, router

from mqclient.django import conf, relay
from mqclient.django.models import OutboxMessage


class Command(BaseCommand):
    help = "Send the message-queue outbox: a loop until SIGTERM, or --once."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="send what is waiting, then exit")
        parser.add_argument("--database", help="the outbox's database (default: the router's choice)")

    def handle(self, *args, once=False, database=None, **options):
        using = database or router.db_for_write(OutboxMessage)
        if once:
            try:
                done = relay.drain(using)
            except relay.RelayFailed as exc:
                raise CommandError(f"outbox not sent: {exc}") from exc
            relay.purge(using)
            self.stdout.write(
                f"sent {done.sent}, refused {done.refused}" + (" (another relay busy)" if done.busy else "")
            )
            return
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        self.stdout.write(f"mqrelay: relaying the outbox of database {using!r} until SIGTERM")
        self.stdout.flush()
        failures, purged_at = 0, float("-inf")
        while not stop.is_set():
            try:
                done = relay.drain(using)
                failures = 0
                if done.sent or done.refused:
                    self.stdout.write(f"sent {done.sent}, refused {done.refused}")
                    self.stdout.flush()
            except relay.RelayFailed:
                failures += 1  # the relay logged it at WARNING
            if time.monotonic() - purged_at > relay.PURGE_EVERY_SECS:
                relay.purge(using)
                purged_at = time.monotonic()
            connections[using].close()
            wait = relay.backoff_secs(failures) if failures else conf.get("RELAY_INTERVAL_SECS")
            stop.wait(wait)
