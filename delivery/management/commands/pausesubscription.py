"""pausesubscription SUBSCRIBER QUEUE [EVENT] [--resume] [--json]

Pauses (or, with --resume, resumes) the subscriber's subscriptions to the queue: all of them,
or with EVENT only the one to that event (`*`: the one to every event). A paused subscription
is still owed everything published to it and is handed nothing, by any transport, until
resumed (delivery.subscribing.pause, as the API and the admin do). Prints each subscription
as the REST API answers it, one JSON object a line (with --json, one document
{"subscriptions": [...]}); idempotent.
"""

from django.core.management.base import CommandError

from delivery import subscribing
from mqsite.commands import ReportCommand, as_json
from mqsite.names import BadName, clean_name
from subscribers.api.serializers import subscription_answer
from subscribers.models import Subscription


class Command(ReportCommand):
    help = (
        "Pause a subscriber's subscriptions to a queue (still owed what is published, handed nothing), "
        "or resume them with --resume."
    )
    json_help = 'print {"subscriptions": [...]}, each as the REST API answers it'

    def add_arguments(self, parser):
        parser.add_argument("subscriber")
        parser.add_argument("queue")
        parser.add_argument("event", nargs="?", help="only the one to this event (*: to every event)")
        parser.add_argument("--resume", action="store_true", help="resume them instead")

    def report(self, *args, **options):
        event = options["event"]
        try:
            queue = clean_name(options["queue"], "queue")
            event_name = clean_name(event, "event") if event not in (None, "*") else None
        except BadName as exc:
            raise CommandError(str(exc)) from None
        subscriptions = Subscription.objects.filter(subscriber__name=options["subscriber"], queue__name=queue)
        if event == "*":
            subscriptions = subscriptions.filter(event__isnull=True)
        elif event is not None:
            subscriptions = subscriptions.filter(event__name=event_name)
        if not subscriptions.exists():
            raise CommandError(
                f"{options['subscriber']!r} has no subscription to {options['queue']!r}"
                + (f" event {event!r}" if event is not None else "")
            )
        (subscribing.resume if options["resume"] else subscribing.pause)(subscriptions)
        return {
            "subscriptions": [
                {"subscriber": options["subscriber"], **subscription_answer(subscription)}
                for subscription in subscriptions.select_related("queue", "event").order_by("pk")
            ]
        }

    def render(self, result):
        for answer in result["subscriptions"]:
            self.stdout.write(as_json(answer))
