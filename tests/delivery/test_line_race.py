"""The race of message groups (delivery.lines): a publish adding a group's next message while
an ack closes the group's head. Unserialised, the publish sees the old head still open (so its
message is not the head) and the ack's promotion does not see the new message (not committed):
the group would be stuck for good. The lines lock serialises the two; here they run at once,
many rounds, from threads on their own connections (PostgreSQL; SQLite has one writer), and
nothing may get stuck, go out of order, or be in flight twice in one group."""

import threading
import time
from collections import defaultdict

import pytest
from django.db import connection

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery, Status

pytestmark = pytest.mark.django_db(transaction=True)

GROUPS = ["a", "b", "c", None]
ROUNDS = 400


def _publisher(queue, done, errors):
    try:
        for i in range(ROUNDS):
            group = GROUPS[i % len(GROUPS)]
            if i % 7 == 0:  # now and then a batch of two of one group, one statement
                publishing.publish(
                    queue,
                    [
                        publishing.prepare("e", {"i": i}, group=group),
                        publishing.prepare("e", {"i": i, "again": True}, group=group),
                    ],
                )
            else:
                publishing.publish(queue, [publishing.prepare("e", {"i": i}, group=group)])
    except Exception as exc:  # noqa: BLE001 (reported by the test)
        errors.append(exc)
    finally:
        done.set()
        connection.close()


def _consumer(subscriber, name, published, leased, lock, stop, errors):
    try:
        while not stop.is_set():
            got = ledger.lease_deliveries(subscriber, limit=10, holder=name)
            with lock:
                for d in got:
                    leased[d["group"]].append(d["seq"])
            if got:
                ledger.ack_deliveries(subscriber, [d["id"] for d in got])
            else:
                time.sleep(0.001)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        connection.close()


def test_publishing_into_a_group_while_its_head_is_acked_never_sticks_nor_reorders(
    make_queue, make_subscriber
):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has one writer at a time: no race to serialise")
    queue = make_queue("line", ordered=True)
    subscriber = make_subscriber("worker")
    subscribing.subscribe(subscriber, queue)
    leased, lock, errors = defaultdict(list), threading.Lock(), []
    published, stop = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_publisher, args=(queue, published, errors))]
    threads += [
        threading.Thread(target=_consumer, args=(subscriber, f"t{k}", published, leased, lock, stop, errors))
        for k in range(3)
    ]
    for t in threads:
        t.start()
    published.wait(120)
    expected = Delivery.objects.filter(queue=queue).count()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if Delivery.objects.filter(queue=queue, status=Status.ACKED).count() == expected:
            break
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors

    # Nothing stuck: every delivery acked, no line left with a pending message and no head
    stuck = Delivery.objects.filter(queue=queue).exclude(status=Status.ACKED)
    assert list(stuck.values_list("seq", "grp", "status", "head")) == []
    # Each once, and in seq order within its group (a group's next goes only after its ack)
    for group, seqs in leased.items():
        assert seqs == sorted(seqs), group
        assert len(seqs) == len(set(seqs)), group
    assert sum(len(s) for s in leased.values()) == expected
