"""compactarchive [--json]: one file per closed (queue, day) partition of the archive. Exits 3
when another run holds the archive."""

from django.conf import settings

from analytics.archive import ArchiveBusy
from analytics.compaction import compact_archive
from mqsite.commands import Busy, ReportCommand


class Command(ReportCommand):
    help = (
        "Rewrite each closed (queue, day) partition of the Parquet archive under MQ_ARCHIVE_DIR "
        "(its day before yesterday, UTC) that has several files as one file, rows unchanged. "
        'With --json prints {"partitions": n, "files_before": n, "files_after": n}.'
    )
    json_help = "print the counts as one JSON object"

    def report(self, *args, **options):
        self.detail(f"compactarchive: the archive in {settings.MQ_ARCHIVE_DIR}")
        with self.progress("compactarchive", unit="partitions") as progress:

            def partition(kind, queue, day, files):
                progress.step(f"{kind} of {queue} on {day}: {files} files made one")

            try:
                return compact_archive(progress=partition)
            except ArchiveBusy as exc:
                raise Busy(f"{exc}; try again when it is done") from None

    def render(self, result):
        self.say(
            "compacted {partitions} partitions: {files_before} files in the archive, "
            "now {files_after}".format(**result)
        )
