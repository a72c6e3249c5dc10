"""prunearchive [--older-than-days N] [--json]: delete the archive's (queue, day) partitions
older than MQ_ARCHIVE_RETENTION_DAYS (or N days). Exits 3 when another run holds the archive."""

from django.conf import settings

from analytics.archive import ArchiveBusy
from analytics.retention import prune_archive
from mqsite.commands import Busy, ReportCommand, UsageError


class Command(ReportCommand):
    help = (
        "Delete whole (queue, day) partitions of the Parquet archive under MQ_ARCHIVE_DIR older "
        "than MQ_ARCHIVE_RETENTION_DAYS days (today, UTC, and that many days before it are kept; "
        "0, the default: nothing is deleted), or than --older-than-days. "
        'With --json prints {"partitions": n, "files": n, "bytes": n} deleted.'
    )
    json_help = "print the counts as one JSON object"

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than-days",
            type=int,
            default=None,
            metavar="N",
            help="keep today and the N days before it, instead of MQ_ARCHIVE_RETENTION_DAYS",
        )

    def report(self, *args, **options):
        days = options["older_than_days"]
        if days is not None and days < 1:
            raise UsageError(f"--older-than-days must be 1 or more, not {days}")
        self.detail(f"prunearchive: the archive in {settings.MQ_ARCHIVE_DIR}")
        with self.progress("prunearchive", unit="partitions") as progress:

            def partition(queue, day, files):
                progress.step(f"{queue} on {day}: {files} files deleted")

            try:
                return prune_archive(days=days, progress=partition)
            except ArchiveBusy as exc:
                raise Busy(f"{exc}; try again when it is done") from None

    def render(self, result):
        self.say("deleted {partitions} partitions: {files} files, {bytes} bytes".format(**result))
