"""Migrations are a release step (`make migrate`) in production settings: there `make run`
(manage.py ensuremigrated) refuses a database that lacks one, naming it; it migrates where
MQ_MIGRATE_ON_RUN says so (by default off with MQ_HTTPS, on otherwise, so that a fresh clone
just runs in either mode)."""

import os
import subprocess
import sys

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from dashboard.management.commands.ensuremigrated import REFUSED, unapplied
from tests.support.servers import ROOT


@pytest.fixture
def one_migration_behind(transactional_db):
    """The database without analytics' last migration (its tables gone), as after an upgrade
    of the code alone; migrated in full again at the end."""
    graph = MigrationLoader(None).graph
    [last] = graph.leaf_nodes("analytics")
    [before] = [parent for parent in graph.node_map[last].parents if parent[0] == "analytics"]
    call_command("migrate", "analytics", before[1], verbosity=0)
    try:
        yield f"analytics.{last[1]}"
    finally:
        call_command("migrate", verbosity=0)


def test_a_database_behind_the_code_is_refused_with_what_it_lacks(one_migration_behind, settings):
    settings.MQ_MIGRATE_ON_RUN = False

    with pytest.raises(CommandError) as refused:
        call_command("ensuremigrated")

    assert refused.value.returncode == REFUSED
    message = str(refused.value)
    assert f"lacks 1 migration(s) ({one_migration_behind})" in message and "make migrate" in message
    assert [f"{m.app_label}.{m.name}" for m in unapplied()] == [one_migration_behind]  # nothing migrated


def test_where_allowed_it_migrates_instead(one_migration_behind, settings):
    settings.MQ_MIGRATE_ON_RUN = True

    call_command("ensuremigrated")

    assert unapplied() == []
    with connection.cursor() as cursor:
        assert "analytics_analyticsrun" in connection.introspection.table_names(cursor)


def test_a_migrated_database_passes_whatever_the_setting(transactional_db, settings):
    settings.MQ_MIGRATE_ON_RUN = False
    call_command("ensuremigrated")  # no error


@pytest.mark.parametrize("https, migrates", [("", "True"), ("true", "False")])
def test_make_run_migrates_by_default_except_in_production_settings(https, migrates):
    env = {**os.environ, "MQ_HTTPS": https, "DJANGO_SETTINGS_MODULE": "mqsite.settings"}
    env.pop("MQ_MIGRATE_ON_RUN", None)
    read = "import django; django.setup(); from django.conf import settings as s; print(s.MQ_MIGRATE_ON_RUN)"
    out = subprocess.run([sys.executable, "-c", read], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == migrates, out.stderr
