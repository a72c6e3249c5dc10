# Message groups (issue 29): a delivery's line (grp) and its head mark, the indexes of the
# ordered lease, and the triggers that keep the mark (delivery/lines.py says why triggers, and
# the lock they take against a publish). The SQL is frozen here, as migrations are.
#
# On SQLite, adding `head` remakes the table: the tally triggers on it (0010) and on the
# attempts (0011) are dropped first and made again after, as 0013 does.

import importlib

from django.db import migrations, models

_TALLIES = [
    importlib.import_module(f"delivery.migrations.{m}") for m in ("0010_tallies", "0011_attempt_tallies")
]

LINES_LOCK = 2029  # delivery.lines.LINES_LOCK
OPEN = "('pending', 'inflight')"

POSTGRESQL = [
    # A delivery joining a line is its head when the line has no open head. The lines lock of
    # its queue first (exclusive; its publish holds the queue row anyway), then a look with a
    # fresh snapshot (a volatile function's query), which sees a closing head's commit.
    f"""
    CREATE FUNCTION delivery_line_join() RETURNS trigger LANGUAGE plpgsql VOLATILE AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock({LINES_LOCK}, (NEW.queue_id %% 2147483648)::integer);
        NEW.head := NOT EXISTS (
            SELECT 1 FROM delivery_delivery d
            WHERE d.subscription_id = NEW.subscription_id AND d.grp = NEW.grp
              AND d.head AND d.status IN {OPEN});
        RETURN NEW;
    END $$
    """,
    # A head that closed hands the mark to its line's lowest pending delivery. Found none, it
    # takes the lines lock shared (waiting for a publish into its queue under way) and looks
    # again. A candidate closed meanwhile (its UPDATE finds it no longer pending): the next.
    f"""
    CREATE FUNCTION delivery_line_next() RETURNS trigger LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        locked boolean := false;
        next_id bigint;
    BEGIN
        LOOP
            SELECT p.id INTO next_id FROM delivery_delivery p
            WHERE p.subscription_id = OLD.subscription_id AND p.grp = OLD.grp AND p.status = 'pending'
            ORDER BY p.seq LIMIT 1;
            IF next_id IS NULL THEN
                EXIT WHEN locked;
                PERFORM pg_advisory_xact_lock_shared({LINES_LOCK}, (OLD.queue_id %% 2147483648)::integer);
                locked := true;
            ELSE
                UPDATE delivery_delivery SET head = true WHERE id = next_id AND status = 'pending';
                EXIT WHEN FOUND;
            END IF;
        END LOOP;
        RETURN NULL;
    END $$
    """,
    """CREATE TRIGGER delivery_line_join BEFORE INSERT ON delivery_delivery
       FOR EACH ROW WHEN (NEW.grp IS NOT NULL) EXECUTE FUNCTION delivery_line_join()""",
    f"""CREATE TRIGGER delivery_line_next AFTER UPDATE OF status ON delivery_delivery
       FOR EACH ROW WHEN (OLD.head AND OLD.status IN {OPEN} AND NEW.status NOT IN {OPEN})
       EXECUTE FUNCTION delivery_line_next()""",
    f"""CREATE TRIGGER delivery_line_gone AFTER DELETE ON delivery_delivery
       FOR EACH ROW WHEN (OLD.head AND OLD.status IN {OPEN}) EXECUTE FUNCTION delivery_line_next()""",
]
POSTGRESQL_DROP = [
    "DROP TRIGGER IF EXISTS delivery_line_join ON delivery_delivery",
    "DROP TRIGGER IF EXISTS delivery_line_next ON delivery_delivery",
    "DROP TRIGGER IF EXISTS delivery_line_gone ON delivery_delivery",
    "DROP FUNCTION IF EXISTS delivery_line_join()",
    "DROP FUNCTION IF EXISTS delivery_line_next()",
]

# SQLite: one writer at a time, no lock. It cannot set NEW in a trigger: the joining row is
# marked by an UPDATE after its insert (its row triggers run row by row, so the next row of
# the same INSERT sees the mark).
_NEXT = """UPDATE delivery_delivery SET head = 1 WHERE id = (
        SELECT p.id FROM delivery_delivery p
        WHERE p.subscription_id = old.subscription_id AND p.grp = old.grp AND p.status = 'pending'
        ORDER BY p.seq LIMIT 1);"""
