"""The read model (delivery.querysets, Connection.is_stale): each predicate against rows made by
hand, at its boundary, in every spelling it has (the ORM's, the raw SQL the ledger sends, the
test of a row already read), and the ledger, the reports and the sweeps that rely on them.

The world: the unordered queue `db` and the ordered queue `orders`; `logger` subscribes to
both, `peer` to `db`. Messages are published as the API would; then each delivery is put in
the state a test needs, at times counted from one fixed `now`.
"""

from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from delivery import ledger, lines, presence, reports, subscribing
from delivery.models import Delivery, Status
from delivery.publishing import prepare, publish
from delivery.querysets import open_in_sql, overdue_sql, ready_sql
from queues.models import Queue
from subscribers.models import STALE_AFTER_SECS, Connection
from subscribers.provisioning import create_subscriber

TICK = timedelta(microseconds=1)


@pytest.fixture
def now():
    # A minute ahead, so that all the world publishes is due by then; its microseconds not zero,
    # as SQLite compares datetimes as text and a boundary here is a microsecond away.
    return (timezone.now() + timedelta(minutes=1)).replace(microsecond=500_000)


@pytest.fixture
def db_and_orders(db):
    db_queue = Queue.objects.create(name="db")
    orders = Queue.objects.create(name="orders", ordered=True)
    logger, _ = create_subscriber("logger", subscribe=["db", "orders"])
    peer, _ = create_subscriber("peer", subscribe=["db"])
    for subscriber, queue in ((logger, db_queue), (logger, orders), (peer, db_queue)):
        subscribing.subscribe(subscriber, queue)
    publish(db_queue, [prepare("create" if n % 2 else "drop", {"n": n}) for n in range(1, 7)])
    publish(orders, [prepare("paid", {"order": n}) for n in range(1, 6)])
    return {"db": db_queue, "orders": orders, "logger": logger, "peer": peer}


def deliveries(subscriber, queue):
    """{seq: delivery id} of the subscriber's deliveries from the queue."""
    return dict(Delivery.objects.filter(subscriber=subscriber, queue=queue).values_list("seq", "id"))


def put(delivery_id, status, **fields):
    """Put one delivery in a state by hand (the test's setup, not a ledger move)."""
    Delivery.objects.filter(pk=delivery_id).update(status=status, **fields)


def ids(queryset):
    return set(queryset.values_list("id", flat=True))


def ids_where(sql_condition, now):
    """The deliveries a raw SQL condition on `d` (whose every parameter is `now`) selects, as
    the ledger sends it."""
    table = Delivery._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT d.id FROM {table} d WHERE {sql_condition}",
            [connection.ops.adapt_datetimefield_value(now)] * sql_condition.count("%s"),
        )
        return {row[0] for row in cursor.fetchall()}


def test_a_pending_delivery_due_exactly_now_is_ready_and_one_a_tick_later_is_retrying(db_and_orders, now):
    # Given: the logger's db deliveries, pending due a second ago, exactly now and a tick from
    # now, and others in flight (due long ago), acked and dead
    seqs = deliveries(db_and_orders["logger"], db_and_orders["db"])
    put(seqs[1], Status.PENDING, next_attempt_at=now - timedelta(seconds=1))
    put(seqs[2], Status.PENDING, next_attempt_at=now)
    put(seqs[3], Status.PENDING, next_attempt_at=now + TICK)
    put(
        seqs[4],
        Status.INFLIGHT,
        next_attempt_at=now - timedelta(hours=1),
        ack_deadline=now + timedelta(hours=1),
    )
    put(seqs[5], Status.ACKED, next_attempt_at=now - timedelta(hours=1))
    put(seqs[6], Status.DEAD, next_attempt_at=now - timedelta(hours=1))
    mine = Delivery.objects.filter(subscriber=db_and_orders["logger"], queue=db_and_orders["db"])

    # Then: ready and retrying split the pending ones at `now`, in each spelling
    assert ids(mine.ready(now)) == {seqs[1], seqs[2]}
    assert ids(mine.retrying(now)) == {seqs[3]}
    assert ids_where(ready_sql("d"), now) & set(seqs.values()) == {seqs[1], seqs[2]}
    for d in mine:
        assert d.is_ready(now) == (d.pk in {seqs[1], seqs[2]}), d
        assert d.is_retrying(now) == (d.pk == seqs[3]), d

    # And: a lease at `now` hands out exactly the ready ones, oldest first
    leased = ledger.lease_deliveries(db_and_orders["logger"], limit=10, queue=db_and_orders["db"], now=now)
    assert [d["id"] for d in leased] == [seqs[1], seqs[2]]


