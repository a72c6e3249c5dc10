# Kept counts of webhook attempts (issue 18), beside those of deliveries and messages (0010):
# /metrics' mq_webhook_attempts{subscriber, outcome} without grouping the attempts table.
# Key: the attempt's delivery's queue, event and subscriber, subscription 0, and its outcome as
# the status: attempt_ok (2xx), attempt_http_error (another status), attempt_error (no answer).
# An attempt is inserted or deleted (with its delivery: Django deletes the attempts first, so
# the delivery is still there to read), never changed.

from django.db import migrations

KEY = "queue_id, event_id, subscription_id, subscriber_id, status"
OUTCOME = (
    "CASE WHEN a.ok THEN 'attempt_ok' WHEN a.status_code IS NOT NULL THEN 'attempt_http_error' "
    "ELSE 'attempt_error' END"
)

POSTGRESQL = [
    f"""
    CREATE FUNCTION delivery_tally_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT d.queue_id, d.event_id, 0, d.subscriber_id, {OUTCOME}, count(*)
            FROM new_rows a JOIN delivery_delivery d ON d.id = a.delivery_id GROUP BY 1, 2, 3, 4, 5;
        ELSE
            INSERT INTO delivery_tallychange ({KEY}, n)
            SELECT d.queue_id, d.event_id, 0, d.subscriber_id, {OUTCOME}, -count(*)
            FROM old_rows a JOIN delivery_delivery d ON d.id = a.delivery_id GROUP BY 1, 2, 3, 4, 5;
        END IF;
        RETURN NULL;
    END $$
    """,
    """CREATE TRIGGER attempt_tally_insert AFTER INSERT ON delivery_deliveryattempt
       REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_attempts()""",
    """CREATE TRIGGER attempt_tally_delete AFTER DELETE ON delivery_deliveryattempt
       REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION delivery_tally_attempts()""",
]
POSTGRESQL_DROP = [
    "DROP TRIGGER IF EXISTS attempt_tally_insert ON delivery_deliveryattempt",
    "DROP TRIGGER IF EXISTS attempt_tally_delete ON delivery_deliveryattempt",
    "DROP FUNCTION IF EXISTS delivery_tally_attempts()",
]


def _sqlite(row, sign):
    outcome = OUTCOME.replace("a.", f"{row}.")
    return f"""INSERT INTO delivery_tallychange ({KEY}, n)
        SELECT d.queue_id, d.event_id, 0, d.subscriber_id, {outcome}, {sign}
        FROM delivery_delivery d WHERE d.id = {row}.delivery_id;"""


SQLITE = [
    f"""CREATE TRIGGER attempt_tally_insert AFTER INSERT ON delivery_deliveryattempt BEGIN
        {_sqlite("new", 1)} END""",
    f"""CREATE TRIGGER attempt_tally_delete AFTER DELETE ON delivery_deliveryattempt BEGIN
        {_sqlite("old", -1)} END""",
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS attempt_tally_insert", "DROP TRIGGER IF EXISTS attempt_tally_delete"]

# As 0010: CREATE TRIGGER keeps writers out until this commits, so the seed misses nothing.
SEED = f"""INSERT INTO delivery_tally ({KEY}, n)
    SELECT d.queue_id, d.event_id, 0, d.subscriber_id, {OUTCOME}, count(*)
    FROM delivery_deliveryattempt a JOIN delivery_delivery d ON d.id = a.delivery_id GROUP BY 1, 2, 3, 4, 5"""


def install(apps, schema_editor):
    statements = POSTGRESQL if schema_editor.connection.vendor == "postgresql" else SQLITE
    for sql in statements + [SEED]:
        schema_editor.execute(sql)


def uninstall(apps, schema_editor):
    statements = POSTGRESQL_DROP if schema_editor.connection.vendor == "postgresql" else SQLITE_DROP
    for sql in statements:
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [("delivery", "0010_tallies")]

    operations = [migrations.RunPython(install, uninstall)]
