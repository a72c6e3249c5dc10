"""listen SUBSCRIBER QUEUE [EVENT] [--count N] [--no-ack] [--from all|new|SEQ|TIME] [--filter JSON]

Pulls the subscriber's deliveries from the ledger as a client would, catch-up first, and
prints each as one JSON line, acking it once printed. Stops after --count messages, or at the
first SIGINT/SIGTERM once the deliveries already leased are printed (a second signal acts as
usual).

--from replays what the queue still holds from that point (subscribers.replay): a new
subscription is made from it, and an existing one is sought back to it (its acked messages
from there are handed out again), as an operator asking for history means.

--filter sets the filter of the subscription it listens through (subscribers.filters: only
the messages whose values match are owed from then on; "null" clears it), before any replay.
"""

import functools
import json
import os
import signal
import sys
import threading
import time

from django.core.management.base import CommandError
from django.db import close_old_connections, connection
from django.db.models import Q
from rest_framework.utils.encoders import JSONEncoder

from delivery import ledger, subscribing, wakeups
from mqsite.commands import ReportCommand
from mqsite.names import BadName, clean_name
from queues import lookup
from queues.models import Event
from subscribers import filters, replay
from subscribers.models import Subscriber, Subscription

# Wake-ups only cross threads of one process; deliveries published by another process are
# seen by polling, so poll often enough to feel live.
RECHECK_SECS = 0.2
# Leased per pull: few enough that a stop request is honoured quickly (the batch in hand is
# printed first), enough that a long catch-up is not one query per message.
LEASE_BATCH = 100


