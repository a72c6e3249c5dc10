"""Pausing a subscription (POST /api/subscriptions/{id}/pause and /resume): still owed everything
published to it, handed nothing until resumed; what is in flight finishes as usual. Its
subscriber or an operator may; a subscriber never sees another's."""

import time

import pytest
from django.contrib.admin.models import CHANGE, LogEntry

from delivery import reports
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.models import Subscription
from tests.conftest import client_for
from tests.support.admin import act
from tests.support.rest import post_messages, pull, subscribe

pytestmark = pytest.mark.django_db


def pause(client, sub_id, verb="pause"):
    return client.post(f"/api/subscriptions/{sub_id}/{verb}")


def publish(who, n, queue="db"):
    r = post_messages(who, {"messages": [{"event": "create", "payload": {"n": i}} for i in range(n)]}, queue)
    assert r.status_code == 201, r.content
    return r.json()["messages"]


def test_pause_and_resume_answer_the_subscription_and_are_idempotent(logger):
    sub = subscribe(logger, {"queue": "db"}).json()
    assert sub["paused"] is False
    c = client_for(logger)
    for _ in range(2):  # pausing a paused one answers the same
        r = pause(c, sub["id"])
        assert r.status_code == 200, r.content
        assert r.json() == {**sub, "paused": True}
    assert c.get("/api/subscriptions").json() == {"subscriptions": [{**sub, "paused": True}]}
    for _ in range(2):
        r = pause(c, sub["id"], "resume")
        assert r.status_code == 200 and r.json() == sub
    assert c.get("/api/subscriptions").json() == {"subscriptions": [sub]}


def test_another_subscribers_subscription_is_404_and_untouched(logger, peer):
    theirs = subscribe(peer, {"queue": "db"}).json()
    for verb in ("pause", "resume"):
        assert pause(client_for(logger), theirs["id"], verb).status_code == 404
        assert pause(client_for(logger), 999999, verb).status_code == 404
        assert pause(client_for(logger), 2**70, verb).status_code == 404
    assert not Subscription.objects.get(pk=theirs["id"]).paused
    assert pause(client_for(), theirs["id"]).status_code == 401


def test_an_operator_may_pause_any_and_staff_without_the_right_may_not(
    logger, operator_client, django_user_model
):
    sub = subscribe(logger, {"queue": "db"}).json()
    r = pause(operator_client, sub["id"])
    assert r.status_code == 200 and r.json()["paused"] is True
    assert pause(operator_client, 999999).status_code == 404
    viewer = django_user_model.objects.create_user("viewer", password="viewer-password-1", is_staff=True)
    c = client_for()
    c.force_login(viewer)
    assert pause(c, sub["id"], "resume").status_code == 403
    assert Subscription.objects.get(pk=sub["id"]).paused
    assert pause(operator_client, sub["id"], "resume").json()["paused"] is False


def test_a_paused_subscription_is_owed_what_is_published_and_handed_nothing_until_resumed(logger, peer):
    mine = subscribe(logger, {"queue": "db"}).json()
    subscribe(peer, {"queue": "db"})
    pause(client_for(logger), mine["id"])
    published = publish(peer, 3)
    # Still owed: the publish counts its delivery, and it waits.
    assert [m["deliveries"] for m in published] == [2, 2, 2]
    assert pull(logger) == []
    assert client_for(logger).get("/api/deliveries?wait=0.3").json() == {"deliveries": []}
    assert len(pull(peer)) == 3  # the others' subscriptions go on
    assert set(Delivery.objects.filter(subscriber=logger).values_list("status", flat=True)) == {
        Status.PENDING
    }
    pause(client_for(logger), mine["id"], "resume")
    assert [d["payload"]["n"] for d in pull(logger)] == [0, 1, 2]


def test_what_is_in_flight_finishes_and_an_ordered_line_keeps_its_order(make_queue, make_subscriber):
    make_queue("line", ordered=True)
    who = make_subscriber("worker", publish=("line",), subscribe=("line",))
    sub = subscribe(who, {"queue": "line"}).json()
    publish(who, 4, queue="line")
    (head,) = pull(who)
    assert head["seq"] == 1
    pause(client_for(who), sub["id"])
    # The delivery in flight is acked as usual; the next head is not handed out.
    r = client_for(who).post("/api/deliveries/ack", {"ids": [head["id"]]}, format="json")
    assert r.json() == {"acked": 1, "unknown": []}
    assert pull(who) == []
    pause(client_for(who), sub["id"], "resume")
    seqs = []
    while got := pull(who):
        (d,) = got  # one at a time, in order
        seqs.append(d["seq"])
        client_for(who).post("/api/deliveries/ack", {"ids": [d["id"]]}, format="json")
    assert seqs == [2, 3, 4]


