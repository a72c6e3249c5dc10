"""sparkclasses [--force]: make the local Spark driver's class archive ahead of the first run."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from analytics import class_archive


class Command(BaseCommand):
    help = (
        "Make the local Spark driver's class archive (MQ_SPARK_CLASS_ARCHIVE, the JVM's AppCDS) "
        "by running the analytics job once over a tiny archive, so that the first analysis "
        "starts its JVM as fast as later ones. Nothing to do when it exists or the setting is "
        "empty; --force makes it again (after a Java or Spark upgrade)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--force", action="store_true", help="make it again if it exists")

    def handle(self, *args, **options):
        path = settings.MQ_SPARK_CLASS_ARCHIVE
        if not path:
            self.stdout.write("MQ_SPARK_CLASS_ARCHIVE is empty: no class archive")
            return
        if settings.SPARK_REMOTE:
            self.stdout.write(
                "SPARK_REMOTE is set: the Spark Connect server has its own JVM; no class archive"
            )
            return
        try:
            made = class_archive.make(path, force=options["force"])
        except RuntimeError as exc:
            raise CommandError(str(exc))
        self.stdout.write(f"{'made' if made else 'kept'} the class archive {path}")
