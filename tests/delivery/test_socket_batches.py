"""Batch frames (API.md, Extensions): a `publish` frame with `messages`, all or nothing and
answered once; `"batch": true` on `subscribe` for `messages` frames, the window counting items."""

import json

import pytest
from django.test import override_settings

from delivery import consumers, subscribing
from delivery.models import Delivery, Status
from queues.models import Message
from tests.support.fields import MESSAGE_FRAME_FIELDS
from tests.support.publish import apublish
from tests.support.sockets import connect, db, recv, send, setup

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


def items(n, start=0, event="create"):
    return [{"event": event, "payload": {"n": start + i}} for i in range(n)]


async def test_a_batch_publish_frame_is_answered_once_with_every_message_in_order():
    queue, (owner, token), (peer, _) = await setup()
    await db(lambda: subscribing.subscribe(peer, queue))
    comm = await connect(token)
    batch = [*items(2), {"event": "delete", "payload": None, "key": "k-1"}]
    await send(comm, {"type": "publish", "queue": "db", "messages": batch, "ref": "b1"})
    answer = await recv(comm)
    assert answer["type"] == "published" and answer["ref"] == "b1"
    assert [m["seq"] for m in answer["messages"]] == [1, 2, 3]
    assert all(set(m) == {"id", "seq", "deliveries"} and m["deliveries"] == 1 for m in answer["messages"])
    stored = await db(lambda: list(Message.objects.order_by("seq").values_list("id", "event__name", "key")))
    assert stored == [
        (m["id"], e, k)
        for m, e, k in zip(
            answer["messages"], ["create", "create", "delete"], [None, None, "k-1"], strict=True
        )
    ]
    await comm.disconnect()


