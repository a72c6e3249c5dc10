"""Real threads against the real database (run on SQLite and on PostgreSQL by `make test`)."""

import random
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber

pytestmark = pytest.mark.django_db(transaction=True)


def run_threads(target, count):
    errors = []

    def wrapped(i):
        try:
            target(i)
        except Exception as exc:  # reported below, so a failing thread fails the test
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_it_never_hands_one_delivery_to_two_leasers_at_once():
    queue = Queue.objects.create(name="db")
    subscriber, _ = create_subscriber("worker", publish=["*"], subscribe=["*"])
    subscribing.subscribe(subscriber, queue)
    total = 600
    for start in range(0, total, 200):
        publishing.publish(queue, [publishing.prepare("create", i) for i in range(start, start + 200)])
    handed = Counter()
    lock = threading.Lock()

    def leaser(i):
        while True:
            got = ledger.lease_deliveries(subscriber, limit=7, holder=f"t{i}")
            if not got:
                return
            with lock:
                handed.update(d["id"] for d in got)

    run_threads(leaser, 8)
    assert sum(handed.values()) == total, "every delivery handed out"
    assert max(handed.values()) == 1, "no delivery handed out twice"
    assert Delivery.objects.filter(status=Status.INFLIGHT).count() == total


def test_an_ordered_subscription_hands_out_one_at_a_time_under_concurrent_leasers():
    queue = Queue.objects.create(name="fifo", ordered=True)
    subscriber, _ = create_subscriber("worker", publish=["*"], subscribe=["*"])
    subscribing.subscribe(subscriber, queue)
    publishing.publish(queue, [publishing.prepare("create", i) for i in range(40)])
    received, lock = [], threading.Lock()
    holding = {"now": 0, "max": 0}

    def leaser(i):
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 1.5:
            got = ledger.lease_deliveries(subscriber, limit=5)
            if not got:
                time.sleep(0.002)
                continue
            idle_since = time.monotonic()
            with lock:
                holding["now"] += len(got)
                holding["max"] = max(holding["max"], holding["now"])
                received.extend(d["seq"] for d in got)
                holding["now"] -= len(got)  # acked below, before anyone can lease the next
                ledger.ack_deliveries(subscriber, [d["id"] for d in got])

    run_threads(leaser, 4)
    assert received == list(range(1, 41))
    assert holding["max"] == 1


def test_seq_follows_commit_order_so_a_reader_never_skips_a_committed_message():
    """Publishers hold their transactions open for random times; a reader that catches up by
    "seq greater than the last I saw" must still see every message (commit order = seq order)."""
    queue = Queue.objects.create(name="db")
    publishers, per_publisher = 6, 15
    done = threading.Event()
    seen = []

    def publisher(i):
        rnd = random.Random(i)
        for _ in range(per_publisher):
            with transaction.atomic():
                publishing.publish(queue, [publishing.prepare("create", {"p": i})])
                time.sleep(rnd.uniform(0, 0.01))  # the rest of the caller's transaction

    def reader():
        cursor = 0
        try:
            while True:
                finished = done.is_set()
                new = list(
                    Message.objects.filter(queue=queue, seq__gt=cursor)
                    .order_by("seq")
                    .values_list("seq", flat=True)
                )
                seen.extend(new)
                if new:
                    cursor = new[-1]
                if finished:
                    return
                time.sleep(0.001)
        finally:
            connection.close()

    r = threading.Thread(target=reader)
    r.start()
    run_threads(publisher, publishers)
    done.set()
    r.join(timeout=60)
    total = publishers * per_publisher
    assert sorted(Message.objects.values_list("seq", flat=True)) == list(range(1, total + 1))
    assert seen == list(range(1, total + 1)), "the reader skipped or repeated a seq"


def test_concurrent_publishes_of_one_key_make_one_message():
    queue = Queue.objects.create(name="db")
    keys, threads = 20, 6
    answers, lock = [], threading.Lock()
    start = threading.Barrier(threads)

    def publisher(i):
        start.wait()
        for k in range(keys):
            got = publishing.publish(queue, [publishing.prepare("create", i, key=f"key-{k}")])
            with lock:
                answers.extend(got)

    run_threads(publisher, threads)
    assert Message.objects.count() == keys
    assert len({a["id"] for a, _ in answers}) == keys
    assert sum(created for _, created in answers) == keys


def test_publishers_and_ordered_leasers_at_once_never_deadlock():
    """Publishers hold the queue row and check their foreign keys (to the subscriber) at
    commit; an ordered lease locks its subscription row. Were that lock to take the queue and
    subscriber rows too, the two would deadlock and PostgreSQL would fail one of them (a 500)."""
    queue = Queue.objects.create(name="fifo", ordered=True)
    subscribers = []
    for name in ("a", "b"):
        subscriber, _ = create_subscriber(name, publish=["*"], subscribe=["*"])
        subscribing.subscribe(subscriber, queue)
        subscribers.append(subscriber)
    until = time.monotonic() + 3

    def work(i):
        if i < 3:
            while time.monotonic() < until:
                publishing.publish(queue, [publishing.prepare("create", i)])
        else:
            subscriber = subscribers[i % 2]
            while time.monotonic() < until:
                got = ledger.lease_deliveries(subscriber, limit=10)
                ledger.ack_deliveries(subscriber, [d["id"] for d in got])

    run_threads(work, 7)


def test_keyed_publishers_and_leasers_that_re_lease_expired_deliveries_never_deadlock():
    """A keyed publish locks its queue row; a lease that expires a delivery and hands it out
    again in one transaction updates that row twice, so PostgreSQL checks the row's foreign
    keys (its queue among them) at commit, while holding its subscription row; the publisher
    checks its deliveries' keys (that subscription among them) at its commit. Locks that block
    key checks (FOR UPDATE) would deadlock the two."""
    queue = Queue.objects.create(name="fifo", ordered=True)
    subscribers = []
    for name in ("a", "b"):
        subscriber, _ = create_subscriber(name, publish=["*"], subscribe=["*"])
        subscribing.subscribe(subscriber, queue)
        subscribers.append(subscriber)
    until = time.monotonic() + 3
    later = iter(range(10**9))

    def work(i):
        if i < 3:
            while time.monotonic() < until:
                publishing.publish(queue, [publishing.prepare("create", i, key=f"{i}-{next(later)}")])
        else:
            subscriber = subscribers[i % 2]
            while time.monotonic() < until:
                # never acked, and "now" hours ahead: each lease expires what the last one took
                # and hands it out again, in one transaction
                ahead = timezone.now() + timedelta(hours=1 + next(later))
                ledger.lease_deliveries(subscriber, limit=10, now=ahead)

    run_threads(work, 7)
