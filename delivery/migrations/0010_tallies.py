# Kept counts (issue 18): the tables, the triggers that keep them, and their first contents.
#
# The triggers are the one place that counts: every statement that changes a delivery's status
# or subscription, inserts or deletes a delivery or a message, whoever sends it (the ledger, the
# admin, a cascade, the archive), appends its net change to delivery_tallychange in its own
# transaction. PostgreSQL: one statement-level trigger per kind, over the statement's transition
# tables (one grouped INSERT per statement, however many rows it changed). SQLite has no
# statement-level triggers: one row-level trigger each, cheap in its one process.
#
# The SQL is frozen here, as migrations are: a later change of the rule is a new migration.

import django.db.models.functions.datetime
from django.db import migrations, models

KEY = "queue_id, event_id, subscription_id, subscriber_id, status"
DELIVERY_KEY = "queue_id, event_id, coalesce(subscription_id, 0), subscriber_id, status"
MESSAGE_KEY = "queue_id, event_id, 0, 0, 'published'"

POSTGRESQL = [
    f"""
    CREATE FUNCTION delivery_tally_deliveries() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT {DELIVERY_KEY}, count(*) FROM new_rows GROUP BY 1, 2, 3, 4, 5;
        ELSIF TG_OP = 'DELETE' THEN
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT {DELIVERY_KEY}, -count(*) FROM old_rows GROUP BY 1, 2, 3, 4, 5;
        ELSE
            -- Only the rows whose key changed count; an update of anything else (a lease's
            -- deadline, an extension) nets to nothing and inserts no row.
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT {KEY}, sum(n) FROM (
                SELECT {DELIVERY_KEY}, 1 FROM new_rows
                UNION ALL
                SELECT {DELIVERY_KEY}, -1 FROM old_rows
            ) AS changed ({KEY}, n)
            GROUP BY 1, 2, 3, 4, 5 HAVING sum(n) <> 0;
        END IF;
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE FUNCTION delivery_tally_messages() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT {MESSAGE_KEY}, count(*) FROM new_rows GROUP BY 1, 2;
        ELSE
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT {MESSAGE_KEY}, -count(*) FROM old_rows GROUP BY 1, 2;
        END IF;
        RETURN NULL;
    END $$
    """,
    """CREATE TRIGGER delivery_tally_insert AFTER INSERT ON delivery_delivery
       REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_deliveries()""",
    """CREATE TRIGGER delivery_tally_update AFTER UPDATE ON delivery_delivery
       REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
       FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_deliveries()""",
    """CREATE TRIGGER delivery_tally_delete AFTER DELETE ON delivery_delivery
       REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_deliveries()""",
    """CREATE TRIGGER message_tally_insert AFTER INSERT ON queues_message
       REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_messages()""",
    """CREATE TRIGGER message_tally_delete AFTER DELETE ON queues_message
       REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_messages()""",
]
POSTGRESQL_DROP = [
    "DROP TRIGGER IF EXISTS delivery_tally_insert ON delivery_delivery",
    "DROP TRIGGER IF EXISTS delivery_tally_update ON delivery_delivery",
    "DROP TRIGGER IF EXISTS delivery_tally_delete ON delivery_delivery",
    "DROP TRIGGER IF EXISTS message_tally_insert ON queues_message",
    "DROP TRIGGER IF EXISTS message_tally_delete ON queues_message",
    "DROP FUNCTION IF EXISTS delivery_tally_deliveries()",
    "DROP FUNCTION IF EXISTS delivery_tally_messages()",
]


def _sqlite_values(row, sign):
    return f"{row}.queue_id, {row}.event_id, coalesce({row}.subscription_id, 0), {row}.subscriber_id, {row}.status, {sign}"


