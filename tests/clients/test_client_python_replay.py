"""The Python client's replay, seek and receipts against a real Daphne: a subscription that
starts in the past, a seek that hands out again what was acked (to a listen() handler of the
same client too), and a receipt that counts a message's deliveries by state."""

import asyncio

import pytest
from django.db import connection
from mqclient import Acked, AsyncClient, Client, MQNotFound, Published, Receipt, Subscription

from delivery.models import Delivery, Status
from subscribers import models as subscribers
from tests.support.listening import Listening
from tests.support.servers import eventually

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="the client, whatever the server's database: the SQLite pass of make test runs it",
    ),
]


def test_subscribe_from_a_seq_seek_back_and_the_receipt_of_a_message(server, logger, peer):
    with Client(server.http, peer.token) as publisher, Client(server.http, logger.token) as mq:
        published = publisher.publish_many("db", [("create", {"n": n}) for n in range(4)])
        # a new subscription from seq 3 owes the last two, not the first two
        sub = mq.subscribe("db", "create", from_=3)
        assert sub["replay"] == {"from_seq": 3, "deliveries": 2}
        pulled = mq.pull("db")
        assert [d.payload["n"] for d in pulled] == [2, 3]
        receipt = publisher.receipt(published[3])
        assert receipt["id"] == published[3]["id"] and receipt["deliveries"]["inflight"] == 1
        mq.ack(pulled)
        assert publisher.receipt(published[3]["id"])["deliveries"]["acked"] == 1
        with pytest.raises(MQNotFound):
            mq.receipt(published[3])  # only its publisher (or an operator) reads it
        # seek to seq 1: what the subscription lacks from there is owed, what it acked again
        assert mq.seek(sub, 1)["replay"]["from_seq"] == 1
        assert sorted(d.payload["n"] for d in mq.pull("db")) == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="seq or a time"):
            mq.seek(sub, "all")


def test_the_asyncio_client_subscribes_from_all_and_reads_receipts(server, logger):
    async def main():
        async with AsyncClient(server.http, logger.token) as mq:
            first = await mq.publish("db", "create", {"n": 0})
            sub = await mq.subscribe("db", "create", from_="all")
            assert sub["replay"]["deliveries"] == 1
            (delivery,) = await mq.pull("db")
            await delivery.ack()
            assert (await mq.receipt(first))["deliveries"]["acked"] == 1

    asyncio.run(main())


def test_answers_are_typed_and_still_the_dicts_the_server_sent(server, logger):
    with Client(server.http, logger.token) as mq:
        sub = mq.subscribe("db", "create")
        published = mq.publish("db", "create", {"n": 1}, key="k1")
        assert isinstance(published, Published) and isinstance(published, dict)
        assert (published.id, published.seq, published.deliveries) == (
            published["id"],
            published["seq"],
            1,
        )
        assert published.created_at.tzinfo is not None  # an aware datetime; the dict keeps the text
        assert isinstance(published["created_at"], str)
        assert isinstance(sub, Subscription) and sub.queue == "db" and sub.paused is False
        assert sub.replay is None  # a field the server did not send
        (delivery,) = mq.pull("db")
        receipt = mq.receipt(published)
        assert isinstance(receipt, Receipt) and not receipt.settled
        acked = mq.ack(delivery)
        assert isinstance(acked, Acked) and acked == {"acked": 1, "unknown": []} and acked.acked == 1
        assert mq.receipt(published).settled
        assert mq.extend(delivery, 5).unknown == [delivery.id]
        assert [m.seq for m in mq.publish_many("db", [("create", 2), ("create", 3)])] == [2, 3]


def acked_ids():
    return set(Delivery.objects.filter(status=Status.ACKED).values_list("id", flat=True))


def test_a_listen_handler_is_handed_again_what_its_own_client_seeks_back(server, logger):
    """The client remembers the ids it acked (a redelivery after a lost ack is acked again,
    not handled); a seek hands out those same ids again, so its seek must forget them."""
    handled = []
    with Client(server.http, logger.token) as mq:
        listening = Listening(mq, lambda d: handled.append((d.id, d.payload["n"], d.attempt)))
        assert eventually(lambda: subscribers.Subscription.objects.filter(subscriber=logger).exists())
        published = mq.publish_many("db", [("create", {"n": n}) for n in range(3)])
        assert eventually(lambda: len(handled) == 3 and len(acked_ids()) == 3, timeout=10)
        # the id alone: the client knows its queue and event from the socket's `subscribed` frame
        sub = subscribers.Subscription.objects.get(subscriber=logger)
        assert mq.seek(sub.pk, published[1]["seq"])["replay"]["deliveries"] == 2
        assert eventually(lambda: len(handled) == 5 and len(acked_ids()) == 3, timeout=10)
        listening.stop()
    first, again = handled[:3], handled[3:]
    assert [(i, n) for i, n, _ in again] == [(i, n) for i, n, _ in first[1:]]  # the same ids
    assert [attempt for _, _, attempt in again] == [2, 2]


def test_the_asyncio_listen_is_handed_again_what_its_client_seeks_back(server, logger):
    """The same with AsyncClient, the seek given subscribe()'s answer (its queue and event)."""
    handled = []

    async def until(check):
        for _ in range(200):
            if await check():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not within 10 s: {handled}")

    async def scenario():
        async with AsyncClient(server.http, logger.token) as mq:
            sub = await mq.subscribe("db", "create")
            listen = asyncio.ensure_future(mq.listen(lambda d: handled.append((d.id, d.attempt))))
            published = await mq.publish_many("db", [("create", {"n": n}) for n in range(3)])

            async def handled_and_acked(count):
                # the acks reached the server (a seek reopens acked ones only)
                receipts = [await mq.receipt(m) for m in published]
                return len(handled) == count and all(r.settled for r in receipts)

            await until(lambda: handled_and_acked(3))
            assert (await mq.seek(sub, published[0]["seq"]))["replay"]["deliveries"] == 3
            await until(lambda: handled_and_acked(6))
            mq.stop()
            await asyncio.wait_for(listen, 20)

    asyncio.run(scenario())
    assert [i for i, _ in handled[3:]] == [i for i, _ in handled[:3]]
    assert [attempt for _, attempt in handled] == [1, 1, 1, 2, 2, 2]
