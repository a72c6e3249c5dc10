"""Expiry (API.md, Extensions): a delivery not acked by its message's `expires_at` (or
`ttl_secs`, or its queue's default TTL) goes no further. Pending, the sweep makes it dead with
the reason `expired`; in flight, the end of its lease does (deadline, nack, a closed
connection), while an ack before then still counts. An expired message holds up no ordered
line, and an operator may redeliver it (without its expiry). Time is the ledger's `now` where
it takes one; elsewhere a test moves a delivery's expiry into the past, as time would."""

from datetime import timedelta

import pytest
from django.utils import timezone

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery, Status
from queues.models import Message
from tests.support.commands import command_output
from tests.support.rest import post_messages, pull

pytestmark = pytest.mark.django_db


def publish(queue, *outgoing):
    return [answer for answer, _ in publishing.publish(queue, list(outgoing))]


def expire_now(**filters):
    """Time passes: these deliveries' expiry is behind them."""
    Delivery.objects.filter(**filters).update(expires_at=timezone.now() - timedelta(seconds=1))


def test_a_ttl_is_stored_on_the_message_and_carried_by_its_deliveries(owner):
    r = post_messages(owner, {"event": "create", "payload": 1, "ttl_secs": 60})
    assert r.status_code == 201, r.content
    message = Message.objects.get()
    assert message.expires_at == message.created_at + timedelta(seconds=60)
    [d] = pull(owner)
    assert d["expires_at"] is not None
    assert Delivery.objects.get().expires_at == message.expires_at


def test_a_ttl_counts_from_the_deliver_at_of_a_delayed_message(owner):
    r = post_messages(owner, {"event": "create", "payload": 1, "delay_secs": 100, "ttl_secs": 60})
    assert r.status_code == 201, r.content
    message = Message.objects.get()
    assert message.expires_at == message.deliver_at + timedelta(seconds=60)


def test_a_pending_delivery_past_its_expiry_is_dead_expired_at_the_sweep(owner, db_queue, peer):
    # Given a message that expires in a minute, owed to two subscriptions, and one that does not
    subscribing.subscribe(peer, db_queue)
    [expiring, lasting] = publish(
        db_queue, publishing.prepare("create", 1, ttl_secs=60), publishing.prepare("create", 2)
    )
    later = Message.objects.get(pk=expiring["id"]).expires_at + timedelta(seconds=1)

    # When nothing takes it, and the sweep runs after its expiry
    assert ledger.expire_overdue_leases(now=later - timedelta(seconds=2)) == 0
    assert ledger.expire_overdue_leases(now=later) == 2

    # Then both of its deliveries are dead, "expired", spending no attempt; the other message's wait
    for d in Delivery.objects.filter(message_id=expiring["id"]):
        assert (d.status, d.last_error, d.attempt) == (Status.DEAD, ledger.EXPIRED, 0)
    assert set(Delivery.objects.filter(message_id=lasting["id"]).values_list("status", flat=True)) == {
        Status.PENDING
    }


def test_a_lease_never_hands_out_an_expired_delivery_before_the_sweep(owner, db_queue):
    [answer] = publish(db_queue, publishing.prepare("create", 1, ttl_secs=60))
    expires_at = Message.objects.get(pk=answer["id"]).expires_at
    assert ledger.lease_deliveries(owner, limit=10, now=expires_at) == []
    assert Delivery.objects.get().status == Status.PENDING  # the sweep's to kill


@pytest.mark.parametrize("how", ["deadline", "nack", "closed"])
def test_an_in_flight_delivery_whose_message_expired_is_dead_expired_when_its_lease_ends(
    owner, db_queue, how
):
    # Given a delivery leased while its message had not expired yet
    publish(db_queue, publishing.prepare("create", 1, ttl_secs=60))
    [d] = ledger.lease_deliveries(owner, limit=1, holder="ws.gone")
    expire_now(pk=d["id"])
    assert Delivery.objects.get().status == Status.INFLIGHT  # a lease under way runs its course

    # When its lease ends without an ack
    if how == "deadline":
        ledger.expire_overdue_leases(now=timezone.now() + timedelta(seconds=31))
    elif how == "nack":
        ledger.nack_deliveries(owner, [d["id"]])
    else:
        ledger.release_held(["ws.gone"], spend=True)

    # Then it goes no further: dead, "expired", whatever attempts it had left
    row = Delivery.objects.get()
    assert (row.status, row.last_error, row.attempt) == (Status.DEAD, ledger.EXPIRED, 1)
    assert row.ack_deadline is None and row.lease_holder == ""