SQLITE = [
    f"""CREATE TRIGGER delivery_line_join AFTER INSERT ON delivery_delivery WHEN new.grp IS NOT NULL BEGIN
        UPDATE delivery_delivery SET head = 1 WHERE id = new.id AND NOT EXISTS (
            SELECT 1 FROM delivery_delivery d
            WHERE d.subscription_id = new.subscription_id AND d.grp = new.grp
              AND d.head AND d.status IN {OPEN}); END""",
    f"""CREATE TRIGGER delivery_line_next AFTER UPDATE OF status ON delivery_delivery
        WHEN old.head AND old.status IN {OPEN} AND new.status NOT IN {OPEN} BEGIN {_NEXT} END""",
    f"""CREATE TRIGGER delivery_line_gone AFTER DELETE ON delivery_delivery
        WHEN old.head AND old.status IN {OPEN} BEGIN {_NEXT} END""",
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS delivery_line_join",
    "DROP TRIGGER IF EXISTS delivery_line_next",
    "DROP TRIGGER IF EXISTS delivery_line_gone",
]

# The open deliveries of ordered queues already there join the default line ("": no message
# had a group before), and each line gets its head: the lowest-seq one in flight, else the
# lowest-seq pending one (what the lease chose before).
_FIRST = """UPDATE delivery_delivery SET head = {true} WHERE id IN (
        SELECT (SELECT p.id FROM delivery_delivery p
                WHERE p.subscription_id = l.subscription_id AND p.grp = l.grp AND p.status = '{status}'
                ORDER BY p.seq LIMIT 1)
        FROM (SELECT DISTINCT subscription_id, grp FROM delivery_delivery
              WHERE grp IS NOT NULL AND status = '{status}') l
        WHERE NOT EXISTS (SELECT 1 FROM delivery_delivery d
                          WHERE d.subscription_id = l.subscription_id AND d.grp = l.grp
                            AND d.head AND d.status IN {open}))"""
BACKFILL = [
    f"""UPDATE delivery_delivery SET grp = '' WHERE status IN {OPEN}
        AND queue_id IN (SELECT id FROM queues_queue WHERE ordered = {{true}})""",
    _FIRST.replace("{status}", "inflight"),
    _FIRST.replace("{status}", "pending"),
]


def install(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    true = "true" if vendor == "postgresql" else "1"
    for sql in BACKFILL:
        schema_editor.execute(sql.format(true=true, open=OPEN))
    for sql in POSTGRESQL if vendor == "postgresql" else SQLITE:
        schema_editor.execute(sql)


def uninstall(apps, schema_editor):
    for sql in POSTGRESQL_DROP if schema_editor.connection.vendor == "postgresql" else SQLITE_DROP:
        schema_editor.execute(sql)


def _drop_sqlite_tallies(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for module in _TALLIES:
            for sql in module.SQLITE_DROP:
                schema_editor.execute(sql)


def _make_sqlite_tallies(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for module in _TALLIES:
            for sql in module.SQLITE:
                schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("delivery", "0014_delivery_expiry"),
        ("queues", "0008_message_group"),
        ("subscribers", "0008_subscription_filters"),
    ]

    operations = [
        migrations.RunPython(_drop_sqlite_tallies, _make_sqlite_tallies),
        migrations.AddField(
            model_name="delivery",
            name="grp",
            field=models.CharField(blank=True, editable=False, max_length=128, null=True),
        ),
        migrations.AddField(
            model_name="delivery",
            name="head",
            field=models.BooleanField(db_default=False, default=False, editable=False),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("head", True), ("status", "pending")),
                fields=["subscription", "seq"],
                name="delivery_heads",
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("grp__isnull", False), ("status", "pending")),
                fields=["subscription", "grp", "seq"],
                name="delivery_line_pending",
            ),
        ),
        migrations.AddConstraint(
            model_name="delivery",
            constraint=models.UniqueConstraint(
                condition=models.Q(("head", True), ("status__in", ["pending", "inflight"])),
                fields=("subscription", "grp"),
                name="delivery_one_head_per_line",
            ),
        ),
        migrations.RunPython(_make_sqlite_tallies, _drop_sqlite_tallies),
        migrations.RunPython(install, uninstall),
    ]
