"""Migrations are a release step (`make migrate`): `make run` (manage.py ensuremigrated) refuses
a database that lacks one, naming it, and migrates only where MQ_MIGRATE_ON_RUN says so (by
default the embedded mode's SQLite file, so that a fresh clone just runs)."""

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from dashboard.management.commands.ensuremigrated import REFUSED, unapplied


@pytest.fixture
def one_migration_behind(transactional_db):
    """The database without analytics' last migration (its tables gone), as after an upgrade
    of the code alone; migrated in full again at the end."""
    call_command("migrate", "analytics", "0002", verbosity=0)
    try:
        yield "analytics.0003_trends_and_runs"
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


def test_only_the_embedded_sqlite_default_migrates_at_start(settings):
    assert settings.MQ_MIGRATE_ON_RUN == (connection.vendor == "sqlite")
