"""recounttallies [--json]: count the kept counts (delivery.tallies) again from the tables."""

from delivery import tallies
from mqsite.commands import ReportCommand


class Command(ReportCommand):
    help = (
        "Count the kept counts of deliveries, messages and webhook attempts again from the tables, "
        "holding writers off meanwhile: after rows were written with the triggers off (a bulk load "
        "under session_replication_role = replica, a restore with --disable-triggers). One scan "
        "of each table."
    )
    json_help = 'print {"kept_counts": n}'

    def report(self, *args, **options):
        self.detail("recounttallies: writers wait until the new counts are committed")
        with self.progress("recounttallies", total=len(tallies.RECOUNT_STEPS)) as progress:
            keys = tallies.recount(progress=progress.step)
        return {"kept_counts": keys}

    def render(self, result):
        self.say(f"counted again: {result['kept_counts']} kept counts")