class Command(ReportCommand):
    help = "Receive a subscriber's deliveries of a queue as JSON lines, acking each after printing."
    json_flag = False  # its output is JSON lines already

    def add_arguments(self, parser):
        parser.add_argument("subscriber", help="the subscriber's name")
        parser.add_argument("queue")
        parser.add_argument("event", nargs="?", help="only this event (default: every event)")
        parser.add_argument("--count", type=int, metavar="N", help="stop after N messages")
        parser.add_argument("--no-ack", action="store_true", help="leave the deliveries in flight")
        parser.add_argument(
            "--from",
            dest="start",
            metavar="all|new|SEQ|TIME",
            help="replay from there first: every message still kept (all), a seq, or an ISO 8601 time "
            "(an existing subscription is sought back to it)",
        )
        parser.add_argument(
            "--filter",
            metavar="JSON",
            help='set the subscription\'s filter first, e.g. \'{"payload.kind": ["red"]}\' (null: none)',
        )

    def report(self, *args, **options):
        count = options["count"]
        if count is not None and count < 1:
            raise CommandError("--count must be at least 1")
        subscriber = Subscriber.objects.filter(name=options["subscriber"]).first()
        if subscriber is None:
            raise CommandError(f"there is no subscriber named {options['subscriber']!r}")
        queue = lookup.find_queue(options["queue"])
        if queue is None:
            raise CommandError(f"there is no queue named {options['queue']!r}")
        event_name = None
        if options["event"] is not None:
            try:
                event_name = clean_name(options["event"], "event")
            except BadName as exc:
                raise CommandError(str(exc)) from None
        point = None
        if options["start"] is not None:
            try:
                point = replay.point_of_text(options["start"])
            except replay.BadPoint as exc:
                raise CommandError(f"--from: {exc.detail}") from None
        checked = subscribing.KEEP
        if options["filter"] is not None:
            try:
                checked = filters.check_filter(json.loads(options["filter"]))
            except ValueError as exc:
                raise CommandError(f"--filter is not JSON: {exc}") from None
            except filters.BadFilter as exc:
                raise CommandError(f"--filter: {exc}") from None
        event_ids = self._subscribe(subscriber, queue, event_name, point, checked)
        if queue.paused:
            self.note(f"queue {queue.name} is paused: nothing is handed out until it resumes")
        if Subscription.objects.filter(subscriber=subscriber, queue=queue, paused=True).exists():
            self.note(
                f"a subscription of {subscriber.name} to {queue.name} is paused: nothing of it is handed"
                " out until it resumes (pausesubscription --resume)"
            )

        stop = _StopOnSignal()
        printed = 0
        with stop:
            while not stop.requested and (count is None or printed < count):
                if not connection.in_atomic_block:
                    # A long-running loop drops a broken or expired connection, as a request does.
                    close_old_connections()
                limit = LEASE_BATCH if count is None else min(LEASE_BATCH, count - printed)
                lease = functools.partial(
                    ledger.lease_deliveries, subscriber, limit=limit, queue=queue, event_ids=event_ids
                )
                # One wait for a wake-up at most, then a look at `stop` again (nothing is leased
                # once it is asked).
                leased = wakeups.lease_when_woken(
                    subscriber.pk,
                    lambda lease=lease: [] if stop.requested else lease(),
                    time.monotonic() + RECHECK_SECS,
                    recheck_secs=RECHECK_SECS,
                )
                if not leased:
                    continue
                # The whole batch is printed even if a stop was asked meanwhile: it is leased.
                for delivery in leased:
                    try:
                        self.stdout.write(json.dumps(delivery, cls=JSONEncoder, ensure_ascii=False))
                        self.stdout.flush()
                    except BrokenPipeError:
                        # The reader is gone (`listen ... | head -1`). What it did not read stays
                        # unacked, so it is handed out again after its ack deadline.
                        _silence_stdout()
                        return
                    if not options["no_ack"]:
                        ledger.ack_deliveries(subscriber, [delivery["id"]])
                    printed += 1

    def _subscribe(self, subscriber, queue, event_name, point=None, checked=subscribing.KEEP):
        """Make sure the subscriber holds a subscription covering what it listens to, with the
        filter `checked` (KEEP: as it is), replayed from `point` if given; returns the event ids
        to lease (None: every event of the queue)."""
        subs = Subscription.objects.filter(subscriber=subscriber, queue=queue)
        if event_name is None:
            event = None
            covering = subs.filter(event__isnull=True).first()
        else:
            event = Event.objects.filter(queue=queue, name=event_name).first()
            # A subscription to every event covers this one, even an event never published
            # yet: a second subscription would deliver it twice.
            covering = subs.filter(Q(event__isnull=True) | Q(event=event)).order_by("event_id").first()
        if covering is None or point is not None:
            if not subscriber.may_subscribe(queue):
                raise CommandError(f"{subscriber.name} may not subscribe to {queue.name}")
        replayed = None
        if covering is None:
            if point is None:
                subscription, _ = subscribing.subscribe(subscriber, queue, event_name, filter=checked)
            else:
                subscription, _, replayed = subscribing.subscribe_from(
                    subscriber, queue, event_name, point, filter=checked
                )
            event = subscription.event
        if event_name is not None and event is None:
            # Covered by the every-event subscription, and never published: the event is made
            # now (as a publish would make it) so that the lease can be narrowed to it.
            event, _ = Event.objects.get_or_create(queue=queue, name=event_name)
        event_ids = None if event_name is None else [event.pk]
        if covering is not None and checked is not subscribing.KEEP:
            subscribing.set_filter(covering, checked)
        if covering is not None and point is not None and point.kind != replay.NEW:
            # Only the event listened to, though the subscription is to every event.
            replayed = subscribing.seek(covering, point, event_ids=event_ids)
        if replayed is not None:
            self.note(f"replaying from seq {replayed.from_seq}: {replayed.deliveries} deliveries owed")
        return event_ids


def _silence_stdout():
    """Point stdout at /dev/null, so that the exit's final flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (tests)
        pass


class _StopOnSignal:
    """Turns the first SIGINT or SIGTERM into a request to stop; the next one acts as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        # Handlers can be set only from the main thread (not so under some test runners).
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc_info):
        self._restore()

    def _handle(self, signum, frame):
        self.requested = True
        self._restore()

    def _restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
