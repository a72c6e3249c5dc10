"""Group commit (delivery/group_commit.py): concurrent publishes to one queue share a transaction,
and each caller still gets its own answer, or its own error. Real threads, real database."""

import threading
import time

import pytest
from django.db import IntegrityError, connection, transaction

from delivery import group_commit, publishing, subscribing
from delivery.models import Delivery
from queues.models import Message, Queue
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber
from tests.support.queue_lock import QueueLock

pytestmark = pytest.mark.django_db(transaction=True)


def until(condition, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Caller(threading.Thread):
    """One client's publish, in a thread of its own as a request's would be."""

    def __init__(self, queue, outgoing, publisher=None):
        super().__init__()
        self.args_ = (queue, outgoing, publisher)
        self.answers = self.error = None

    def run(self):
        try:
            self.answers = group_commit.publish(*self.args_[:2], publisher=self.args_[2])
        except Exception as exc:
            self.error = exc
        finally:
            connection.close()


def waiting_count(queue):
    with group_commit._lock:
        return len(group_commit._waiting.get(queue.pk, []))


@pytest.fixture
def publisher_and_logger():
    queue = Queue.objects.create(name="db")
    publisher, _ = create_subscriber("api", publish=["db"], subscribe=["db"])
    logger, _ = create_subscriber("logger", subscribe=["db"])
    subscribing.subscribe(logger, queue)
    return queue, publisher


def blocked_leader(queue):
    """Start a publish that leads and then waits on the queue's lock; returns (lock, caller)."""
    lock = QueueLock(queue)
    lock.start()
    assert lock.held.wait(10)
    first = Caller(queue, [publishing.prepare("create", {"n": 0})])
    first.start()
    until(lambda: queue.pk in group_commit._busy and waiting_count(queue) == 0)
    time.sleep(0.2)  # the leader is inside its transaction, waiting for the lock
    return lock, first


def test_publishes_that_wait_together_commit_together_each_with_its_own_answer(publisher_and_logger):
    queue, publisher = publisher_and_logger
    lock, first = blocked_leader(queue)
    callers = [Caller(queue, [publishing.prepare("create", {"n": i})], publisher) for i in range(1, 9)]
    callers.append(Caller(queue, [publishing.prepare("delete", {"n": i}) for i in (9, 10)], publisher))
    for c in callers:
        c.start()
    until(lambda: waiting_count(queue) == len(callers))
    lock.release.set()
    for t in [lock, first, *callers]:
        t.join(30)

    assert first.error is None and all(c.error is None for c in callers)
    answers = [a for c in [first, *callers] for a, _ in c.answers]
    assert sorted(a["seq"] for a in answers) == list(range(1, 12))
    for c in callers:  # each caller's answer is its own message, as it was published
        for (answer, created), sent in zip(c.answers, c.args_[1], strict=True):
            m = Message.objects.get(pk=answer["id"])
            assert created and m.payload_json == sent.payload_json and m.event.name == answer["event"]
            assert m.publisher == publisher and answer["deliveries"] == 1
    # The nine who waited went in one transaction: one publish, one timestamp for all of them.
    waited = Message.objects.exclude(pk=first.answers[0][0]["id"])
    assert waited.values("created_at").distinct().count() == 1
    assert Delivery.objects.count() == 11


def test_one_callers_failure_is_its_own(publisher_and_logger):
    queue, publisher = publisher_and_logger
    lock, first = blocked_leader(queue)
    ghost = Subscriber(pk=987654, name="ghost")  # not in the database: its insert must fail
    bad = Caller(queue, [publishing.prepare("create", {"n": "bad"})], ghost)
    good = Caller(queue, [publishing.prepare("create", {"n": "good"})], publisher)
    bad.start()
    until(lambda: waiting_count(queue) == 1)
    good.start()
    until(lambda: waiting_count(queue) == 2)
    lock.release.set()
    for t in (lock, first, bad, good):
        t.join(30)

    assert first.error is None and good.error is None
    assert isinstance(bad.error, IntegrityError)
    assert sorted(Message.objects.values_list("payload_json", flat=True)) == ['{"n":"good"}', '{"n":0}']
    assert group_commit._busy == set() and group_commit._waiting == {}


def test_inside_a_callers_transaction_it_publishes_in_that_transaction(publisher_and_logger):
    queue, publisher = publisher_and_logger
    with pytest.raises(RuntimeError), transaction.atomic():
        group_commit.publish(queue, [publishing.prepare("create", 1)], publisher=publisher)
        assert Message.objects.count() == 1
        raise RuntimeError("the caller's transaction rolls back")
    assert Message.objects.count() == 0 and Delivery.objects.count() == 0


def test_many_concurrent_publishers_lose_nothing_and_keep_seq_dense(publisher_and_logger):
    queue, publisher = publisher_and_logger
    callers = [
        Caller(queue, [publishing.prepare("create", {"t": t, "i": i}) for i in range(t % 3 + 1)], publisher)
        for t in range(24)
    ]
    for c in callers:
        c.start()
    for c in callers:
        c.join(60)
    assert all(c.error is None for c in callers)
    ids = [a["id"] for c in callers for a, _ in c.answers]
    assert len(ids) == len(set(ids)) == sum(t % 3 + 1 for t in range(24))
    seqs = sorted(Message.objects.values_list("seq", flat=True))
    assert seqs == list(range(1, len(ids) + 1))
    for c in callers:  # a caller's own messages keep their order
        own = [a["seq"] for a, _ in c.answers]
        assert own == sorted(own)
