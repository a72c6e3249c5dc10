"""The kept counts (delivery.tallies) against a recount of the rows, after every kind of change.

What operators rely on: the counts they read on the dashboard, /metrics, `queuestats` and the
admin are the rows' own counts, exactly, whichever path changed the rows and whether or not the
changes were folded yet.
"""

import threading
from collections import Counter
from datetime import timedelta
from io import StringIO

import pytest
from django.db import close_old_connections, connection
from django.utils import timezone

from delivery import ledger, subscribing, tallies
from delivery.models import Delivery, DeliveryAttempt, Status, Tally, TallyChange
from queues.models import Message
from tests.support.publish import publish
from tests.support.recount import recount


def kept():
    return tallies.counts(tallies.KEY)


def assert_exact():
    assert kept() == recount()
    tallies.fold()
    assert not TallyChange.objects.exists()
    assert kept() == recount()
    assert not Tally.objects.filter(n=0).exists()  # emptied keys do not pile up


@pytest.fixture
def two_subscribed(db_queue, logger, peer):
    subscribing.subscribe(logger, db_queue)  # every event
    subscribing.subscribe(peer, db_queue, "create")
    return db_queue


def test_each_change_of_the_ledger_is_counted_exactly(two_subscribed, logger, peer):
    queue = two_subscribed
    publish(queue, 5, "create", publisher=logger)
    publish(queue, 3, "delete", publisher=logger)
    assert_exact()
    assert tallies.counts(["subscriber_id", "status"]) == {
        (logger.pk, Status.PENDING): 8,
        (peer.pk, Status.PENDING): 5,
        (0, tallies.PUBLISHED): 8,
    }

    leased = ledger.lease_deliveries(logger, limit=6)
    assert_exact()
    ids = [d["id"] for d in leased]
    ledger.ack_deliveries(logger, ids[:3])
    ledger.nack_deliveries(logger, ids[3:4], retry_in=0)
    assert_exact()
    # A lease's deadline moved: no key changes, nothing is appended.
    before = TallyChange.objects.count()
    ledger.extend_deliveries(logger, ids[4:], 60)
    assert TallyChange.objects.count() == before
    # Leases expire (back to pending, or dead on the last attempt).
    queue.max_attempts = 1
    queue.save()
    ledger.expire_overdue_leases(now=timezone.now() + timedelta(hours=1))
    assert_exact()
    assert tallies.counts(["status"], subscriber_id=logger.pk)[Status.DEAD] == 2

    # An operator's redelivery, kill and purge.
    first_dead = Delivery.objects.filter(status=Status.DEAD).order_by("id").first()
    ledger.redeliver(Delivery.objects.filter(pk=first_dead.pk))
    ledger.kill_deliveries(Delivery.objects.filter(subscriber=peer, seq__lte=2))
    assert_exact()
    ledger.purge_dead(Delivery.objects.filter(status=Status.DEAD))
    assert_exact()

    # An unsubscribe drops what was owed and keeps acked history, now without a subscription.
    subscribing.unsubscribe(logger.subscriptions.get())
    assert_exact()
    assert tallies.counts(["subscription_id", "status"], subscriber_id=logger.pk) == {(0, Status.ACKED): 3}

    # Deleting messages cascades to their deliveries (the archive and the admin do this).
    Message.objects.filter(event__name="create").delete()
    assert_exact()
    assert tallies.counts(["status"]) == {tallies.PUBLISHED: 3}


def test_webhook_attempts_are_counted_by_outcome(two_subscribed, logger, peer):
    publish(two_subscribed, 2, "create", publisher=logger)
    first, second = Delivery.objects.filter(subscriber=peer).order_by("id")
    now = timezone.now()
    for delivery, ok, code in (
        (first, True, 200),
        (first, False, 500),
        (second, False, None),
        (second, False, 503),
    ):
        DeliveryAttempt.objects.create(delivery=delivery, number=1, at=now, ok=ok, status_code=code)
    assert_exact()
    assert tallies.counts(["subscriber_id", "status"], status__startswith="attempt_") == {
        (peer.pk, "attempt_ok"): 1,
        (peer.pk, "attempt_http_error"): 2,
        (peer.pk, "attempt_error"): 1,
    }
    # Deleting the deliveries takes their attempts along (the archive does so).
    Delivery.objects.filter(pk=first.pk).delete()
    assert_exact()
    assert tallies.counts(["status"], status__startswith="attempt_") == {
        "attempt_http_error": 1,
        "attempt_error": 1,
    }


