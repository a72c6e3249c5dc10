"""Dead or retry (delivery.ledger.dead_or_retry): the one rule for an attempt that ended without
an ack, whatever ended it: a nack, a failed push, a lease that expired, a connection that closed
while holding it. Pending again after a backoff with the cause's words, or, at the queue's last
attempt, dead with the count of attempts.

The world: the queue `jobs` (two attempts) and its subscriber `worker`, owed two messages.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from delivery import ledger, subscribing, wakeups
from delivery.models import Delivery, Status
from delivery.publishing import prepare, publish
from queues.models import Queue
from subscribers.provisioning import create_subscriber

ACK_TIMEOUT = 30


@pytest.fixture
def world(db, settings):
    settings.MQ_BACKOFF_BASE_SECS = 1.5  # a backoff with a fraction: the arithmetic is the database's
    jobs = Queue.objects.create(name="jobs", max_attempts=2, ack_timeout=ACK_TIMEOUT)
    worker, _ = create_subscriber("worker", subscribe=["jobs"])
    subscribing.subscribe(worker, jobs)
    publish(jobs, [prepare("run", {"n": n}) for n in (1, 2)])
    return worker


@pytest.fixture
def t0():
    # Ahead of what was published, its microseconds not zero: SQLite keeps datetimes as text.
    return (timezone.now() + timedelta(minutes=1)).replace(microsecond=123_457)


def lease(worker, now, holder="ws.a"):
    [leased] = ledger.lease_deliveries(worker, limit=1, holder=holder, now=now)
    return leased["id"]


def test_an_expired_lease_is_retried_after_its_backoff_from_the_missed_deadline_then_dies(world, t0):
    # Given: the first attempt, leased at t0 and never acked
    first = lease(world, t0)
    deadline = t0 + timedelta(seconds=ACK_TIMEOUT)

    # When: the sweep runs an hour late
    assert ledger.expire_overdue_leases(now=t0 + timedelta(hours=1)) == 1

    # Then: pending, due a backoff after the deadline it missed (not after the late sweep)
    d = Delivery.objects.get(pk=first)
    assert (d.status, d.attempt, d.last_error) == (Status.PENDING, 1, "ack deadline passed")
    assert (d.next_attempt_at, d.ack_deadline, d.lease_holder) == (
        deadline + timedelta(seconds=1.5),
        None,
        "",
    )

    # When: its second and last attempt expires too
    t1 = t0 + timedelta(hours=2)
    assert lease(world, t1) == first
    assert ledger.expire_overdue_leases(now=t1 + timedelta(hours=1)) == 1

    # Then: dead, with its count of attempts; its next_attempt_at is left as it was
    d = Delivery.objects.get(pk=first)
    assert (d.status, d.attempt, d.last_error) == (
        Status.DEAD,
        2,
        "ack deadline passed; dead after 2 attempts",
    )
    assert d.next_attempt_at == deadline + timedelta(seconds=1.5)


def _nack_it(worker, delivery_id):
    ledger.nack_deliveries(worker, [delivery_id])


def _fail_the_push(worker, delivery_id):
    ledger.fail_delivery(delivery_id, "ws.a", "HTTP 500")


def _let_its_lease_expire(worker, delivery_id):
    ledger.expire_overdue_leases(now=timezone.now() + timedelta(days=1))


def _close_its_socket(worker, delivery_id):
    ledger.release_held(["ws.a"], spend=True)


@pytest.mark.parametrize(
    "end, retried, died",
    [
        (_nack_it, "nacked by the client", "nacked by the client; dead after 2 attempts"),
        (_fail_the_push, "HTTP 500", "HTTP 500; dead after 2 attempts"),
        (_let_its_lease_expire, "ack deadline passed", "ack deadline passed; dead after 2 attempts"),
        (_close_its_socket, "the connection holding it closed", "connection closed while in flight, 2 times"),
    ],
    ids=["nack", "failed push", "expiry", "closed connection"],
)
def test_every_cause_retries_then_kills_with_its_own_words(world, end, retried, died):
    # Given: the first delivery leased, and its attempt ended
    first = lease(world, timezone.now())
    end(world, first)
    d = Delivery.objects.get(pk=first)
    assert (d.status, d.attempt, d.last_error, d.lease_holder) == (Status.PENDING, 1, retried, "")

    # When: it is due again, leased, and its last attempt ends the same way
    Delivery.objects.filter(pk=first).update(next_attempt_at=timezone.now())
    assert lease(world, timezone.now()) == first
    end(world, first)

    # Then: dead, its words saying after how many attempts
    d = Delivery.objects.get(pk=first)
    assert (d.status, d.attempt, d.last_error, d.ack_deadline) == (Status.DEAD, 2, died, None)


def test_killing_a_delivery_wakes_its_subscriber_as_skipping_one_does(
    world, django_capture_on_commit_callbacks
):
    # Given: the worker's first delivery in flight
    first = lease(world, timezone.now())

    # When: an operator kills it
    before = wakeups.generation(world.pk)
    with django_capture_on_commit_callbacks(execute=True):
        assert ledger.kill_deliveries(Delivery.objects.filter(pk=first)) == 1

    # Then: the subscriber is woken (what waited behind it, in an ordered queue, may go now)
    assert Delivery.objects.get(pk=first).status == Status.DEAD
    assert wakeups.generation(world.pk) == before + 1
