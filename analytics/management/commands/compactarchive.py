"""compactarchive [--json]: one file per closed (queue, day) partition of the archive."""

import json

from django.core.management.base import BaseCommand, CommandError

from analytics.archive import ArchiveBusy
from analytics.compaction import compact_archive


class Command(BaseCommand):
    help = (
        "Rewrite each closed (queue, day) partition of the Parquet archive under MQ_ARCHIVE_DIR "
        "(its day before yesterday, UTC) that has several files as one file, rows unchanged. "
        'With --json prints {"partitions": n, "files_before": n, "files_after": n}.'
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")

    def handle(self, *args, **options):
        try:
            result = compact_archive()
        except ArchiveBusy as exc:
            raise CommandError(str(exc))
        if options["json"]:
            self.stdout.write(json.dumps(result))
        else:
            self.stdout.write(
                "compacted {partitions} partitions: {files_before} files in the archive, "
                "now {files_after}".format(**result)
            )
