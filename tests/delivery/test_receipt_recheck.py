"""The receipts' recheck (delivery.receipts.recheck) costs what changed, not what is waited for:
it probes only the awaited messages whose receipt rows the ledger logged as moved since its last
pass (ReceiptMove), and every FULL_RECHECK_SECS all of them, for what no statement logged."""

import asyncio
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from delivery import ledger, publishing, receipts, subscribing, tasks
from delivery.models import ReceiptMove
from queues.models import Queue
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber

AWAITED = 200


@database_sync_to_async
def awaited_backlog():
    """AWAITED messages with a receipt published by `publisher`, each owed to `worker`, all leased:
    (publisher id, worker, their message ids, their delivery ids by message)."""
    queue = Queue.objects.create(name="jobs")
    publisher, _ = create_subscriber("publisher", publish=["jobs"], subscribe=[])
    worker, _ = create_subscriber("worker", publish=[], subscribe=["jobs"])
    subscribing.subscribe(worker, queue)
    outgoing = [publishing.Outgoing("create", str(i), None, receipt=True) for i in range(AWAITED)]
    answers = publishing.publish(queue, outgoing, publisher=publisher)
    leased = ledger.lease_deliveries(worker, limit=AWAITED)
    return publisher.pk, worker, [a["id"] for a, _ in answers], {d["message_id"]: d["id"] for d in leased}


class Probes:
    """A spy on settled_statement(): the ids each recheck probe asked about."""

    def __init__(self, monkeypatch):
        self.asked = []
        real = receipts.settled_statement

        def spy(ids):
            self.asked.append(sorted(ids))
            return real(ids)

        monkeypatch.setattr(receipts, "settled_statement", spy)

    def take(self):
        asked, self.asked = self.asked, []
        return asked


async def frames_of(sent, count):
    for _ in range(200):
        if len(sent) >= count:
            return sent
        await asyncio.sleep(0.05)
    return sent


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_recheck_probes_only_the_awaited_receipts_that_moved(monkeypatch):
    publisher_id, worker, message_ids, delivery_of = await awaited_backlog()
    # Every announcement lost (as from another process without Redis): only the recheck tells.
    monkeypatch.setattr(receipts, "check_after_commit", lambda ids: None)
    monkeypatch.setattr(receipts, "_reading", receipts.Reading())
    probes = Probes(monkeypatch)
    sent = []

    async def send(frame):
        sent.append(frame)

    owed = receipts.Owed(send, publisher_id)
    owed.refs = {i: f"r{i}" for i in message_ids}
    receipts.wait_for(message_ids, owed)
    try:
        await receipts.recheck()  # the first pass of a process reads where the log ends, and probes all
        assert probes.take() == [sorted(message_ids)]

        changed = message_ids[10:13]
        await database_sync_to_async(ledger.ack_deliveries)(worker, [delivery_of[i] for i in changed])
        await receipts.recheck()
        assert probes.take() == [sorted(changed)]
        assert sorted(f["id"] for f in await frames_of(sent, 3)) == sorted(changed)

        await receipts.recheck()  # nothing moved since
        assert probes.take() == []

        # The worker is deleted in the admin: its deliveries go by cascade, and no ledger
        # statement logs that. The next passes probe nothing, until the full one.
        await database_sync_to_async(lambda: Subscriber.objects.filter(pk=worker.pk).delete())()
        await receipts.recheck()
        assert probes.take() == []
        receipts._reading.full_at -= receipts.FULL_RECHECK_SECS
        await receipts.recheck()
        assert probes.take() == [sorted(set(message_ids) - set(changed))]
        assert sorted(f["id"] for f in await frames_of(sent, AWAITED)) == sorted(message_ids)
        assert receipts.waiting() == 0
    finally:
        owed.close()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_process_that_read_no_moves_for_long_probes_all_it_awaits(monkeypatch):
    """Its reading may be older than what the sweep pruned: it cannot know what it missed."""
    publisher_id, worker, message_ids, delivery_of = await awaited_backlog()
    monkeypatch.setattr(receipts, "check_after_commit", lambda ids: None)
    monkeypatch.setattr(receipts, "_reading", receipts.Reading())
    probes = Probes(monkeypatch)
    owed = receipts.Owed(lambda frame: asyncio.sleep(0), publisher_id)
    owed.refs = {i: "r" for i in message_ids}
    receipts.wait_for(message_ids, owed)
    try:
        await receipts.recheck()
        await receipts.recheck()
        assert probes.take() == [sorted(message_ids)]
        receipts._reading.read_at -= receipts.MOVES_KEPT_SECS
        await receipts.recheck()
        assert probes.take() == [sorted(message_ids)]
    finally:
        owed.close()


@pytest.mark.django_db
def test_the_sweep_prunes_the_moves_older_than_a_minute(logger, db_queue):
    old = ReceiptMove.objects.create(message_id=1)
    ReceiptMove.objects.filter(pk=old.pk).update(
        at=timezone.now() - timedelta(seconds=receipts.MOVES_KEPT_SECS + 5)
    )
    new = ReceiptMove.objects.create(message_id=2)
    tasks.sweep()
    assert list(ReceiptMove.objects.values_list("pk", flat=True)) == [new.pk]


@pytest.mark.django_db
def test_an_ack_or_nack_without_receipts_logs_nothing(logger, db_queue):
    subscribing.subscribe(logger, db_queue)
    publishing.publish(db_queue, [publishing.prepare("create", i) for i in range(4)])
    ids = [d["id"] for d in ledger.lease_deliveries(logger, limit=4)]
    ledger.ack_deliveries(logger, ids[:2])
    ledger.nack_deliveries(logger, ids[2:])
    assert not ReceiptMove.objects.exists()


def test_a_reading_remembers_the_ids_it_skipped_until_they_show_or_expire():
    """PostgreSQL takes an id at insert, not at commit: a lower id may show after a higher one."""
    reading = receipts.Reading()
    reading.start(10, now=0.0)
    reading.advance([(11, 100), (14, 101)], now=1.0)
    assert reading.after == 14 and sorted(reading.gaps) == [12, 13]
    reading.advance([(13, 102)], now=2.0)  # 13 committed late
    assert reading.after == 14 and sorted(reading.gaps) == [12]
    reading.advance([], now=1.0 + receipts.GAP_SECS + 1)  # 12 rolled back: given up on
    assert reading.gaps == {}
