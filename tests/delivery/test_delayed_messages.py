"""Delayed messages (API.md, Extensions): a publish with `deliver_at` or `delay_secs` is handed
out by no transport before then, the wait spends no attempt, an ordered line waits behind a
delayed head, and an operator can deliver one now. The ledger is driven at chosen times (its
`now`) where a test would otherwise wait; the socket's and the webhook's own clocks are tested
with a short real delay."""

import json
from datetime import UTC, timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from delivery import frames, ledger, publishing, subscribing, tasks, wakeups
from delivery.models import Delivery, Status
from queues.models import Message
from subscribers.provisioning import create_subscriber
from tests.support.rest import post_messages, pull

pytestmark = pytest.mark.django_db

DAY = 24 * 3600


def one(body, who, queue="db"):
    r = post_messages(who, body, queue)
    assert r.status_code == 201, r.content
    return r.json()


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "code", "field", "words"),
    [
        ({"deliver_at": "2030-01-01T00:00:00Z", "delay_secs": 5}, "bad_delay", "deliver_at", "not both"),
        ({"delay_secs": -1}, "bad_delay", "delay_secs", "from 0 to 604800"),
        ({"delay_secs": 7 * DAY + 1}, "bad_delay", "delay_secs", "from 0 to 604800"),
        ({"delay_secs": "5"}, "bad_delay", "delay_secs", "a number of seconds"),
        ({"delay_secs": True}, "bad_delay", "delay_secs", "a number of seconds"),
        ({"deliver_at": "tomorrow"}, "bad_delay", "deliver_at", "ISO 8601"),
        ({"deliver_at": "2026-13-01T00:00:00Z"}, "bad_delay", "deliver_at", "ISO 8601"),
        ({"deliver_at": 1764000000}, "bad_delay", "deliver_at", "ISO 8601"),
        ({"expires_at": "2030-01-01T00:00:00Z", "ttl_secs": 5}, "bad_expiry", "expires_at", "not both"),
        ({"ttl_secs": 0}, "bad_expiry", "ttl_secs", "more than 0"),
        ({"ttl_secs": -3}, "bad_expiry", "ttl_secs", "from 0"),
        ({"expires_at": "2001-01-01T00:00:00Z"}, "bad_expiry", "expires_at", "after now"),
        ({"delay_secs": 60, "ttl_secs": None, "expires_at": "soon"}, "bad_expiry", "expires_at", "ISO 8601"),
    ],
)
def test_a_bad_delay_or_expiry_is_a_400_with_a_code_naming_the_field(owner, fields, code, field, words):
    r = post_messages(owner, {"event": "create", "payload": 1, **fields})
    assert r.status_code == 400, r.content
    body = r.json()
    assert body["code"] == code and words in body["detail"] and words in body[field][0]
    assert Message.objects.count() == 0


def test_a_bad_item_of_a_batch_is_named_by_its_index_and_nothing_is_published(owner):
    good = {"event": "create", "payload": 1}
    r = post_messages(owner, {"messages": [good, {**good, "delay_secs": 5, "deliver_at": "2030-01-01"}]})
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "bad_delay" and body["detail"].startswith("messages[1]: ")
    assert "not both" in body["messages"]["1"]["deliver_at"][0]
    assert Message.objects.count() == 0


def test_an_expiry_before_the_deliver_at_is_refused(owner):
    soon = (timezone.now() + timedelta(hours=1)).isoformat()
    later = (timezone.now() + timedelta(hours=2)).isoformat()
    r = post_messages(owner, {"event": "create", "payload": 1, "deliver_at": later, "expires_at": soon})
    assert r.status_code == 400 and "after its deliver_at" in r.json()["detail"]


def test_a_deliver_at_in_the_past_means_now(owner):
    one({"event": "create", "payload": 1, "deliver_at": "2001-01-01T00:00:00Z"}, owner)
    assert Message.objects.get().deliver_at is None
    [d] = pull(owner)
    assert d["deliver_at"] is None and d["payload"] == 1


