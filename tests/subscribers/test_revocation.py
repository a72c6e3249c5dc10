"""Revocation on open sockets (issue 14, item 1), in one process, through Channels'
WebsocketCommunicator: the announcement after commit, the periodic token check (the safety
net when the announcement is lost), withdrawn rights, an operator closing a connection, and
the throttle on failed token attempts. Across processes: tests/e2e/test_revocation.py."""

import asyncio
import json
import time

import pytest
from django.test import override_settings

from delivery import frames, ledger, presence, revocation, subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.models import Connection, Subscriber, Subscription
from subscribers.provisioning import provision_subscriber
from tests.support.personas import asubscribed_owner
from tests.support.publish import apublish
from tests.support.sockets import connect, db, recv

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


async def closed_with(comm, timeout=3):
    """(close code, seconds it took): frames sent before the close are skipped."""
    started = time.monotonic()
    while True:
        out = await comm.receive_output(timeout=timeout)
        if out["type"] == "websocket.close":
            return out.get("code"), time.monotonic() - started


async def ping(comm):
    await comm.send_to(text_data=json.dumps({"type": "ping", "ref": 1}))
    assert await recv(comm) == {"type": "pong", "ref": 1}


async def no_frame(comm, timeout=0.5):
    assert await comm.receive_nothing(timeout=timeout)


def rotate(owner):
    provision_subscriber(owner.name, publish=["db"], subscribe=["db"], update=True)  # createsubscriber's path


def deactivate(owner):
    owner.is_active = False
    owner.save()


def delete(owner):
    Subscriber.objects.filter(pk=owner.pk).first().delete()


@pytest.mark.parametrize("change", [rotate, deactivate, delete])
async def test_a_revoked_subscribers_socket_is_closed_with_4401_and_what_it_held_goes_back(change):
    queue, owner, token, _ = await asubscribed_owner()
    await apublish(queue, 2)
    comm = await connect(token)
    held = [await recv(comm), await recv(comm)]
    assert {f["type"] for f in held} == {"message"}
    await db(change, owner)
    code, took = await closed_with(comm, timeout=2)
    assert code == 4401 and took < 2
    assert await db(Connection.objects.count) == 0
    if change is not delete:  # deleting the subscriber deletes what it was owed
        rows = await db(lambda: list(Delivery.objects.values_list("status", "attempt", "lease_holder")))
        assert rows == [(Status.PENDING, 0, "")] * 2  # the attempt given back: not its failure


async def test_the_token_check_closes_a_revoked_socket_when_the_announcement_is_lost():
    """A change that bypasses the signals (a queryset update; or Redis losing the word) is
    found by the process's periodic check, well within 2 s."""
    _, owner, token, _ = await asubscribed_owner()
    comm = await connect(token)
    await ping(comm)
    await db(lambda: Subscriber.objects.filter(pk=owner.pk).update(token_hash="0" * 64))
    code, took = await closed_with(comm, timeout=2)
    assert code == 4401 and took < 2
    comm2 = await connect(token)  # and the old token no longer opens one
    assert (await closed_with(comm2))[0] == 4401


async def test_the_check_ends_a_withdrawn_subscription_when_the_announcement_is_lost():
    """A right withdrawn without the signals (a queryset delete; or Redis losing the word) is
    found by the same periodic check: the socket is told, within 2 s, and holds nothing of it."""
    queue, owner, token, subscription = await asubscribed_owner()
    await apublish(queue, 1)
    comm = await connect(token)
    assert (await recv(comm))["type"] == "message"
    await asyncio.sleep(0.6)  # a check has seen the rights as they were
    started = time.monotonic()
    through = Subscriber.subscribe_queues.through.objects
    await db(lambda: through.filter(subscriber_id=owner.pk, queue_id=queue.pk).delete())
    frame = await recv(comm, timeout=2)
    assert (frame["type"], frame["subscription"], frame["reason"]) == (
        "unsubscribed",
        subscription.pk,
        "forbidden",
    )
    assert time.monotonic() - started < 2
    assert await db(lambda: list(Delivery.objects.values_list("status", "attempt"))) == [(Status.PENDING, 0)]
    await comm.disconnect()


async def test_changes_that_keep_the_token_leave_the_socket_open():
    _, owner, token, _ = await asubscribed_owner()
    comm = await connect(token)
    await ping(comm)

    def rename():
        owner.webhook_url = ""
        owner.publish_all = True
        owner.save()

    await db(rename)
    await no_frame(comm, timeout=1.2)  # past two token checks
    await ping(comm)
    await comm.disconnect()


