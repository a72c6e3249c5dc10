# Partial status indexes and autovacuum settings for the delivery table (bench/PROFILE.md, section 9).

from django.db import migrations, models

# Autovacuum for the delivery table. Every lease, ack and retry leaves a dead row version and
# dead entries in the indexes; the defaults (a vacuum after 20 % of the table is dead) wait for
# 2 million dead rows on a table of 10 million, while the lease's index scans walk over every
# dead entry of the hot end. 2 % (plus 1,000) lets it run well before that, without a throttle
# that would make it fall behind the churn; ANALYZE as often, so that a new busy subscription
# is not planned as "1 row". Inserts alone (fan-out, then acks much later) trigger it too, which
# keeps the visibility map current. No fillfactor: status is in an index, so no update of it
# can be HOT, and free space on a page would only make the table larger.
AUTOVACUUM = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_insert_scale_factor": "0.02",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_delay": "0",
}


def _storage(apps, schema_editor, set_them):
    """Set (or reset) the table's autovacuum parameters; PostgreSQL only (SQLite has none)."""
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("delivery", "Delivery")._meta.db_table)
    if set_them:
        params = ", ".join(f"{name} = {value}" for name, value in AUTOVACUUM.items())
        schema_editor.execute(f"ALTER TABLE {table} SET ({params})")
    else:
        schema_editor.execute(f"ALTER TABLE {table} RESET ({', '.join(AUTOVACUUM)})")


def set_autovacuum(apps, schema_editor):
    _storage(apps, schema_editor, True)


def reset_autovacuum(apps, schema_editor):
    _storage(apps, schema_editor, False)


class Migration(migrations.Migration):
    dependencies = [
        ("delivery", "0007_attempt_permanent"),
    ]

    # The new indexes first, so the lease never runs without one. delivery_due,
    # delivery_overdue and delivery_acked_at keep their names with new definitions: dropped,
    # then made again.
    operations = [
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("status", "pending")), fields=["subscription", "seq"], name="delivery_ready"
            ),
        ),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("status", "dead")), fields=["next_attempt_at", "id"], name="delivery_dead"
            ),
        ),
        migrations.RemoveIndex(model_name="delivery", name="delivery_lease"),
        migrations.RemoveIndex(model_name="delivery", name="delivery_due"),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("status", "pending")), fields=["subscriber", "next_attempt_at"], name="delivery_due"
            ),
        ),
        migrations.RemoveIndex(model_name="delivery", name="delivery_overdue"),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("status", "inflight")), fields=["ack_deadline"], name="delivery_overdue"
            ),
        ),
        migrations.RemoveIndex(model_name="delivery", name="delivery_acked_at"),
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("acked_at__isnull", False)), fields=["acked_at"], name="delivery_acked_at"
            ),
        ),
        migrations.RunPython(set_autovacuum, reset_autovacuum, elidable=False),
    ]