@pytest.mark.django_db(transaction=True)  # the wake-up is sent after the commit
def test_a_resume_wakes_a_waiting_long_poll(logger, peer):
    """The resume's wake-up, not a recheck, ends the wait: a long poll that waited for nothing
    while paused gets what was owed as soon as the subscription resumes."""
    import threading

    sub = subscribe(logger, {"queue": "db"}).json()
    pause(client_for(logger), sub["id"])
    publish(peer, 1)
    answer = {}

    def wait():
        started = time.monotonic()
        answer["deliveries"] = pull(logger, "?wait=10")
        answer["secs"] = time.monotonic() - started

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    pause(client_for(logger), sub["id"], "resume")
    waiter.join(15)
    assert len(answer["deliveries"]) == 1
    assert answer["secs"] < 5


def test_the_owed_report_says_the_subscription_is_paused(logger, peer):
    sub = subscribe(logger, {"queue": "db"}).json()
    pause(client_for(logger), sub["id"])
    publish(peer, 2)
    (owed,) = reports.owed_to_subscriber(logger)
    assert [r.code for r in owed.reasons] == ["paused"]


def test_the_admin_pauses_and_resumes_and_writes_it_in_the_history(staff, logger, peer):
    mine = Subscription.objects.get(pk=subscribe(logger, {"queue": "db"}).json()["id"])
    theirs = Subscription.objects.get(pk=subscribe(peer, {"queue": "db"}).json()["id"])
    r = act(staff, Subscription, "pause", [mine, theirs])
    assert r.status_code == 200 and "2 subscriptions paused" in r.content.decode()
    assert set(Subscription.objects.values_list("paused", flat=True)) == {True}
    publish(peer, 1)
    assert pull(logger) == [] and pull(peer) == []
    act(staff, Subscription, "pause", [mine])  # already paused: nothing changes, nothing written
    r = act(staff, Subscription, "resume", [mine])
    assert "1 subscriptions resumed" in r.content.decode()
    assert len(pull(logger)) == 1 and pull(peer) == []
    entries = list(
        LogEntry.objects.filter(object_id=str(mine.pk))
        .order_by("id")
        .values_list("action_flag", "change_message")
    )
    assert entries == [(CHANGE, "paused"), (CHANGE, "resumed")]
    # Where subscriptions are shown: its own page, and what a connection receives.
    from delivery import presence
    from subscribers.models import Connection
    from tests.support.admin import change, changelist

    assert ">paused</span>" in staff.get(change(theirs)).content.decode()
    presence.open_connection(peer, "ws.peer.1")
    assert "db/*</a> (paused: receives nothing)" in staff.get(changelist(Connection)).content.decode()
    page = staff.get("/admin/subscribers/subscription/?paused__exact=1").content.decode()
    assert "paused" in page and f"/admin/subscribers/subscription/{theirs.pk}/change/" in page
    assert f"/admin/subscribers/subscription/{mine.pk}/change/" not in page


def test_a_paused_queue_and_a_paused_subscription_are_two_things(logger, peer, db_queue):
    sub = subscribe(logger, {"queue": "db"}).json()
    publish(peer, 1)
    Queue.objects.filter(pk=db_queue.pk).update(paused=True)
    pause(client_for(logger), sub["id"], "resume")  # resuming the subscription resumes no queue
    assert pull(logger) == []
    Queue.objects.filter(pk=db_queue.pk).update(paused=False)
    assert len(pull(logger)) == 1


def test_the_command_pauses_and_resumes_and_prints_each(logger, make_queue):
    import json

    from django.core.management.base import CommandError

    from tests.support.commands import command_output

    mine = subscribe(logger, {"queue": "db"}).json()
    one = subscribe(logger, {"queue": "db", "event": "create"}).json()
    out = [json.loads(line) for line in command_output("pausesubscription", "logger", "DB", "*").splitlines()]
    assert [{k: v for k, v in o.items() if k != "created_at"} for o in out] == [
        {
            "subscriber": "logger",
            "id": mine["id"],
            "queue": "db",
            "event": None,
            "paused": True,
            "filter": None,
        }
    ]
    assert not Subscription.objects.get(pk=one["id"]).paused
    command_output("pausesubscription", "logger", "db")  # all of them; the paused one stays so
    assert set(Subscription.objects.values_list("paused", flat=True)) == {True}
    out = command_output("pausesubscription", "logger", "db", "create", "--resume").splitlines()
    assert [json.loads(line)["paused"] for line in out] == [False]
    with pytest.raises(CommandError):
        command_output("pausesubscription", "logger", "nope")


def test_the_dashboard_shows_a_paused_subscription(logger):
    from dashboard import snapshot

    sub = subscribe(logger, {"queue": "db"}).json()
    pause(client_for(logger), sub["id"])
    (shown,) = [s for s in snapshot.overview()["subscribers"] if s["subscriber"] == "logger"]
    assert shown["subscriptions"] == [{"queue": "db", "event": None, "paused": True}]