SQLITE = [
    f"""CREATE TRIGGER delivery_tally_insert AFTER INSERT ON delivery_delivery BEGIN
        INSERT INTO delivery_tallychange ({KEY}, n) VALUES ({_sqlite_values("new", 1)}); END""",
    f"""CREATE TRIGGER delivery_tally_delete AFTER DELETE ON delivery_delivery BEGIN
        INSERT INTO delivery_tallychange ({KEY}, n) VALUES ({_sqlite_values("old", -1)}); END""",
    f"""CREATE TRIGGER delivery_tally_update AFTER UPDATE ON delivery_delivery
        WHEN old.status IS NOT new.status OR old.subscription_id IS NOT new.subscription_id
          OR old.queue_id IS NOT new.queue_id OR old.event_id IS NOT new.event_id
          OR old.subscriber_id IS NOT new.subscriber_id BEGIN
        INSERT INTO delivery_tallychange ({KEY}, n) VALUES ({_sqlite_values("old", -1)});
        INSERT INTO delivery_tallychange ({KEY}, n) VALUES ({_sqlite_values("new", 1)}); END""",
    f"""CREATE TRIGGER message_tally_insert AFTER INSERT ON queues_message BEGIN
        INSERT INTO delivery_tallychange ({KEY}, n)
        VALUES (new.queue_id, new.event_id, 0, 0, 'published', 1); END""",
    f"""CREATE TRIGGER message_tally_delete AFTER DELETE ON queues_message BEGIN
        INSERT INTO delivery_tallychange ({KEY}, n)
        VALUES (old.queue_id, old.event_id, 0, 0, 'published', -1); END""",
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS delivery_tally_insert",
    "DROP TRIGGER IF EXISTS delivery_tally_update",
    "DROP TRIGGER IF EXISTS delivery_tally_delete",
    "DROP TRIGGER IF EXISTS message_tally_insert",
    "DROP TRIGGER IF EXISTS message_tally_delete",
]

# The counts of what the tables hold when the triggers start: one scan, once. On PostgreSQL
# CREATE TRIGGER holds a lock that keeps writers out until this migration commits, so no change
# falls between the two; SQLite has one writer.
SEED = [
    f"INSERT INTO delivery_tally ({KEY}, n) SELECT {DELIVERY_KEY}, count(*) FROM delivery_delivery "
    "GROUP BY 1, 2, 3, 4, 5",
    f"INSERT INTO delivery_tally ({KEY}, n) SELECT {MESSAGE_KEY}, count(*) FROM queues_message GROUP BY 1, 2",
]


def install(apps, schema_editor):
    statements = POSTGRESQL if schema_editor.connection.vendor == "postgresql" else SQLITE
    for sql in statements + SEED:
        schema_editor.execute(sql)


def uninstall(apps, schema_editor):
    statements = POSTGRESQL_DROP if schema_editor.connection.vendor == "postgresql" else SQLITE_DROP
    for sql in statements:
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("delivery", "0009_delivery_receipt"),
        ("queues", "0005_message_receipt_wanted"),
    ]

    operations = [
        migrations.CreateModel(
            name="TallyChange",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue_id", models.BigIntegerField()),
                ("event_id", models.BigIntegerField()),
                ("subscription_id", models.BigIntegerField()),
                ("subscriber_id", models.BigIntegerField()),
                ("status", models.CharField(max_length=20)),
                ("n", models.BigIntegerField()),
                ("at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
        ),
        migrations.CreateModel(
            name="TallyActivity",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("step", models.DateTimeField()),
                ("queue_id", models.BigIntegerField()),
                ("event_id", models.BigIntegerField()),
                ("subscriber_id", models.BigIntegerField()),
                ("status", models.CharField(max_length=20)),
                ("n", models.BigIntegerField()),
            ],
            options={
                "verbose_name_plural": "tally activity",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("step", "queue_id", "event_id", "subscriber_id", "status"),
                        name="tally_activity_key",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="Tally",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("queue_id", models.BigIntegerField()),
                ("event_id", models.BigIntegerField()),
                ("subscription_id", models.BigIntegerField()),
                ("subscriber_id", models.BigIntegerField()),
                ("status", models.CharField(max_length=20)),
                ("n", models.BigIntegerField()),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("queue_id", "event_id", "subscription_id", "subscriber_id", "status"),
                        name="tally_key",
                    )
                ],
            },
        ),
        migrations.RunPython(install, uninstall),
    ]