async def test_batch_and_single_frames_keep_the_order_they_were_sent_in():
    _, (_, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": "db", "event": "create", "payload": 0, "ref": 1})
    await send(comm, {"type": "publish", "queue": "db", "messages": items(3, 1), "ref": 2})
    await send(comm, {"type": "publish", "queue": "db", "event": "create", "payload": 4, "ref": 3})
    answers = {a["ref"]: a for a in [await recv(comm) for _ in range(3)]}
    assert answers[1]["seq"] == 1
    assert [m["seq"] for m in answers[2]["messages"]] == [2, 3, 4]
    assert answers[3]["seq"] == 5
    payloads = await db(lambda: list(Message.objects.order_by("seq").values_list("payload_json", flat=True)))
    assert [json.loads(p) for p in payloads] == [0, {"n": 1}, {"n": 2}, {"n": 3}, 4]
    await comm.disconnect()


@pytest.mark.parametrize(
    ("bad", "code", "words"),
    [
        ({"event": "create", "payload": 1, "key": ""}, "bad_message", "messages[1]"),
        ({"event": "no way", "payload": 1}, "bad_message", "messages[1]"),
        ({"event": "create"}, "bad_frame", "messages[1]"),
        ("not an object", "bad_message", "messages[1]"),
        ({"event": "create", "payload": "x" * 300_000}, "too_large", "messages[1]"),
    ],
)
async def test_a_bad_item_refuses_the_whole_batch_naming_its_index(bad, code, words):
    _, (_, token), _ = await setup()
    comm = await connect(token)
    batch = [items(1)[0], bad, items(1, 2)[0]]
    raw = json.dumps({"type": "publish", "queue": "db", "messages": batch, "ref": "x"})
    await comm.send_to(text_data=raw)
    error = await recv(comm)
    assert error["type"] == "error" and error["code"] == code and error["ref"] == "x"
    assert words in error["detail"] and error["index"] == 1
    assert await db(Message.objects.count) == 0  # nothing of it was published
    await send(comm, {"type": "ping", "ref": "still open"})
    assert (await recv(comm))["type"] == "pong"
    await comm.disconnect()


@pytest.mark.parametrize("messages", [[], "many", [{"event": "create", "payload": 1}] * 1001])
async def test_a_batch_must_hold_one_to_a_thousand_messages(messages):
    _, (_, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": "db", "messages": messages})
    error = await recv(comm)
    assert (error["type"], error["code"]) == ("error", "bad_frame") and "1 to 1000" in error["detail"]
    assert await db(Message.objects.count) == 0
    await comm.disconnect()


async def test_a_batch_of_a_thousand_is_one_publish_and_one_answer():
    _, (_, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": "db", "messages": items(1000), "ref": "big"})
    answer = await recv(comm, timeout=10)
    assert [m["seq"] for m in answer["messages"]] == list(range(1, 1001))
    assert await comm.receive_nothing(timeout=0.2)
    assert await db(Message.objects.count) == 1000
    await comm.disconnect()


@pytest.mark.parametrize(
    ("queue", "code"), [("nowhere", "not_found"), ("secret", "forbidden"), ("no way", "bad_name")]
)
async def test_a_batch_to_a_queue_it_may_not_publish_to_is_refused_whole(queue, code):
    _, (_, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "publish", "queue": queue, "messages": items(3), "ref": 9})
    error = await recv(comm)
    assert (error["type"], error["code"], error["ref"]) == ("error", code, 9)
    assert await db(Message.objects.count) == 0
    await comm.disconnect()


# --- batch delivery --------------------------------------------------------------------------


async def test_a_batch_subscription_gets_messages_frames_of_message_frames_acked_as_usual():
    queue, (owner, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "batch": True})
    assert (await recv(comm))["type"] == "subscribed"
    await apublish(queue, 5)
    got = []
    while len(got) < 5:
        frame = await recv(comm)
        assert frame["type"] == "messages" and set(frame) == {"type", "messages"}
        got += frame["messages"]
    assert [m["seq"] for m in got] == [1, 2, 3, 4, 5]
    assert all(m["type"] == "message" and m["attempt"] == 1 for m in got)
    assert set(got[0]) == MESSAGE_FRAME_FIELDS
    await send(comm, {"type": "ack", "ids": [m["id"] for m in got]})
    await comm.receive_nothing(timeout=0.3)
    assert await db(lambda: set(Delivery.objects.values_list("status", flat=True))) == {Status.ACKED}
    await comm.disconnect()


@override_settings(MQ_PREFETCH=3)
async def test_the_window_counts_the_items_of_messages_frames(monkeypatch):
    # The resume waits for the subscribe frame below however slow this test's machine (its 0.2 s
    # grace ran out once in make test, and the catch-up went out unbatched before it).
    monkeypatch.setattr(consumers, "RESUME_GRACE_SECS", 30)
    queue, (owner, token), _ = await setup()
    await db(lambda: subscribing.subscribe(owner, queue))
    await apublish(queue, 5)  # waiting before the socket comes: the catch-up is batched too
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "batch": True})
    assert (await recv(comm))["type"] == "subscribed"
    first = await recv(comm)
    assert [m["seq"] for m in first["messages"]] == [1, 2, 3]
    assert await comm.receive_nothing(timeout=0.4)  # the window is full
    await send(comm, {"type": "ack", "ids": [first["messages"][0]["id"]]})
    second = await recv(comm)
    assert [m["seq"] for m in second["messages"]] == [4]
    await comm.disconnect()


async def test_without_batch_a_subscription_gets_message_frames_and_batch_must_be_a_boolean():
    queue, (owner, token), _ = await setup()
    comm = await connect(token)
    await send(comm, {"type": "subscribe", "queue": "db", "batch": "yes"})
    error = await recv(comm)
    assert (error["type"], error["code"]) == ("error", "bad_frame")
    await send(comm, {"type": "subscribe", "queue": "db", "event": "create", "batch": False})
    assert (await recv(comm))["type"] == "subscribed"
    await apublish(queue, 2)
    assert [(await recv(comm))["type"] for _ in range(2)] == ["message", "message"]
    await comm.disconnect()