def test_an_ack_before_the_lease_ends_still_counts_after_the_expiry(owner, db_queue):
    publish(
        db_queue, publishing.prepare("create", 1, ttl_secs=60), publishing.prepare("create", 2, ttl_secs=60)
    )
    first, second = ledger.lease_deliveries(owner, limit=2)
    ledger.ack_deliveries(owner, [first["id"]])  # acked in time
    expire_now(pk=second["id"])
    assert ledger.ack_deliveries(owner, [second["id"]]) == (1, [])  # acked after its expiry, still leased
    ledger.expire_overdue_leases(now=timezone.now() + timedelta(days=1))
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_a_server_shutdown_gives_an_expired_delivery_back_and_the_sweep_then_kills_it(owner, db_queue):
    """Given back unspent (the server's own shutdown), it is pending and expired: the sweep's."""
    publish(db_queue, publishing.prepare("create", 1, ttl_secs=60))
    [d] = ledger.lease_deliveries(owner, limit=1, holder="ws.shutdown")
    expire_now(pk=d["id"])
    ledger.release_held(["ws.shutdown"])
    assert Delivery.objects.get().status == Status.PENDING
    ledger.expire_overdue_leases()
    assert (Delivery.objects.get().status, Delivery.objects.get().last_error) == (Status.DEAD, ledger.EXPIRED)


# --- the queue's default ------------------------------------------------------------------------


def test_a_queue_default_ttl_applies_where_a_message_names_no_expiry(owner, db_queue):
    # Given the queue's default TTL, set by createqueue
    out = command_output("createqueue", "db", "--ttl-secs", "90")
    assert "ttl_secs=90" in out
    db_queue.refresh_from_db()
    assert db_queue.ttl_secs == 90

    # When messages name no expiry, their own TTL, and their own expires_at
    own_at = (timezone.now() + timedelta(hours=1)).replace(microsecond=0)
    for extra in ({}, {"ttl_secs": 5}, {"expires_at": own_at.isoformat()}, {"delay_secs": 10}):
        r = post_messages(owner, {"event": "create", "payload": 1, **extra})
        assert r.status_code == 201, r.content

    # Then the default fills in only the first and the delayed one (from its deliver_at)
    m1, m2, m3, m4 = Message.objects.order_by("seq")
    assert m1.expires_at == m1.created_at + timedelta(seconds=90)
    assert m2.expires_at == m2.created_at + timedelta(seconds=5)
    assert m3.expires_at == own_at
    assert m4.expires_at == m4.deliver_at + timedelta(seconds=90)

    # And --ttl-secs 0 takes the default away
    command_output("createqueue", "db", "--ttl-secs", "0")
    db_queue.refresh_from_db()
    assert db_queue.ttl_secs is None
    post_messages(owner, {"event": "create", "payload": 1})
    assert Message.objects.order_by("seq").last().expires_at is None


def test_createqueue_refuses_a_negative_ttl():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError):
        command_output("createqueue", "db", "--ttl-secs", "-5")


# --- an ordered line moves on -------------------------------------------------------------------