def test_a_deliver_at_without_an_offset_is_utc_and_seven_days_is_the_furthest(owner):
    ahead = (timezone.now() + timedelta(days=3)).astimezone(UTC).replace(tzinfo=None, microsecond=0)
    one({"event": "create", "payload": 1, "deliver_at": ahead.isoformat()}, owner)
    assert Message.objects.get().deliver_at == ahead.replace(tzinfo=UTC)
    too_far = (timezone.now() + timedelta(days=7, minutes=1)).isoformat()
    r = post_messages(owner, {"event": "create", "payload": 1, "deliver_at": too_far})
    assert r.status_code == 400 and r.json()["code"] == "bad_delay"


def test_a_socket_publish_frame_refuses_the_same_with_the_same_code():
    with pytest.raises(frames.FrameError) as caught:
        frames.outgoing_of(
            {"type": "publish", "event": "e", "payload": 1, "delay_secs": 1, "deliver_at": "x"}
        )
    assert caught.value.code == "bad_delay"
    items = [{"event": "e", "payload": 1}, {"event": "e", "payload": 1, "ttl_secs": 0}]
    with pytest.raises(frames.FrameError) as caught:
        frames.outgoing_of({"type": "publish", "messages": items})
    assert caught.value.code == "bad_expiry" and caught.value.extra == {"index": 1}
    assert caught.value.detail.startswith("messages[1]: ")


# --- not before its time, then delivered, no attempt spent ---------------------------------------


def test_a_delayed_message_is_not_pulled_before_its_time_and_its_wait_is_no_attempt(owner, db_queue):
    # Given a message delayed by a minute, and one not delayed
    delayed = one({"event": "create", "payload": "later", "delay_secs": 60}, owner)
    one({"event": "create", "payload": "now"}, owner)
    stored = Message.objects.get(pk=delayed["id"])
    assert stored.deliver_at is not None

    # When the subscriber pulls now: only the undelayed one
    got = pull(owner)
    assert [d["payload"] for d in got] == ["now"] and got[0]["deliver_at"] is None
    ledger.ack_deliveries(owner, [got[0]["id"]])
    waiting = Delivery.objects.get(message_id=delayed["id"])
    assert (waiting.status, waiting.attempt, waiting.next_attempt_at) == (
        Status.PENDING,
        0,
        stored.deliver_at,
    )

    # Then a lease just before its time finds nothing, and one at its time hands it out as its
    # first attempt, carrying its deliver_at
    assert ledger.lease_deliveries(owner, limit=10, now=stored.deliver_at - timedelta(microseconds=1)) == []
    [d] = ledger.lease_deliveries(owner, limit=10, now=stored.deliver_at)
    assert (d["payload"], d["attempt"], d["deliver_at"]) == ("later", 1, stored.deliver_at)


def test_a_delivery_carries_the_deliver_at_it_was_published_with(owner):
    at = (timezone.now() + timedelta(seconds=30)).replace(microsecond=0)
    one({"event": "create", "payload": 1, "deliver_at": at.isoformat()}, owner)
    [d] = ledger.lease_deliveries(owner, limit=1, now=at + timedelta(seconds=1))
    assert d["deliver_at"] == at
    text = frames.encode(frames.message_frame(d))
    assert json.loads(text)["deliver_at"] == at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_webhook_gets_a_delayed_message_at_its_time_not_before(db_queue, receiver, settings):
    # Given a webhook subscriber and a message delayed by a second
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    hooked, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(hooked, db_queue)
    [(answer, _)] = publishing.publish(db_queue, [publishing.prepare("create", 1, delay_secs=1)])
    deliver_at = Message.objects.get(pk=answer["id"]).deliver_at

    # When its job runs now: it waits for the ledger's time (within the sweep's look-ahead)
    assert tasks.deliver_webhooks(hooked.pk) == 1

    # Then it was leased (and posted) at or after its deliver_at, as its first attempt, its
    # body saying when it was due
    ((_, _, _, body),) = receiver.requests
    frame = json.loads(body)
    assert frame["attempt"] == 1 and parse_datetime(frame["deliver_at"]) == deliver_at
    row = Delivery.objects.get()
    assert row.status == Status.ACKED and row.delivered_at >= deliver_at


