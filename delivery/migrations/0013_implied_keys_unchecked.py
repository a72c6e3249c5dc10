# The delivery's copies of its message's queue and event lose their database constraints: the
# fan-out copies them, in the statement that inserts the delivery, from the message, whose own
# keys to both are kept, and checking them again was two of the five foreign-key triggers a
# publish fired per delivery. The relations, their CASCADE (done by Django) and their indexes
# stay. delivery/models.py says why no orphan can follow, and why the subscriber's key stays.
#
# On SQLite, altering a column remakes the table (a copy under a new name): the tally triggers
# on it (0010) and on the attempts, which read it (0011), would fail or be lost, so they are
# dropped first and made again after. PostgreSQL only drops the two constraints.

import importlib

import django.db.models.deletion
from django.db import migrations, models

_TRIGGERS = [
    importlib.import_module(f"delivery.migrations.{m}") for m in ("0010_tallies", "0011_attempt_tallies")
]


def _drop_sqlite_triggers(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for module in _TRIGGERS:
            for sql in module.SQLITE_DROP:
                schema_editor.execute(sql)


def _make_sqlite_triggers(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for module in _TRIGGERS:
            for sql in module.SQLITE:
                schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("delivery", "0012_receipt_moves"),
        ("queues", "0005_message_receipt_wanted"),
    ]

    operations = [
        migrations.RunPython(_drop_sqlite_triggers, _make_sqlite_triggers),
        migrations.AlterField(
            model_name="delivery",
            name="event",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="queues.event",
            ),
        ),
        migrations.AlterField(
            model_name="delivery",
            name="queue",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="queues.queue",
            ),
        ),
        migrations.RunPython(_make_sqlite_triggers, _drop_sqlite_triggers),
    ]
