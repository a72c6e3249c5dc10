"""redeliver [--queue Q] [--subscriber S] [--dead] [--json]: put deliveries back to pending, ready
now; prints {"redelivered": n}, --json or not."""

from django.core.management.base import CommandError

from delivery import ledger
from delivery.models import Delivery, Status
from mqsite.commands import ReportCommand
from queues import lookup
from subscribers.models import Subscriber


class Command(ReportCommand):
    help = "Put deliveries back to pending with a fresh count of attempts (every one not acked, or --dead)."
    json_help = 'print {"redelivered": n} (as without it)'

    def add_arguments(self, parser):
        parser.add_argument("--queue", metavar="Q", help="only this queue's deliveries")
        parser.add_argument("--subscriber", metavar="S", help="only this subscriber's deliveries")
        parser.add_argument("--dead", action="store_true", help="only dead deliveries")

    def report(self, *args, **options):
        deliveries = Delivery.objects.all()
        if options["dead"]:
            deliveries = deliveries.filter(status=Status.DEAD)
        else:
            deliveries = deliveries.exclude(status=Status.ACKED)
        if options["queue"] is not None:
            queue = lookup.find_queue(options["queue"])
            if queue is None:
                raise CommandError(f"there is no queue named {options['queue']!r}")
            deliveries = deliveries.filter(queue=queue)
        if options["subscriber"] is not None:
            subscriber = Subscriber.objects.filter(name=options["subscriber"]).first()
            if subscriber is None:
                raise CommandError(f"there is no subscriber named {options['subscriber']!r}")
            deliveries = deliveries.filter(subscriber=subscriber)
        return {"redelivered": ledger.redeliver(deliveries)}