def test_a_lease_whose_deadline_is_exactly_now_is_overdue_and_one_a_tick_later_is_not(db_and_orders, now):
    # Given: the logger's db deliveries in flight until a second ago, exactly now and a tick
    # from now; a pending one (no deadline); an acked one whose old deadline was left behind
    seqs = deliveries(db_and_orders["logger"], db_and_orders["db"])
    put(seqs[1], Status.INFLIGHT, ack_deadline=now - timedelta(seconds=1), attempt=1)
    put(seqs[2], Status.INFLIGHT, ack_deadline=now, attempt=1)
    put(seqs[3], Status.INFLIGHT, ack_deadline=now + TICK, attempt=1)
    put(seqs[4], Status.PENDING, ack_deadline=None)
    put(seqs[5], Status.ACKED, ack_deadline=now - timedelta(hours=1))
    mine = Delivery.objects.filter(subscriber=db_and_orders["logger"], queue=db_and_orders["db"])

    # Then: overdue takes the first two, in each spelling
    assert ids(mine.overdue(now)) == {seqs[1], seqs[2]}
    assert ids_where(overdue_sql("d"), now) & set(seqs.values()) == {seqs[1], seqs[2]}
    for d in mine:
        assert d.is_overdue(now) == (d.pk in {seqs[1], seqs[2]}), d

    # And: the sweeper's expiry at `now` moves exactly those back to pending
    assert ledger.expire_overdue_leases(now) == 2
    assert set(mine.filter(status=Status.INFLIGHT).values_list("id", flat=True)) == {seqs[3]}
    assert Delivery.objects.get(pk=seqs[1]).last_error == "ack deadline passed"


def test_open_is_pending_or_in_flight_and_unsettled_adds_dead(db_and_orders, now):
    # Given: one of the peer's deliveries in each status
    seqs = deliveries(db_and_orders["peer"], db_and_orders["db"])
    put(seqs[1], Status.PENDING)
    put(seqs[2], Status.INFLIGHT, ack_deadline=now)
    put(seqs[3], Status.ACKED, acked_at=now)
    put(seqs[4], Status.DEAD)
    Delivery.objects.filter(pk__in=[seqs[5], seqs[6]]).delete()
    peers = Delivery.objects.filter(subscriber=db_and_orders["peer"])

    # Then
    assert ids(peers.open()) == {seqs[1], seqs[2]}
    assert ids_where(open_in_sql("d"), now) & set(seqs.values()) == {seqs[1], seqs[2]}
    assert ids(peers.unsettled()) == {seqs[1], seqs[2], seqs[4]}
    assert "OR" in str(peers.open().query)  # one term per status, for the partial indexes