def test_the_fold_files_publishes_and_acks_by_step_and_not_what_is_taken_away(two_subscribed, logger, peer):
    """The dashboard's rates and charts (dashboard.snapshot) read TallyActivity: publishes and
    acks, by (queue, event) and the acks by subscriber, never a removal counted as either."""
    from delivery.models import TallyActivity

    publish(two_subscribed, 5, "create", publisher=logger)
    leased = ledger.lease_deliveries(peer, limit=3)
    ledger.ack_deliveries(peer, [d["id"] for d in leased])
    tallies.fold()

    def filed():
        out = Counter()
        for queue_id, event_id, subscriber_id, status, n in TallyActivity.objects.values_list(
            "queue_id", "event_id", "subscriber_id", "status", "n"
        ):
            out[(queue_id, event_id, subscriber_id, status)] += n
        return dict(out)

    create = two_subscribed.events.get(name="create")
    expected = {
        (two_subscribed.pk, create.pk, 0, tallies.PUBLISHED): 5,
        (two_subscribed.pk, create.pk, 0, Status.ACKED): 3,
        (0, 0, peer.pk, Status.ACKED): 3,
    }
    assert filed() == expected
    steps = set(TallyActivity.objects.values_list("step", flat=True))
    assert all(step.timestamp() % tallies.ACTIVITY_STEP_SECS == 0 for step in steps)
    assert all(abs((timezone.now() - step).total_seconds()) < 30 for step in steps)

    # An unsubscribe moves the acked rows to no subscription, a delete takes messages away:
    # neither is a publish or an ack.
    subscribing.unsubscribe(peer.subscriptions.get())
    Message.objects.filter(seq__gt=3).delete()
    tallies.fold()
    assert filed() == expected


def test_recount_mends_counts_that_missed_rows_written_with_the_triggers_off(two_subscribed, logger, peer):
    from django.core.management import call_command

    publish(two_subscribed, 4, "create", publisher=logger)
    leased = ledger.lease_deliveries(peer, limit=2)
    ledger.ack_deliveries(peer, [d["id"] for d in leased[:1]])
    DeliveryAttempt.objects.create(delivery_id=leased[1]["id"], number=1, at=timezone.now(), ok=False)
    # What a load with the triggers off leaves: counts that say nothing of the rows.
    Tally.objects.all().delete()
    TallyChange.objects.all().delete()
    Tally.objects.create(
        queue_id=999, event_id=999, subscription_id=0, subscriber_id=0, status="pending", n=7
    )
    assert kept() != recount()

    out = StringIO()
    call_command("recounttallies", stdout=out)
    assert kept() == recount()
    assert "counted again" in out.getvalue()
    # And the triggers go on from there.
    publish(two_subscribed, 2, "delete", publisher=logger)
    assert_exact()


def test_counts_filter_and_group(two_subscribed, logger, peer):
    publish(two_subscribed, 4, "create", publisher=logger)
    by_event = tallies.counts(["event_id", "status"], queue_id=two_subscribed.pk)
    create = two_subscribed.events.get(name="create")
    assert by_event == {(create.pk, Status.PENDING): 8, (create.pk, tallies.PUBLISHED): 4}
    assert tallies.counts(["status"], subscriber_id=peer.pk) == {Status.PENDING: 4}
    assert tallies.counts(["status"], subscriber_id=peer.pk + 1000) == {}


def test_an_annotation_counts_per_row_shown(two_subscribed, logger, peer):
    from subscribers.models import Subscriber

    publish(two_subscribed, 2, "create", publisher=logger)
    publish(two_subscribed, 1, "delete", publisher=logger)
    tallies.fold()
    publish(two_subscribed, 1, "create", publisher=logger)  # not folded: still counted
    rows = dict(
        Subscriber.objects.annotate(n=tallies.count_of("subscriber_id", Status.PENDING)).values_list(
            "name", "n"
        )
    )
    assert rows == {"logger": 4, "peer": 3}


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_and_folds_lose_nothing(two_subscribed, logger, peer):
    """Acks, publishes and folds from several threads at once: the counts stay exact. (On
    PostgreSQL the threads run truly at once; SQLite serializes their writes.)"""
    publish(two_subscribed, 60, "create", publisher=logger)
    errors = []

    def worker(fn):
        try:
            fn()
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            close_old_connections()

    def acker(who):
        def run():
            for _ in range(6):
                got = ledger.lease_deliveries(who, limit=5)
                ledger.ack_deliveries(who, [d["id"] for d in got])

        return run

    def publisher():
        for _ in range(10):
            publish(two_subscribed, 3, "delete", publisher=logger)

    def folder():
        for _ in range(20):
            tallies.fold()

    threads = [
        threading.Thread(target=worker, args=(fn,))
        for fn in (acker(logger), acker(peer), publisher, folder, folder)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert kept() == recount()
    tallies.fold()
    assert kept() == recount()


def test_the_migration_seeded_the_counts_and_installed_the_triggers(db):
    """The triggers exist on this database (a test database made without them would count
    nothing, and every other test here would fail for that reason)."""
    if connection.vendor == "postgresql":
        sql = "SELECT tgname FROM pg_trigger WHERE tgname LIKE '%%tally%%' AND NOT tgisinternal"
    else:
        sql = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND name LIKE '%tally%'"
    with connection.cursor() as cursor:
        cursor.execute(sql)
        names = {row[0] for row in cursor.fetchall()}
    assert names == {
        "attempt_tally_insert",
        "attempt_tally_delete",
        "delivery_tally_insert",
        "delivery_tally_update",
        "delivery_tally_delete",
        "message_tally_insert",
        "message_tally_delete",
    }
