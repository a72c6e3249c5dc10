"""A socket's lease (`framed`): each delivery's `message` frame written by PostgreSQL from the
stored payload and headers text, never decoded (delivery.frame_sql.message_frame_sql), is the
frame the API's encoder writes from the decoded delivery, field for field, for an unordered
lease and an ordered head, sync and async. On SQLite the lease describes as before and the
frame is encoded in Python: the same frame either way."""

import json
from datetime import UTC, datetime

import pytest
from channels.db import database_sync_to_async
from django.db import connection

from delivery import frames, ledger, publishing, subscribing
from queues.models import Message
from tests.delivery.test_async_ledger import way  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]

PAYLOADS = [
    {"n": 1, "text": 'été ✓ "quoted" \\ back', "nested": {"a": [1, 2.5, None, True]}},
    [1, "two", {"three": 3}],
    "just a string",
    12345678901234567890,
    None,
]


def the_messages():
    out = [publishing.prepare("create", p) for p in PAYLOADS]
    out.append(publishing.prepare("update", {"g": 1}, group='a "quoted" group, été \\ ✓'))
    out.append(publishing.prepare("update", {"h": 1}, headers={"trace": "abc", "n": "1"}))
    return out


async def lease_both_ways(way, subscriber, limit=100):  # noqa: F811
    leased = await way(ledger, "lease_deliveries")(subscriber, limit=limit, holder="ws.t", framed=True)
    described = {
        d["id"]: d for d in await database_sync_to_async(ledger._describe)([d["id"] for d in leased])
    }
    return leased, described


def same_frames(leased, described):
    assert leased
    for d in leased:
        assert json.loads(frames.message_text(d)) == json.loads(
            frames.encode(frames.message_frame(described[d["id"]]))
        )
        assert (d["queue"], d["event"], d["seq"]) == tuple(
            described[d["id"]][k] for k in ("queue", "event", "seq")
        )
        assert d["ack_deadline"] == described[d["id"]]["ack_deadline"]


async def test_a_framed_lease_sends_the_frame_the_encoder_writes(db_queue, logger, way):  # noqa: F811
    await database_sync_to_async(subscribing.subscribe)(logger, db_queue)
    await database_sync_to_async(publishing.publish)(db_queue, the_messages())
    # A time on the second: Python's isoformat leaves its microseconds out, and so must the SQL.
    first = await database_sync_to_async(lambda: Message.objects.order_by("id").first())()
    first.created_at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    await database_sync_to_async(first.save)(update_fields=["created_at"])
    leased, described = await lease_both_ways(way, logger)
    assert len(leased) == len(PAYLOADS) + 2
    same_frames(leased, described)
    frame = json.loads(frames.message_text(next(d for d in leased if d["seq"] == 1)))
    assert frame["published_at"] == "2026-01-02T03:04:05Z"
    assert json.loads(frames.message_text(leased[-1]))["headers"] == {"trace": "abc", "n": "1"}
    assert "headers" not in json.loads(frames.message_text(leased[0]))
    assert json.loads(frames.message_text(leased[0]))["group"] is None
    assert json.loads(frames.message_text(leased[-2]))["group"] == 'a "quoted" group, été \\ ✓'
    if connection.vendor == "postgresql":  # written by PostgreSQL, not encoded here
        assert all("frame" in d and "payload" not in d for d in leased)


async def test_an_ordered_head_is_framed_too(make_queue, make_subscriber, way):  # noqa: F811
    queue = await database_sync_to_async(make_queue)("ordered", ordered=True)
    subscriber = await database_sync_to_async(make_subscriber)("solo")
    await database_sync_to_async(subscribing.subscribe)(subscriber, queue)
    # One line (no group named), and a group of its own: each line's head, framed
    await database_sync_to_async(publishing.publish)(queue, the_messages())
    leased, described = await lease_both_ways(way, subscriber)
    assert [d["seq"] for d in leased] == [1, len(PAYLOADS) + 1]
    same_frames(leased, described)
    await database_sync_to_async(ledger.ack_deliveries)(subscriber, [leased[0]["id"]])
    after = await way(ledger, "lease_heads_after")(
        subscriber, [leased[0]["id"]], limit=1, holder="ws.t", framed=True
    )
    assert [d["seq"] for d in after] == [2]
    same_frames(after, {d["id"]: d for d in await database_sync_to_async(ledger._describe)([after[0]["id"]])})


