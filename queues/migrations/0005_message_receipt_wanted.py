# Receipts (issue 16): whether a message's publisher waits for one.

from django.db import migrations, models

# ADD COLUMN with a constant default, on both databases: PostgreSQL stores the default once (no
# rewrite of the table), SQLite adds it in place. Django's AddField would copy the whole table
# on SQLite (it cannot drop a default there), for what is one statement.
ADD = 'ALTER TABLE "queues_message" ADD COLUMN "receipt_wanted" boolean DEFAULT false NOT NULL'
DROP = 'ALTER TABLE "queues_message" DROP COLUMN "receipt_wanted"'


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0004_message_headers"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(ADD, reverse_sql=DROP)],
            state_operations=[
                migrations.AddField(
                    model_name="message",
                    name="receipt_wanted",
                    field=models.BooleanField(db_default=False, default=False, editable=False),
                ),
            ],
        ),
    ]
