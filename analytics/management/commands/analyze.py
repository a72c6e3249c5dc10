"""analyze [--json] [--since DATE] [--until DATE]: the analytics over the archive and the hot
tables (analytics.analysis)."""

import json
from argparse import ArgumentTypeError
from datetime import date

from django.core.management.base import BaseCommand, CommandError

from analytics.analysis import AnalysisBusy, default_out, run_analysis


class Command(BaseCommand):
    help = (
        "Compute the statistics over the Parquet archive and the hot tables, recomputing only the "
        "archived days that changed, and store them (the admin, /metrics, GET /api/analytics). "
        "With --since/--until, over those days only (both included), printed but not stored. "
        "With --json, print them."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--json", action="store_true", help='print {"events": [...], "subscribers": [...]}'
        )
        parser.add_argument(
            "--since", type=_day, default=None, metavar="DATE", help="first day (UTC), YYYY-MM-DD"
        )
        parser.add_argument(
            "--until", type=_day, default=None, metavar="DATE", help="last day (UTC), YYYY-MM-DD"
        )
        parser.add_argument(
            "--out",
            default=None,
            help="where the run folders go (default: MQ_ARCHIVE_DIR/_analytics)",
        )
        parser.add_argument("--master", default=None, help="Spark master (default: SPARK_MASTER)")

    def handle(self, *args, **options):
        since, until = options["since"], options["until"]
        if since and until and since > until:
            raise CommandError(f"--since {since} is after --until {until}")
        out = options["out"] or default_out()
        try:
            results = run_analysis(out=out, master=options["master"], since=since, until=until)
        except AnalysisBusy as exc:
            raise CommandError(f"{exc}; try again when it is done") from exc
        if options["json"]:
            self.stdout.write(json.dumps(results))
            return
        stored = "not stored (a window)" if since or until else "results in the admin"
        self.stdout.write(
            f"{len(results['events'])} events and {len(results['subscribers'])} subscribers; {stored}, "
            f"run folders under {out}"
        )


def _day(text):
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None
