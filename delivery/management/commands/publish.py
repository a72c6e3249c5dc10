"""publish QUEUE EVENT [PAYLOAD_JSON] [--key K] [--header NAME=VALUE ...] [--delay-secs N |
--deliver-at TIME] [--ttl-secs N | --expires-at TIME] [--json]: publish as an operator; prints the
REST publish answer (one JSON object, --json or not)."""

import json
import sys

from django.core.management.base import CommandError

from delivery import publishing
from mqsite.commands import ReportCommand
from queues import lookup
from queues.headers import BadHeaders, headers_of_pairs


class Command(ReportCommand):
    help = "Publish one message as an operator; the payload is read from stdin when not given."
    json_help = "print the answer (as without it: the REST publish answer)"
    stealth_options = ("stdin",)

    def add_arguments(self, parser):
        parser.add_argument("queue")
        parser.add_argument("event")
        parser.add_argument("payload", nargs="?", metavar="PAYLOAD_JSON", help="default: read stdin")
        parser.add_argument("--key", help="idempotency key: the same key again answers the first message")
        parser.add_argument(
            "--header",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="a header the message carries (repeatable), e.g. --header traceparent=00-...",
        )
        # queues.timing checks them, as for every way in.
        parser.add_argument(
            "--delay-secs", type=float, metavar="N", help="delayed: handed out N seconds from now"
        )
        parser.add_argument("--deliver-at", metavar="TIME", help="delayed: handed out at this ISO 8601 time")
        parser.add_argument(
            "--ttl-secs", type=float, metavar="N", help="expires N seconds after it falls due"
        )
        parser.add_argument("--expires-at", metavar="TIME", help="expires at this ISO 8601 time")

    def report(self, *args, **options):
        queue = lookup.find_queue(options["queue"])
        if queue is None:
            raise CommandError(f"there is no queue named {options['queue']!r}")
        text = options["payload"]
        if text is None:
            text = options.get("stdin", sys.stdin).read()
        try:
            payload = json.loads(text)
        except ValueError as exc:
            raise CommandError(f"the payload is not JSON: {exc}") from None
        except RecursionError:
            raise CommandError("the payload is nested too deeply") from None
        try:
            headers = headers_of_pairs(options["header"])
            outgoing = publishing.prepare(
                options["event"], payload, options["key"], headers, **publishing.timing_fields(options)
            )
        except (BadHeaders, publishing.BadMessageHeaders) as exc:
            raise CommandError(f"--header: {exc}") from None
        except publishing.BadMessageTiming as exc:
            raise CommandError(f"--{exc.field.replace('_', '-')}: {exc}") from None
        except publishing.BadMessage as exc:
            raise CommandError(str(exc)) from None
        try:
            [(answer, _created)] = publishing.publish(queue, [outgoing], publisher=None)
        except publishing.SchemaMismatch as exc:
            failures = "; ".join(f"{e['path'] or '(the payload)'} {e['message']}" for e in exc.errors)
            raise CommandError(f"{exc} {failures}") from None
        return answer  # printed as JSON, times as the REST API writes them
