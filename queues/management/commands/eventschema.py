"""eventschema QUEUE EVENT FILE|- [--clear] [--json]: give an event of a queue a JSON Schema (draft
2020-12) its payloads must satisfy, read from FILE or stdin (`-`); --clear removes it."""

import json
import sys

from django.core.management.base import CommandError

from mqsite.commands import ReportCommand, UsageError
from mqsite.names import BadName
from queues import lookup, schemas


class Command(ReportCommand):
    help = (
        "Set the JSON Schema (draft 2020-12) of an event of a queue, from FILE or stdin ('-'), "
        "making the event if it does not exist yet; --clear removes it."
    )
    json_help = 'print {"queue", "event", "schema_version", "cleared"}'
    stealth_options = ("stdin",)

    def add_arguments(self, parser):
        parser.add_argument("queue")
        parser.add_argument("event")
        parser.add_argument("file", nargs="?", metavar="FILE|-", help="the schema's JSON; '-': read stdin")
        parser.add_argument("--clear", action="store_true", help="remove the event's schema")

    def report(self, *args, **options):
        queue = lookup.find_queue(options["queue"])
        if queue is None:
            raise CommandError(f"there is no queue named {options['queue']!r}")
        if options["clear"] == (options["file"] is not None):
            raise UsageError("give either FILE (or - for stdin) or --clear")
        schema = None if options["clear"] else _read(options["file"], options.get("stdin", sys.stdin))
        try:
            event = schemas.set_event_schema(queue, options["event"], schema)
        except (schemas.BadSchema, BadName) as exc:
            raise CommandError(str(exc)) from None
        return {
            "queue": queue.name,
            "event": event.name,
            "schema_version": event.schema_version,
            "cleared": schema is None,
        }

    def render(self, result):
        done = "cleared the schema of" if result["cleared"] else "set the schema of"
        self.say(f"{done} {result['queue']}/{result['event']} (version {result['schema_version']})")


def _read(path, stdin):
    try:
        if path == "-":
            text = stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CommandError(f"the schema is not JSON: {exc}") from None
    except RecursionError:
        raise CommandError("the schema is nested too deeply") from None
