"""Kept counts of the hot tables: what operators' pages and the dashboard count, read from a
table with a row per (queue, event, subscription, subscriber, status) instead of a scan of
millions of delivery rows.

Database triggers keep them (delivery migration 0010): each statement that inserts or deletes
a delivery or a message, or changes a delivery's status or subscription, appends its net change
to TallyChange in the same transaction, so a count is exact at any commit, whoever wrote (the
ledger, the admin, a cascade, the archive). The changes are appends, not updates of a shared
row, so concurrent acks of one subscription never wait on each other for a counter. `fold()`
moves them into Tally (the sweep does, every second); a read sums both tables in one statement,
so it is exact whether or not the last changes were folded.

Statuses: a delivery's (pending, inflight, acked, dead); PUBLISHED for the messages still in the
hot tables, with subscription and subscriber 0; and ATTEMPT_OUTCOMES for the webhook attempts,
with subscription 0.
"""

from django.db import connection, transaction
from django.db.models import IntegerField, OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce

from mqsite import rows

from .models import Tally, TallyChange

PUBLISHED = "published"
# A webhook attempt's outcome (delivery migration 0011): 2xx, another status, no answer.
ATTEMPT_OUTCOMES = ("attempt_ok", "attempt_http_error", "attempt_error")
KEY = ("queue_id", "event_id", "subscription_id", "subscriber_id", "status")
_COLUMNS = ", ".join(KEY)
# TallyActivity's step, and how long it is kept: the dashboard's charts span five minutes.
ACTIVITY_STEP_SECS = 10
ACTIVITY_KEEP_SECS = 600

# The publishes and acks a change counts: its positive part (a negative one is the archive or
# a delete taking rows away, or a seek reopening acked ones), and not the acked rows an
# unsubscribe moves to subscription 0.
_ACTIVE = "n > 0 AND (status = 'published' OR (status = 'acked' AND subscription_id <> 0))"


def _activity(source, step):
    """INSERT of the publishes and acks among the changes in `source` into TallyActivity, per
    step: by (queue, event), and the acks by subscriber too."""
    return f"""INSERT INTO delivery_tallyactivity (step, queue_id, event_id, subscriber_id, status, n)
        SELECT step, queue_id, event_id, subscriber_id, status, sum(n) FROM (
            SELECT {step} AS step, queue_id, event_id, 0 AS subscriber_id, status, n
            FROM {source} AND {_ACTIVE}
            UNION ALL
            SELECT {step}, 0, 0, subscriber_id, status, n FROM {source} AND {_ACTIVE} AND status = 'acked'
        ) AS active WHERE true GROUP BY step, queue_id, event_id, subscriber_id, status
        ON CONFLICT (step, queue_id, event_id, subscriber_id, status)
        DO UPDATE SET n = delivery_tallyactivity.n + excluded.n"""


# The start of a change's step, in each database's words.
_STEP_POSTGRESQL = (
    f"to_timestamp(floor(extract(epoch FROM at) / {ACTIVITY_STEP_SECS}) * {ACTIVITY_STEP_SECS})"
)
# (%% is one % once the parameters are filled in.)
_STEP_SQLITE = (
    f"datetime(CAST(strftime('%%s', at) AS INTEGER) / {ACTIVITY_STEP_SECS} * {ACTIVITY_STEP_SECS}, "
    "'unixepoch')"
)

# PostgreSQL: take what is committed and add it up, in one statement. A concurrent fold waits
# for the rows this one deletes and then skips them: no change is counted twice.
_FOLD_POSTGRESQL = [
    f"""WITH moved AS (DELETE FROM delivery_tallychange RETURNING {_COLUMNS}, n, at),
        counted AS (
            INSERT INTO delivery_tally ({_COLUMNS}, n)
            SELECT {_COLUMNS}, sum(n) FROM moved GROUP BY {_COLUMNS}
            ON CONFLICT ({_COLUMNS}) DO UPDATE SET n = delivery_tally.n + EXCLUDED.n
        )
        {_activity("moved WHERE true", _STEP_POSTGRESQL)}""",
    # Statements of their own: the parts of one statement all see the tables as they were.
    # Keys that came to zero (a subscription emptied or gone) are dropped, so the table keeps
    # to what exists; activity older than the charts is dropped.
    "DELETE FROM delivery_tally WHERE n = 0",
    f"DELETE FROM delivery_tallyactivity WHERE step < now() - interval '{ACTIVITY_KEEP_SECS} seconds'",
]
# SQLite has one writer: within the write transaction nothing else appends, so "up to the
# highest id" is every change there is.
_FOLD_SQLITE = [
    f"""INSERT INTO delivery_tally ({_COLUMNS}, n)
        SELECT {_COLUMNS}, sum(n) FROM delivery_tallychange WHERE id <= %(last)s GROUP BY {_COLUMNS}
        ON CONFLICT ({_COLUMNS}) DO UPDATE SET n = n + excluded.n""",
    _activity(
        "delivery_tallychange WHERE id <= %(last)s",
        _STEP_SQLITE,
    ),
    "DELETE FROM delivery_tallychange WHERE id <= %(last)s",
    "DELETE FROM delivery_tally WHERE n = 0",
    f"DELETE FROM delivery_tallyactivity WHERE step < datetime('now', '-{ACTIVITY_KEEP_SECS} seconds')",
]


