# Event schemas (issue 29): a JSON Schema per event, checked on publish (queues.schemas).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0005_message_receipt_wanted"),
    ]

    operations = [
        migrations.AddField(
            model_name="event",
            name="schema",
            field=models.JSONField(
                blank=True,
                help_text="A JSON Schema (draft 2020-12) each published payload must satisfy; empty: any payload.",
                null=True,
                verbose_name="payload schema",
            ),
        ),
        migrations.AddField(
            model_name="event",
            name="schema_updated_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="event",
            name="schema_version",
            field=models.PositiveIntegerField(db_default=0, default=0, editable=False),
        ),
    ]
