"""rotatewebhooksecret NAME [--grace-secs N] [--json]

Gives the subscriber a new webhook secret and prints it, this once, alone on the last line of
stdout. Posts are signed with the old secret too for MQ_WEBHOOK_SECRET_GRACE_SECS (or
--grace-secs), so its receiver can switch over without refusing a delivery.
"""

from django.conf import settings
from django.core.management.base import CommandError

from mqsite.commands import ReportCommand, UsageError
from subscribers.models import Subscriber
from subscribers.provisioning import rotate_webhook_secret


class Command(ReportCommand):
    help = (
        "Give a subscriber a new webhook secret (printed this once, on the last line); the old one "
        "also signs posts for a grace period."
    )
    json_help = 'print {"subscriber", "webhook_secret", "previous_signs_until", "grace_secs", "webhook_url"}'

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--grace-secs",
            type=int,
            default=None,
            metavar="N",
            help="how long the old secret still signs (default: MQ_WEBHOOK_SECRET_GRACE_SECS; 0: not at all)",
        )

    def report(self, *args, **options):
        grace = options["grace_secs"]
        if grace is not None and grace < 0:
            raise UsageError("--grace-secs must be 0 or more")
        found = Subscriber.objects.filter(name=options["name"]).values_list("pk", flat=True).first()
        subscriber, secret = rotate_webhook_secret(found, grace) if found else (None, None)
        if subscriber is None:
            raise CommandError(f"no subscriber named {options['name']!r}")
        if not subscriber.webhook_url:
            self.note(f"{subscriber.name} has no webhook URL yet: nothing is signed with it")
        return {
            "subscriber": subscriber.name,
            "webhook_secret": secret,
            "previous_signs_until": subscriber.previous_webhook_secret_until,
            "grace_secs": settings.MQ_WEBHOOK_SECRET_GRACE_SECS if grace is None else grace,
            "webhook_url": subscriber.webhook_url,
        }

    def render(self, result):
        until = result["previous_signs_until"]
        if until is not None:
            old = (
                f"the old one also signs posts until {until:%Y-%m-%d %H:%M:%S %Z} ({result['grace_secs']} s)"
            )
        else:
            old = "the old one no longer signs"
        self.say(f"{result['subscriber']} has a new webhook secret; {old}")
        self.stdout.write(result["webhook_secret"])  # even at -v 0: what the command is for