async def test_withdrawing_a_subscribe_right_ends_the_subscription_on_the_socket():
    queue, owner, token, subscription = await asubscribed_owner()
    other = await db(Queue.objects.create, name="other")
    await db(owner.subscribe_queues.add, other)
    other_sub, _ = await db(subscribing.subscribe, owner, other)
    await apublish(queue, 2)
    comm = await connect(token)
    held = [await recv(comm), await recv(comm)]
    assert [f["queue"] for f in held] == ["db", "db"]

    await db(owner.subscribe_queues.remove, queue)
    assert await recv(comm, timeout=2) == {
        "type": "unsubscribed",
        "subscription": subscription.pk,
        "queue": "db",
        "event": None,
        "reason": "forbidden",
    }
    # What the socket held of it is pending again, the attempt given back; the subscription
    # and what it is owed stay, for operators to see.
    rows = await db(lambda: list(Delivery.objects.values_list("status", "attempt", "lease_holder")))
    assert rows == [(Status.PENDING, 0, "")] * 2
    assert await db(Subscription.objects.filter(pk=subscription.pk).exists)

    # No more of its deliveries: none made (fan-out), none leased (socket or pull).
    await apublish(queue, 3)
    await no_frame(comm)
    assert await db(Delivery.objects.count) == 2
    assert await db(ledger.lease_deliveries, owner, limit=10) == []
    # Other subscriptions go on, and the socket stays open.
    other_queue = await db(Queue.objects.get, name="other")
    await apublish(other_queue, 1)
    frame = await recv(comm)
    assert (frame["type"], frame["queue"]) == ("message", "other")
    await comm.disconnect()


async def test_withdrawing_a_publish_right_answers_the_next_publish_forbidden():
    """The socket keeps its Subscriber (publish_all is not asked again at each frame): the
    announcement refreshes it."""
    _, owner, token, _ = await asubscribed_owner()
    await db(lambda: (owner.publish_queues.clear(), setattr(owner, "publish_all", True), owner.save()))
    comm = await connect(token)
    frame = {"type": "publish", "queue": "db", "event": "create", "payload": 1, "ref": "a"}
    await comm.send_to(text_data=json.dumps(frame))
    # Answered, and its own subscription's delivery, in either order.
    assert {(await recv(comm))["type"] for _ in range(2)} == {"published", "message"}
    await db(lambda: (setattr(owner, "publish_all", False), owner.save()))
    await no_frame(comm, timeout=0.3)  # the announcement is heard
    await comm.send_to(text_data=json.dumps({**frame, "ref": "b"}))
    answer = await recv(comm)
    assert (answer["type"], answer["code"], answer["ref"]) == ("error", "forbidden", "b")
    await comm.disconnect()


async def test_an_announced_connection_is_closed_by_its_process():
    _, _, token, _ = await asubscribed_owner()
    comm = await connect(token)
    await ping(comm)
    (name,) = await db(lambda: list(Connection.objects.values_list("channel_name", flat=True)))
    await db(lambda: (presence.close_connection(name), revocation.announce(channel_names=[name])))
    code, took = await closed_with(comm, timeout=2)
    assert code == frames.CLOSE_BY_OPERATOR and took < 2


async def test_a_connection_whose_row_is_gone_is_closed_at_the_next_heartbeat(monkeypatch):
    """The announcement lost: the heartbeat's UPDATE finds the row gone and closes the socket."""
    monkeypatch.setattr(presence, "HEARTBEAT_SECS", 0.3)
    _, _, token, _ = await asubscribed_owner()
    comm = await connect(token)
    await ping(comm)
    await db(lambda: Connection.objects.all().delete())  # no announcement
    code, took = await closed_with(comm, timeout=2)
    assert code == frames.CLOSE_BY_OPERATOR and took < 2


async def test_the_heartbeat_names_the_connections_whose_row_is_gone():
    _, owner, _, _ = await asubscribed_owner()
    await db(presence.open_connection, owner, "ws.kept")
    assert await db(presence.heartbeat, ["ws.kept", "ws.gone"]) == {"ws.gone"}


@override_settings(MQ_AUTH_FAILURES_PER_MINUTE=2)
async def test_failed_token_attempts_from_an_address_are_throttled_4429():
    _, _, token, _ = await asubscribed_owner()
    here, there = ("10.0.0.7", 5000), ("10.0.0.8", 5000)
    for _ in range(2):
        assert (await closed_with(await connect("mq_wrong", client=here)))[0] == 4401
    assert (await closed_with(await connect("mq_wrong", client=here)))[0] == 4429
    assert (await closed_with(await connect("mq_wrong", client=there)))[0] == 4401  # per address
    # A good token from the throttled address is still let in (decided: see subscribers.auth).
    comm = await connect(token, client=here)
    await ping(comm)
    await comm.disconnect()