def test_an_expired_head_of_an_ordered_line_holds_it_only_until_the_sweep(make_queue, make_subscriber):
    # Given an ordered queue whose head expires in a minute, unacked, and two behind it
    queue = make_queue("audit", ordered=True)
    worker = make_subscriber("worker", subscribe=("audit",))
    subscribing.subscribe(worker, queue)
    publish(
        queue,
        publishing.prepare("create", 1, ttl_secs=60),
        publishing.prepare("create", 2),
        publishing.prepare("create", 3),
    )
    [head] = ledger.lease_deliveries(worker, limit=10)
    ledger.nack_deliveries(worker, [head["id"]], retry_in=3600)  # waits for its retry: holds the line
    assert ledger.lease_deliveries(worker, limit=10) == []
    later = Message.objects.get(seq=1).expires_at

    # When its expiry passes, it is never handed out; the sweep (every second) makes it dead,
    # and the next of its line is the head (delivery.lines' trigger)
    assert ledger.lease_deliveries(worker, limit=10, now=later) == []
    ledger.expire_overdue_leases(now=later)
    assert (Delivery.objects.get(seq=1).status, Delivery.objects.get(seq=1).last_error) == (
        Status.DEAD,
        ledger.EXPIRED,
    )

    # Then the line goes on in order
    [second] = ledger.lease_deliveries(worker, limit=10, now=later)
    assert second["seq"] == 2
    ledger.ack_deliveries(worker, [second["id"]])
    assert [d["seq"] for d in ledger.lease_deliveries(worker, limit=10, now=later)] == [3]


def test_an_expired_head_in_flight_holds_its_line_until_its_lease_ends(make_queue, make_subscriber):
    """ "Goes no further when its lease ends": until then it is still the one in flight."""
    queue = make_queue("audit", ordered=True)
    worker = make_subscriber("worker", subscribe=("audit",))
    subscribing.subscribe(worker, queue)
    publish(queue, publishing.prepare("create", 1, ttl_secs=60), publishing.prepare("create", 2))
    [head] = ledger.lease_deliveries(worker, limit=10)
    expire_now(pk=head["id"])
    assert ledger.lease_deliveries(worker, limit=10) == []
    ledger.nack_deliveries(worker, [head["id"]])
    assert Delivery.objects.get(pk=head["id"]).last_error == ledger.EXPIRED
    assert [d["seq"] for d in ledger.lease_deliveries(worker, limit=10)] == [2]


# --- dead letters --------------------------------------------------------------------------------


def test_an_expired_dead_letter_is_listed_and_redelivered_without_its_expiry(owner, db_queue, staff):
    publish(db_queue, publishing.prepare("create", 1, ttl_secs=60))
    ledger.expire_overdue_leases(now=timezone.now() + timedelta(seconds=61))
    dead = Delivery.objects.get()
    listed = staff.get("/admin/delivery/deadletter/")
    assert listed.status_code == 200 and b"expired" in listed.content

    r = staff.post("/admin/delivery/deadletter/", {"action": "redeliver", "_selected_action": [dead.pk]})
    assert r.status_code == 302
    row = Delivery.objects.get()
    assert (row.status, row.expires_at, row.attempt) == (Status.PENDING, None, 0)
    [d] = pull(owner)
    assert d["expires_at"] is None and d["attempt"] == 1
    ledger.expire_overdue_leases(now=timezone.now() + timedelta(days=1))
    row = Delivery.objects.get()  # its lease ended unacked: retried as usual, not expired
    assert (row.status, row.last_error) == (Status.PENDING, ledger.ACK_DEADLINE_PASSED)


def test_a_replay_owes_no_message_that_has_expired(owner, db_queue, peer):
    from subscribers.replay import Point

    # Given two messages, one of which expired unacked (dead), the other acked
    [expiring, _] = publish(
        db_queue, publishing.prepare("create", 1, ttl_secs=60), publishing.prepare("create", 2)
    )
    Message.objects.filter(pk=expiring["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    expire_now(message_id=expiring["id"])
    ledger.expire_overdue_leases()
    ledger.ack_deliveries(owner, [d["id"] for d in ledger.lease_deliveries(owner, limit=10)])

    # When a new subscription replays everything, and the old one seeks back to the start
    sub, _ = subscribing.subscribe(peer, db_queue)
    assert ledger.replay(sub, Point("all")).deliveries == 1
    mine = owner.subscriptions.get()
    assert ledger.replay(mine, Point("all"), reopen=True).deliveries == 1

    # Then only the unexpired message is owed again; the expired one stays dead, owed to nobody new
    assert [d["payload"] for d in ledger.lease_deliveries(peer, limit=10)] == [2]
    assert [d["payload"] for d in ledger.lease_deliveries(owner, limit=10)] == [2]
    assert Delivery.objects.get(message_id=expiring["id"]).status == Status.DEAD
