"""queuestats [--json]: per queue and event, published and deliveries by state; per ordered
queue with work, its message groups (lines with work, groups, oldest heads)."""

from delivery import tallies
from delivery.reports import FIELDS, group_stats, queue_stats
from mqsite.commands import ReportCommand


class Command(ReportCommand):
    help = "Show per queue and event: published, pending, in flight, acked, dead, connected."
    # A read an operator (or a monitoring script) runs often and waits for: without the system
    # checks' pass over the URLs and models (0.15 s), as Django's own showmigrations.
    requires_system_checks = []

    json_help = 'print {"queues": [...], "groups": [...]}'

    def report(self, *args, **options):
        tallies.fold()  # exact either way; folded, the read sums a handful of rows
        rows = queue_stats()
        groups = group_stats()
        # "groups" only when an ordered queue has work: the answer is otherwise as it was.
        return {"queues": rows, **({"groups": groups} if groups else {})}

    def render(self, result):
        rows, groups = result["queues"], result.get("groups", [])
        if not rows:
            self.stdout.write("no queues")
            return
        # Headers are the JSON keys: one word each, so the columns split on whitespace.
        table = [list(FIELDS)]
        table += [[_cell(row[f]) for f in FIELDS] for row in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(FIELDS))]
        for r in table:
            # Names left, numbers right.
            cells = [
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            self.stdout.write("  ".join(cells).rstrip())
        for g in groups:
            heads = ", ".join(
                f"#{h['seq']} {h['group'] or '(default)'} {h['status']}" for h in g["oldest_heads"]
            )
            self.stdout.write(
                f"{g['queue']}: {g['groups']} groups with work in {g['lines']} lines; oldest heads {heads}"
            )


def _cell(value):
    return "-" if value is None else str(value)
