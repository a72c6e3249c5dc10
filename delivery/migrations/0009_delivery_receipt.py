# Receipts (issue 16): a delivery of a message whose publisher waits for a receipt, and an index
# of only those of them still open.

from django.db import migrations, models

# As queues 0004: one ADD COLUMN with a constant default on both databases, no table copy.
ADD = 'ALTER TABLE "delivery_delivery" ADD COLUMN "receipt" boolean DEFAULT false NOT NULL'
DROP = 'ALTER TABLE "delivery_delivery" DROP COLUMN "receipt"'


class Migration(migrations.Migration):
    dependencies = [
        ("delivery", "0008_partial_status_indexes"),
        ("queues", "0005_message_receipt_wanted"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(ADD, reverse_sql=DROP)],
            state_operations=[
                migrations.AddField(
                    model_name="delivery",
                    name="receipt",
                    field=models.BooleanField(db_default=False, default=False, editable=False),
                ),
            ],
        ),
        # No row is a receipt's yet: the index starts empty, whatever the size of the table.
        migrations.AddIndex(
            model_name="delivery",
            index=models.Index(
                condition=models.Q(("receipt", True), ("status__in", ["pending", "inflight"])),
                fields=["message"],
                name="delivery_receipt_open",
            ),
        ),
    ]