def test_the_head_is_the_one_in_flight_even_with_a_lower_seq_reopened_behind_it(db_and_orders, now):
    # Given: the logger's orders line: 1 acked, 2 reopened (pending again, as a seek leaves it),
    # 3 in flight, 4 and 5 pending
    seqs = deliveries(db_and_orders["logger"], db_and_orders["orders"])
    put(seqs[1], Status.ACKED, acked_at=now)
    put(seqs[2], Status.PENDING, next_attempt_at=now - timedelta(seconds=1))
    put(seqs[3], Status.INFLIGHT, ack_deadline=now + timedelta(minutes=5), attempt=1)
    # put() writes the rows as the seek would leave them; the seek's end marks the heads so
    lines.reseat([Delivery.objects.get(pk=seqs[3]).subscription_id])

    # Then: its head is 3; the unordered db queue's deliveries are nobody's head
    assert ids(Delivery.objects.heads()) == {seqs[3]}
    assert reports.head_of(Delivery.objects.get(pk=seqs[3]).subscription_id).pk == seqs[3]
    # And: the lease hands out nothing of it while its head is in flight
    assert (
        ledger.lease_deliveries(db_and_orders["logger"], limit=10, queue=db_and_orders["orders"], now=now)
        == []
    )

    # When: the head is acked
    ledger.ack_deliveries(db_and_orders["logger"], [seqs[3]])

    # Then: the head is the lowest open seq, 2, and it is what the next lease hands out
    assert ids(Delivery.objects.heads()) == {seqs[2]}
    [leased] = ledger.lease_deliveries(
        db_and_orders["logger"], limit=10, queue=db_and_orders["orders"], now=now
    )
    assert leased["id"] == seqs[2]
    assert ids(Delivery.objects.heads()) == {seqs[2]}  # now in flight, still the head


def test_a_dead_delivery_does_not_hold_its_line(db_and_orders, now):
    seqs = deliveries(db_and_orders["logger"], db_and_orders["orders"])
    put(seqs[1], Status.DEAD, last_error="skipped by op")

    assert ids(Delivery.objects.heads()) == {seqs[2]}
    assert reports.head_of(Delivery.objects.get(pk=seqs[2]).subscription_id).pk == seqs[2]


def test_the_backlog_groups_what_is_unsettled_as_a_recount_does(db_and_orders, now):
    # Given: a mix of states over both subscribers and queues
    states = [
        (Status.PENDING, {"next_attempt_at": now - timedelta(seconds=5)}),
        (Status.PENDING, {"next_attempt_at": now + timedelta(seconds=30)}),
        (Status.INFLIGHT, {"ack_deadline": now + timedelta(seconds=60)}),
        (Status.ACKED, {"acked_at": now}),
        (Status.DEAD, {}),
        (Status.PENDING, {"next_attempt_at": now + timedelta(seconds=90)}),
    ]
    for k, id_ in enumerate(Delivery.objects.order_by("id").values_list("id", flat=True)):
        status, fields = states[k % len(states)]
        put(id_, status, **fields)
    rows = list(Delivery.objects.all())

    # Then: by subscriber, and by queue and event, the figures a recount of the rows gives
    for by in (("subscriber",), ("queue", "event"), ("subscription",)):
        columns = [f"{b}_id" for b in by]
        got = {tuple(r[c] for c in columns): r for r in Delivery.objects.backlog(*by, now=now)}
        expected = defaultdict(Counter)
        pending_at, retry_at, until = defaultdict(list), defaultdict(list), defaultdict(list)
        for d in rows:
            if d.status == Status.ACKED:
                continue
            key = tuple(getattr(d, c) for c in columns)
            expected[key][d.status] += 1
            if d.status == Status.PENDING:
                pending_at[key].append(d.created_at)
            if d.is_retrying(now):
                expected[key]["retrying"] += 1
                retry_at[key].append(d.next_attempt_at)
            if d.status == Status.INFLIGHT:
                until[key].append(d.ack_deadline)
        assert set(got) == set(expected), by
        for key, counts in expected.items():
            row = got[key]
            assert (row["pending"], row["inflight"], row["dead"], row["retrying"]) == (
                counts[Status.PENDING],
                counts[Status.INFLIGHT],
                counts[Status.DEAD],
                counts["retrying"],
            ), (by, key)
            assert row["oldest_pending_at"] == min(pending_at[key], default=None)
            assert row["next_retry_at"] == min(retry_at[key], default=None)
            assert row["inflight_until"] == max(until[key], default=None)

    # And: without `now`, only the counts and the oldest pending
    [row] = Delivery.objects.filter(subscriber=db_and_orders["peer"]).backlog("subscriber")
    assert set(row) == {"subscriber_id", "pending", "inflight", "dead", "oldest_pending_at"}


