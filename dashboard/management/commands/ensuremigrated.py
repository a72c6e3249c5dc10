"""ensuremigrated: run by `make run` before anything serves. In production settings migrations
are a release step (`make migrate`): a database whose schema is behind the code is refused with
the list of what is missing, rather than migrated behind the operator's back (a migration may
lock a table for minutes, and wants a backup first). Elsewhere (MQ_MIGRATE_ON_RUN, on by default
unless MQ_HTTPS) it is migrated here, so that a fresh clone's `make run` just works."""

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
from django.db.migrations.executor import MigrationExecutor

from mqsite.commands import EXIT_ERROR, ReportCommand

# The exit status of a refusal, which `make run` stops on: an error (mqsite.commands), not
# "busy", since waiting does not help.
REFUSED = EXIT_ERROR


def unapplied(alias=DEFAULT_DB_ALIAS):
    """The migrations the database lacks, in the order `migrate` would apply them."""
    executor = MigrationExecutor(connections[alias])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [migration for migration, backwards in plan if not backwards]


class Command(ReportCommand):
    json_help = "print {missing: [app.migration, ...], migrated: true|false} as one JSON object"
    help = (
        "Refuse (exit 1) when the database lacks migrations, naming them; migrate instead where "
        "MQ_MIGRATE_ON_RUN is on (by default, unless MQ_HTTPS: production settings)."
    )

    def report(self, *args, **options):
        try:
            missing = unapplied()
        except OperationalError as exc:  # not a traceback: what is wrong, in one line
            raise CommandError(
                f"cannot read the database's migrations (DATABASE_URL): {exc}".strip()
            ) from exc
        labels = [f"{m.app_label}.{m.name}" for m in missing]
        if not missing:
            return {"missing": [], "migrated": False}
        if settings.MQ_MIGRATE_ON_RUN:
            call_command(
                "migrate", interactive=False, verbosity=max(0, options["verbosity"] - 1), stdout=self.stderr
            )
            return {"missing": labels, "migrated": True}
        names = ", ".join(labels[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CommandError(
            f"the database lacks {len(missing)} migration(s) ({names}{more}). Migrations are a release "
            "step: back the database up, run `make migrate` (manage.py migrate), then start again "
            "(docs/operations/index.md, Upgrading). MQ_MIGRATE_ON_RUN=true migrates at every start instead.",
            returncode=REFUSED,
        )

    def render(self, result):
        if result["migrated"]:
            self.say(f"migrated {len(result['missing'])} migration(s)")
