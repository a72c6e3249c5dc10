"""sparkclasses [--force] [--json]: make the local Spark driver's class archive ahead of the
first run."""

import os

from django.conf import settings
from django.core.management.base import CommandError

from analytics import class_archive
from mqsite.commands import ReportCommand


class Command(ReportCommand):
    help = (
        "Make the local Spark driver's class archive (MQ_SPARK_CLASS_ARCHIVE, the JVM's AppCDS) "
        "by running the analytics job once over a tiny archive, so that the first analysis "
        "starts its JVM as fast as later ones. Nothing to do when it exists or the setting is "
        "empty; --force makes it again (after a Java or Spark upgrade)."
    )
    json_help = 'print {"path", "made", "skipped"}'

    def add_arguments(self, parser):
        parser.add_argument("--force", action="store_true", help="make it again if it exists")

    def report(self, *args, **options):
        path = settings.MQ_SPARK_CLASS_ARCHIVE
        if not path:
            return {"path": None, "made": False, "skipped": "MQ_SPARK_CLASS_ARCHIVE is empty"}
        if settings.SPARK_REMOTE:
            return {
                "path": path,
                "made": False,
                "skipped": "SPARK_REMOTE is set: the Spark Connect server has its own JVM",
            }
        if options["force"] or not os.path.exists(path):
            # A Spark run with a cold JVM: most of a minute without a word otherwise.
            self.note(f"sparkclasses: running the analytics job once to make {path}")
        try:
            made = class_archive.make(path, force=options["force"])
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
        if not made:
            self.detail(f"sparkclasses: {path} exists; --force makes it again")
        return {"path": path, "made": made, "skipped": None}

    def render(self, result):
        if result["skipped"]:
            self.say(f"{result['skipped']}; no class archive")
        else:
            self.say(f"{'made' if result['made'] else 'kept'} the class archive {result['path']}")