def test_the_owed_report_splits_ready_from_retrying_as_the_read_model_does(db_and_orders, now):
    seqs = deliveries(db_and_orders["peer"], db_and_orders["db"])
    put(seqs[1], Status.PENDING, next_attempt_at=now)
    put(seqs[2], Status.PENDING, next_attempt_at=now + TICK, last_error="nacked by the client: busy")

    [owed] = reports.owed_to_subscriber(db_and_orders["peer"], now=now)

    assert (owed.pending, owed.ready, owed.retrying) == (6, 5, 1)
    assert owed.next_retry_at == now + TICK
    assert owed.retry_error == "nacked by the client: busy"


@pytest.fixture
def sockets(db_and_orders, now):
    """Three of the peer's sockets: seen just inside the stale limit, exactly at it, and a tick
    past it."""
    made = {}
    for name, seen in (
        ("ws.inside", now - timedelta(seconds=STALE_AFTER_SECS) + TICK),
        ("ws.at", now - timedelta(seconds=STALE_AFTER_SECS)),
        ("ws.past", now - timedelta(seconds=STALE_AFTER_SECS) - TICK),
    ):
        made[name] = Connection.objects.create(
            subscriber=db_and_orders["peer"], channel_name=name, last_seen=seen
        )
    return made


def test_a_connection_is_stale_only_once_unseen_for_longer_than_the_limit(sockets, now):
    assert {name for name, c in sockets.items() if c.is_stale(now)} == {"ws.past"}
    assert set(Connection.objects.stale(now).values_list("channel_name", flat=True)) == {"ws.past"}
    assert set(Connection.objects.live(now).values_list("channel_name", flat=True)) == {"ws.inside", "ws.at"}


def test_the_sweep_closes_the_stale_connections_and_hands_back_what_they_held(db_and_orders, sockets, now):
    # Given: the stale socket holds a delivery
    [held] = ledger.lease_deliveries(db_and_orders["peer"], limit=1, holder="ws.past", now=now)

    # When
    assert presence.sweep_stale_connections(now) == 1

    # Then: that socket is gone, its delivery pending again; the others stay
    assert set(Connection.objects.values_list("channel_name", flat=True)) == {"ws.inside", "ws.at"}
    assert Delivery.objects.get(pk=held["id"]).status == Status.PENDING


def test_the_admins_heartbeat_filter_and_badge_follow_the_same_rule(db_and_orders, operator):
    # Given: sockets seen a minute inside the limit and a minute past it (the admin reads the clock)
    real_now = timezone.now()
    for name, seen in (
        ("ws.live", real_now - timedelta(seconds=STALE_AFTER_SECS - 60)),
        ("ws.stale", real_now - timedelta(seconds=STALE_AFTER_SECS + 60)),
    ):
        Connection.objects.create(subscriber=db_and_orders["peer"], channel_name=name, last_seen=seen)
    staff = Client()
    staff.force_login(operator)
    url = reverse("admin:subscribers_connection_changelist")

    def listed(**params):
        r = staff.get(url, params)
        assert r.status_code == 200
        return {c.channel_name for c in r.context["cl"].result_list}, r.content.decode()

    # Then
    assert listed(heartbeat="stale")[0] == {"ws.stale"}
    assert listed(heartbeat="live")[0] == {"ws.live"}
    everyone, html = listed()
    assert everyone == {"ws.live", "ws.stale"}
    assert html.count('class="mq-stale"') == 1