async def test_the_times_of_delayed_and_expiring_messages_are_framed_as_the_encoder_writes_them(
    db_queue,
    logger,
    way,  # noqa: F811
):
    """deliver_at and expires_at: null when none, else a UTC time with microseconds only when
    there are some, as published_at."""
    await database_sync_to_async(subscribing.subscribe)(logger, db_queue)
    timed = [
        publishing.prepare("create", 1, ttl_secs=300 * 24 * 3600),
        publishing.prepare("create", 2, delay_secs=0.5, expires_at="2027-06-02T03:04:05Z"),
        publishing.prepare("create", 3),
    ]
    await database_sync_to_async(publishing.publish)(db_queue, timed)
    later = datetime(2027, 1, 1, tzinfo=UTC)  # every delay behind it, no expiry yet
    leased = await way(ledger, "lease_deliveries")(logger, limit=10, holder="ws.t", framed=True, now=later)
    described = {
        d["id"]: d for d in await database_sync_to_async(ledger._describe)([d["id"] for d in leased])
    }
    assert len(leased) == 3
    same_frames(leased, described)
    by_seq = {d["seq"]: json.loads(frames.message_text(d)) for d in leased}
    assert by_seq[1]["deliver_at"] is None and by_seq[1]["expires_at"].endswith("Z")
    assert by_seq[2]["expires_at"] == "2027-06-02T03:04:05Z" and by_seq[2]["deliver_at"].endswith("Z")
    assert by_seq[3]["deliver_at"] is None and by_seq[3]["expires_at"] is None


async def test_a_messages_frame_holds_the_texts():
    texts = [frames.encode(frames.message_frame({k: i for k in frames.MESSAGE_FIELDS})) for i in range(3)]
    assert json.loads(frames.messages_text(texts)) == {
        "type": "messages",
        "messages": [json.loads(t) for t in texts],
    }


async def test_a_lease_again_checks_what_the_read_would_have(db_queue, logger, way):  # noqa: F811
    """alease_again (a socket's next lease with no read first) leases nothing from a paused queue,
    a paused subscription, a subscription replaying or leaving, or a subscriber that lost its
    right; else the next ones."""
    from django.utils import timezone

    from subscribers.models import Subscription

    sub, _ = await database_sync_to_async(subscribing.subscribe)(logger, db_queue)
    await database_sync_to_async(publishing.publish)(db_queue, the_messages())
    found = []
    first = await ledger.alease_deliveries(logger, limit=2, holder="ws.t", framed=True, found=found)
    assert [d["seq"] for d in first] == [1, 2]
    if connection.vendor == "postgresql":
        assert found == [ledger.Again(sub.pk, db_queue.ack_timeout, None)]
    again = ledger.Again(sub.pk, db_queue.ack_timeout, None)

    async def lease_again():
        return await way(ledger, "lease_again")(logger, again, limit=1, holder="ws.t")

    def set_(model, pk, **fields):
        return database_sync_to_async(lambda: model.objects.filter(pk=pk).update(**fields))()

    await set_(type(db_queue), db_queue.pk, paused=True)
    assert await lease_again() == []
    await set_(type(db_queue), db_queue.pk, paused=False)
    await set_(Subscription, sub.pk, paused=True)
    assert await lease_again() == []
    await set_(Subscription, sub.pk, paused=False)
    await set_(Subscription, sub.pk, busy_since=timezone.now())
    assert await lease_again() == []
    await set_(Subscription, sub.pk, busy_since=None)
    rights = type(logger).subscribe_queues.through
    await database_sync_to_async(lambda: rights.objects.filter(subscriber_id=logger.pk).delete())()
    assert await lease_again() == []
    await database_sync_to_async(
        lambda: rights.objects.create(subscriber_id=logger.pk, queue_id=db_queue.pk)
    )()
    assert [d["seq"] for d in await lease_again()] == [3]
