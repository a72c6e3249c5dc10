"""analyze [--json] [--since DATE] [--until DATE]: the analytics over the archive and the hot
tables (analytics.analysis). Exits 3 when another run holds the archive. analyze --parts DIR:
the figures of what a spark-submitted analytics/job.py wrote (analytics.submitted)."""

from argparse import ArgumentTypeError
from datetime import date

from django.conf import settings
from django.utils import timezone

from analytics import submitted
from analytics.analysis import AnalysisBusy, default_out, run_analysis
from mqsite.commands import Busy, ReportCommand, UsageError


class Command(ReportCommand):
    help = (
        "Compute the statistics over the Parquet archive and the hot tables, recomputing only the "
        "archived days that changed, and store them (the admin, /metrics, GET /api/analytics). "
        "With --since/--until, over those days only (both included), printed but not stored. "
        "With --json, print them. With --parts DIR, the figures of what "
        "`spark-submit analytics/job.py --out DIR` wrote, printed but not stored."
    )
    json_help = 'print {"events": [...], "subscribers": [...]}'
    # The system checks import every URLconf, view and admin (half a second of a run that
    # takes a second when nothing is new); the server's processes run them when they start.
    requires_system_checks = []

    def add_arguments(self, parser):
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
        parser.add_argument(
            "--parts",
            default=None,
            metavar="DIR",
            help="print the figures of a spark-submitted job's output (its --out) instead: "
            "those archive files only, no Spark, nothing stored",
        )

    def report(self, *args, **options):
        since, until = options["since"], options["until"]
        if since and until and since > until:
            raise UsageError(f"--since {since} is after --until {until}")
        if options["parts"]:
            return self._parts(options)
        self._parts_dir = None
        self._out = options["out"] or default_out()
        self._window = bool(since or until)
        self.detail(f"analyze: the archive in {settings.MQ_ARCHIVE_DIR}, run folders under {self._out}")
        with self.progress("analyze") as progress:
            try:
                return run_analysis(
                    out=self._out, master=options["master"], since=since, until=until, progress=progress.step
                )
            except AnalysisBusy as exc:
                raise Busy(f"{exc}; try again when it is done") from None

    def _parts(self, options):
        clashing = [f"--{name}" for name in ("since", "until", "out", "master") if options[name]]
        if clashing:
            raise UsageError(f"--parts reads a job's output: it takes no {', '.join(clashing)}")
        self._parts_dir = options["parts"]
        try:
            return submitted.figures_of(self._parts_dir, now=timezone.now())
        except submitted.NoParts as exc:
            raise UsageError(str(exc)) from None

    def render(self, result):
        if self._parts_dir:
            self.say(
                f"{len(result['events'])} events and {len(result['subscribers'])} subscribers "
                f"of the job's output in {self._parts_dir}; not stored"
            )
            return
        stored = "not stored (a window)" if self._window else "results in the admin"
        self.say(
            f"{len(result['events'])} events and {len(result['subscribers'])} subscribers; {stored}, "
            f"run folders under {self._out}"
        )


def _day(text):
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None
