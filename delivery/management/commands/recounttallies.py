"""recounttallies: count the kept counts (delivery.tallies) again from the tables."""

from django.core.management.base import BaseCommand

from delivery import tallies


class Command(BaseCommand):
    help = (
        "Count the kept counts of deliveries, messages and webhook attempts again from the tables, "
        "holding writers off meanwhile: after rows were written with the triggers off (a bulk load "
        "under session_replication_role = replica, a restore with --disable-triggers). One scan "
        "of each table."
    )

    def handle(self, *args, **options):
        keys = tallies.recount()
        self.stdout.write(f"counted again: {keys} kept counts")
