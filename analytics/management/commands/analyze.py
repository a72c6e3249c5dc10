"""analyze [--json]: run the Spark job over the archive and the recent rows, store its results."""

import json

from django.conf import settings
from django.core.management.base import BaseCommand

from analytics.analysis import default_out, run_analysis


class Command(BaseCommand):
    help = (
        "Run the Spark job over the Parquet archive and the hot tables and store the statistics "
        "(shown in the admin). With --json, print them."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--json", action="store_true", help='print {"events": [...], "subscribers": [...]}'
        )
        parser.add_argument(
            "--out",
            default=None,
            help="where the job writes its Parquet results (default: MQ_ARCHIVE_DIR/_analytics)",
        )
        parser.add_argument("--master", default=None, help="Spark master (default: SPARK_MASTER)")

    def handle(self, *args, **options):
        out = options["out"] or default_out()
        results = run_analysis(out=out, master=options["master"] or settings.SPARK_MASTER)
        if options["json"]:
            self.stdout.write(json.dumps(results))
            return
        self.stdout.write(
            f"{len(results['events'])} events and {len(results['subscribers'])} subscribers; "
            f"results in the admin and under {out}"
        )
