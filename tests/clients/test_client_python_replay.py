"""The Python client's replay, seek and receipts against a real Daphne: a subscription that
starts in the past, a seek that hands out again what was acked, and a receipt that counts a
message's deliveries by state."""

import asyncio

import pytest
from django.db import connection
from mqclient import Acked, AsyncClient, Client, MQNotFound, Published, Receipt, Subscription

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
