"""webhook enable|disable|status NAME [--json]

A subscriber's webhook as delivery.webhook_health keeps it: `status` prints it (one line, or with
--json one object); `enable` enables a disabled one again (what it is owed goes out at once, in
order where its queue is ordered), `disable` stops its posts (its deliveries stay owed), as the
admin's actions do. Each prints the state after it; idempotent.
"""

from django.core.management.base import CommandError

from delivery import webhook_health
from mqsite.commands import ReportCommand
from subscribers.models import Subscriber


class Command(ReportCommand):
    help = "Show, enable again or disable a subscriber's webhook."
    json_help = (
        'print {"subscriber", "webhook_url", "disabled", "disabled_since", "disabled_after", "failures", '
        '"first_failure_at", "last_error", "last_success_at", "changed"}'
    )

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["status", "enable", "disable"])
        parser.add_argument("name", help="the subscriber")

    def report(self, *args, **options):
        subscriber = Subscriber.objects.filter(name=options["name"]).first()
        if subscriber is None:
            raise CommandError(f"There is no subscriber named {options['name']!r}.")
        if not subscriber.webhook_url and options["action"] != "status":
            raise CommandError(f"{subscriber.name} has no webhook URL.")
        changed = False
        if options["action"] == "enable":
            changed = webhook_health.enable(subscriber, by="manage.py webhook")
        elif options["action"] == "disable":
            changed = webhook_health.disable(subscriber, by="manage.py webhook")
        self._action = options["action"]
        return {**status_of(subscriber, webhook_health.health_of(subscriber)), "changed": changed}

    def render(self, state):
        line = f"{state['subscriber']}: webhook {'disabled' if state['disabled'] else 'enabled'}"
        if state["disabled"]:
            line += f" since {state['disabled_since']} after {state['disabled_after']} failures"
        elif state["failures"]:
            line += f", {state['failures']} failures in a row since {state['first_failure_at']}"
        if state["last_error"] and (state["disabled"] or state["failures"]):
            line += f"; last error: {state['last_error'][:200]}"
        self.stdout.write(line + ("" if state["changed"] or self._action == "status" else " (unchanged)"))


def status_of(subscriber, health):
    def iso(at):
        return at.isoformat() if at is not None else None

    return {
        "subscriber": subscriber.name,
        "webhook_url": subscriber.webhook_url,
        "disabled": bool(health and health.disabled),
        "disabled_since": iso(health.disabled_since) if health else None,
        "disabled_after": health.disabled_after if health else None,
        "failures": health.failures if health else 0,
        "first_failure_at": iso(health.first_failure_at) if health else None,
        "last_error": health.last_error if health else "",
        "last_success_at": iso(health.last_success_at) if health else None,
    }
