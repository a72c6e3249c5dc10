"""archive [--older-than-days D]: move acked history past retention to the Parquet archive."""

import json
from argparse import ArgumentTypeError

from django.core.management.base import BaseCommand, CommandError

from analytics.archive import ArchiveBusy, archive_history


class Command(BaseCommand):
    help = (
        "Move acknowledged history older than each queue's retention (or than D days; 0: all of "
        'it) to the Parquet archive under MQ_ARCHIVE_DIR. Prints {"messages": n, "deliveries": n}.'
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than-days",
            type=_days,
            default=None,
            metavar="D",
            help="instead of each queue's retention_days; 0 moves all acked history",
        )

    def handle(self, *args, **options):
        try:
            moved = archive_history(older_than_days=options["older_than_days"])
        except ArchiveBusy as exc:
            raise CommandError(str(exc))
        self.stdout.write(json.dumps(moved))


def _days(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ArgumentTypeError(f"must be a whole number of days, 0 or more, not {text!r}")
    return value