def fold():
    """Move the appended changes into the kept counts. Cheap when there are few; safe to run
    from any number of processes at once."""
    if connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cursor:
            for sql in _FOLD_POSTGRESQL:
                cursor.execute(sql)
        return
    with rows.writing(), transaction.atomic():
        last = TallyChange.objects.order_by("-id").values_list("id", flat=True).first()
        if last is None:
            return
        with connection.cursor() as cursor:
            for sql in _FOLD_SQLITE:
                cursor.execute(sql, {"last": last})


# What the kept counts must hold, counted from the tables (as migrations 0010 and 0011 seed
# them, which keep their own frozen copy): for recount().
_DELIVERY_KEY = "queue_id, event_id, coalesce(subscription_id, 0), subscriber_id, status"
_OUTCOME = (
    "CASE WHEN a.ok THEN 'attempt_ok' WHEN a.status_code IS NOT NULL THEN 'attempt_http_error' "
    "ELSE 'attempt_error' END"
)
# (what it did, its statement): a long recount says how far it is (manage.py recounttallies).
RECOUNT_STEPS = [
    ("dropped the kept counts", "DELETE FROM delivery_tallychange"),
    ("dropped the kept counts", "DELETE FROM delivery_tally"),
    (
        "counted the deliveries",
        f"""INSERT INTO delivery_tally ({_COLUMNS}, n)
        SELECT {_DELIVERY_KEY}, count(*) FROM delivery_delivery GROUP BY 1, 2, 3, 4, 5""",
    ),
    (
        "counted the messages",
        f"""INSERT INTO delivery_tally ({_COLUMNS}, n)
        SELECT queue_id, event_id, 0, 0, '{PUBLISHED}', count(*) FROM queues_message GROUP BY 1, 2""",
    ),
    (
        "counted the webhook attempts",
        f"""INSERT INTO delivery_tally ({_COLUMNS}, n)
        SELECT d.queue_id, d.event_id, 0, d.subscriber_id, {_OUTCOME}, count(*)
        FROM delivery_deliveryattempt a JOIN delivery_delivery d ON d.id = a.delivery_id
        GROUP BY 1, 2, 3, 4, 5""",
    ),
]


def recount(progress=None):
    """Count the kept counts again from the tables: one scan of each, writers held off
    meanwhile. For rows written with the triggers off: a bulk load under
    session_replication_role = replica (bench/growth.py), a restore with --disable-triggers.
    Calls `progress(what)` after each of RECOUNT_STEPS. Returns how many keys it counted."""
    with rows.writing(), transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # SHARE: reads go on, writes wait until the new counts are committed with them.
            cursor.execute(
                "LOCK TABLE delivery_delivery, queues_message, delivery_deliveryattempt IN SHARE MODE"
            )
        for what, sql in RECOUNT_STEPS:
            cursor.execute(sql)
            if progress is not None:
                progress(what)
    return Tally.objects.count()


def counts(by, **where):
    """{values of the fields `by`: count} over the kept counts that match `where` (field
    lookups on Tally), in one statement over both tables, so exact at its snapshot. Keys whose
    count is 0 are left out. `by` names fields of KEY, e.g. ("queue_id", "event_id", "status")."""
    by = tuple(by)
    kept = Tally.objects.filter(**where).order_by().values_list(*by).annotate(total=Sum("n"))
    changed = TallyChange.objects.filter(**where).order_by().values_list(*by).annotate(total=Sum("n"))
    out = {}
    for *key, n in kept.union(changed, all=True):
        key = tuple(key) if len(by) > 1 else key[0]
        out[key] = out.get(key, 0) + n
    return {key: n for key, n in out.items() if n}


def regroup(kept, by):
    """Sum counts keyed by the full KEY (counts(KEY)) into counts keyed by the fields `by`:
    several views from one read, all of the same instant."""
    at = [KEY.index(field) for field in by]
    out = {}
    for key, n in kept.items():
        short = tuple(key[i] for i in at) if len(at) > 1 else key[at[0]]
        out[short] = out.get(short, 0) + n
    return {key: n for key, n in out.items() if n}


def count_of(field, status, outer="pk"):
    """An annotation: how many deliveries in `status` belong to the outer row, matched on the
    tally's `field` ("subscriber_id", "queue_id", "subscription_id", ...) against the outer
    row's `outer`. Two correlated sums over small tables: one lookup per row shown."""

    def summed(model):
        total = (
            model.objects.filter(**{field: OuterRef(outer), "status": status})
            .order_by()
            .values(field)
            .annotate(total=Sum("n"))
            .values("total")
        )
        return Coalesce(Subquery(total, output_field=IntegerField()), Value(0))

    return summed(Tally) + summed(TallyChange)