# --- an ordered line waits behind a delayed head -------------------------------------------------


def test_an_ordered_queue_keeps_a_delayed_message_in_its_place(make_queue, make_subscriber):
    # Given an ordered queue whose first message is delayed and the next two are not
    queue = make_queue("audit", ordered=True)
    worker = make_subscriber("worker", subscribe=("audit",))
    subscribing.subscribe(worker, queue)
    publishing.publish(
        queue,
        [
            publishing.prepare("create", 1, delay_secs=60),
            publishing.prepare("create", 2),
            publishing.prepare("create", 3),
        ],
    )
    due = Message.objects.get(seq=1).deliver_at

    # When leases come before its time: the line waits behind it
    assert ledger.lease_deliveries(worker, limit=10) == []
    assert ledger.lease_deliveries(worker, limit=10, now=due - timedelta(seconds=1)) == []

    # Then at its time it goes first, and the rest follow it in order, one at a time
    [first] = ledger.lease_deliveries(worker, limit=10, now=due)
    assert (first["seq"], first["attempt"]) == (1, 1)
    ledger.ack_deliveries(worker, [first["id"]])
    assert [d["seq"] for d in ledger.lease_deliveries(worker, limit=10, now=due)] == [2]


# --- an operator delivers it now ------------------------------------------------------------------


def test_an_operator_delivers_a_delayed_message_now_from_the_admin(owner, db_queue, staff, peer):
    # Given a message delayed by a day, owed to two subscriptions
    subscribing.subscribe(peer, db_queue)
    delayed = one({"event": "create", "payload": "later", "delay_secs": DAY}, owner)
    undelayed = one({"event": "create", "payload": "now"}, owner)
    assert [d["payload"] for d in pull(owner)] == ["now"]

    # When the operator takes the message list's "deliver now" action on both messages
    r = staff.post(
        "/admin/queues/message/",
        {"action": "deliver_now", "_selected_action": [delayed["id"], undelayed["id"]]},
    )
    assert r.status_code == 302

    # Then its deliveries are ready now, still at attempt 0, and the other message's are untouched
    for d in Delivery.objects.filter(message_id=delayed["id"]):
        assert d.status == Status.PENDING and d.attempt == 0 and d.is_ready(timezone.now())
    got = pull(owner)
    assert [(d["payload"], d["attempt"]) for d in got] == [("later", 1)]
    assert got[0]["deliver_at"] is not None  # it still says when it was due
    assert LogEntry.objects.filter(object_id=str(delayed["id"])).exists()
    assert not LogEntry.objects.filter(object_id=str(undelayed["id"])).exists()


def test_deliver_now_on_deliveries_leaves_retries_and_leased_ones_alone(owner, db_queue, staff):
    delayed = one({"event": "create", "payload": 1, "delay_secs": DAY}, owner)
    one({"event": "create", "payload": 2}, owner)
    [leased] = pull(owner)
    ledger.nack_deliveries(owner, [leased["id"]], retry_in=3600)  # a retry's wait: not a delay
    r = staff.post(
        "/admin/delivery/delivery/",
        {"action": "deliver_now", "_selected_action": list(Delivery.objects.values_list("id", flat=True))},
    )
    assert r.status_code == 302
    assert [d["payload"] for d in pull(owner)] == [1]
    assert Delivery.objects.get(pk=leased["id"]).next_attempt_at > timezone.now() + timedelta(minutes=50)
    assert LogEntry.objects.filter(object_id=str(Delivery.objects.get(message_id=delayed["id"]).pk)).exists()


def test_deliver_now_wakes_the_subscriber(owner, django_capture_on_commit_callbacks):
    """Its waiting long polls and sockets hear of it after the commit, not at their next
    recheck (wakeups.generation counts the wake-ups a subscriber's waiters heard)."""
    one({"event": "create", "payload": 1, "delay_secs": DAY}, owner)
    before = wakeups.generation(owner.pk)
    with django_capture_on_commit_callbacks(execute=True):
        assert ledger.deliver_now(Delivery.objects.all()) == 1
    assert wakeups.generation(owner.pk) > before
