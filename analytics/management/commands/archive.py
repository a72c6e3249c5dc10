"""archive [--older-than-days D] [--json]: move acked history past retention to the Parquet
archive; prints {"messages": n, "deliveries": n}, --json or not. Exits 3 when another run
holds the archive."""

from argparse import ArgumentTypeError

from django.conf import settings

from analytics.archive import ArchiveBusy, archive_history
from mqsite.commands import Busy, ReportCommand


class Command(ReportCommand):
    help = (
        "Move acknowledged history older than each queue's retention (or than D days; 0: all of "
        'it) to the Parquet archive under MQ_ARCHIVE_DIR. Prints {"messages": n, "deliveries": n}.'
    )
    json_help = 'print {"messages": n, "deliveries": n} (as without it)'

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than-days",
            type=_days,
            default=None,
            metavar="D",
            help="instead of each queue's retention_days; 0 moves all acked history",
        )

    def report(self, *args, **options):
        self.detail(f"archive: into {settings.MQ_ARCHIVE_DIR}")
        with self.progress("archive", unit="messages") as progress:
            moved = {"messages": 0, "deliveries": 0}

            def batch(queue, messages, deliveries):
                moved["messages"] += messages
                moved["deliveries"] += deliveries
                progress.step(
                    f"{queue or 'a journaled batch'}: {messages} messages, {deliveries} deliveries "
                    f"({moved['messages']} messages so far)",
                    n=messages,
                )

            try:
                return archive_history(older_than_days=options["older_than_days"], progress=batch)
            except ArchiveBusy as exc:
                raise Busy(f"{exc}; try again when it is done") from None


def _days(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ArgumentTypeError(f"must be a whole number of days, 0 or more, not {text!r}")
    return value
