"""createqueue NAME [--ordered] [--max-attempts N] [--ack-timeout SECONDS] [--retention-days D]
[--ttl-secs N] [--lag-alert-secs N] [--json]"""

import argparse

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import transaction

from mqsite.commands import ReportCommand
from mqsite.names import BadName, clean_name
from queues.models import Queue

# Command option -> model field. Only the options given are written, so updating a queue
# leaves the rest as they were.
FIELDS = {
    "ordered": "ordered",
    "max_attempts": "max_attempts",
    "ack_timeout": "ack_timeout",
    "retention_days": "retention_days",
    "ttl_secs": "ttl_secs",
    "lag_alert_secs": "lag_alert_secs",
}


class Command(ReportCommand):
    help = "Make a queue, or update the settings given of an existing one (idempotent)."
    json_help = 'print {"queue", "created", "changed": [...], and each setting}'

    def add_arguments(self, parser):
        parser.add_argument("name", help="queue name: a-z, 0-9, '_', '.', '-'")
        parser.add_argument(
            "--ordered",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="FIFO: each subscription gets messages in seq order, one at a time (--no-ordered: not)",
        )
        parser.add_argument("--max-attempts", type=int, metavar="N", help="attempts before it is dead")
        parser.add_argument("--ack-timeout", type=int, metavar="SECONDS", help="how long a lease lasts")
        parser.add_argument(
            "--retention-days", type=int, metavar="D", help="acked history older than this is archived"
        )
        parser.add_argument(
            "--ttl-secs",
            type=int,
            metavar="N",
            help="a message that names no expiry expires N seconds after it falls due (0: never)",
        )
        parser.add_argument(
            "--lag-alert-secs",
            type=int,
            metavar="N",
            help="publish subscription.lagging to mq.system when a subscription's oldest pending delivery"
            " is older than this (0: never)",
        )

    def report(self, *args, **options):
        try:
            name = clean_name(options["name"], "queue name")
        except BadName as exc:
            raise CommandError(str(exc)) from None
        given = {field: options[opt] for opt, field in FIELDS.items() if options[opt] is not None}
        if given.get("ttl_secs") == 0:
            given["ttl_secs"] = None  # no default expiry
        if given.get("lag_alert_secs") == 0:
            given["lag_alert_secs"] = None  # 0 turns the alert off
        with transaction.atomic():
            # Lock the row: a publish between our read and our write must not be overwritten.
            queue = Queue.objects.select_for_update().filter(name=name).first()
            created = queue is None
            if created:
                queue = Queue(name=name)
            changed = [f for f, v in given.items() if getattr(queue, f) != v]
            for field, value in given.items():
                setattr(queue, field, value)
            try:
                queue.full_clean()
            except ValidationError as exc:
                raise CommandError(_describe(exc)) from None
            if created:
                queue.save()
            elif changed:
                # update_fields: never write back last_seq, the publishers' counter.
                queue.save(update_fields=changed)
        return {
            "queue": queue.name,
            "created": created,
            "changed": [] if created else changed,
            **{field: getattr(queue, field) for field in FIELDS.values()},
        }

    def render(self, result):
        verb = "created" if result["created"] else ("updated" if result["changed"] else "unchanged:")
        self.say(
            f"{verb} queue {result['queue']} (ordered={result['ordered']}, "
            f"max_attempts={result['max_attempts']}, ack_timeout={result['ack_timeout']}s, "
            f"retention_days={result['retention_days']}"
            + (f", ttl_secs={result['ttl_secs']}" if result["ttl_secs"] else "")
            + (f", lag_alert_secs={result['lag_alert_secs']}" if result["lag_alert_secs"] else "")
            + ")"
        )


def _describe(exc):
    if hasattr(exc, "message_dict"):
        return "; ".join(f"{field.replace('_', '-')}: {' '.join(m)}" for field, m in exc.message_dict.items())
    return " ".join(exc.messages)
