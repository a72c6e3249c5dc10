"""The admin's operator tools: the head of line of ordered queues (retry now, skip) and the
form that publishes a test message.

The world: the ordered queue `orders`, with `billing` subscribed to every event of it, and
three messages published: seq 1 is the head, 2 and 3 wait behind it. The operator `op` is a
superuser; `viewer` is staff who may only view deliveries.
"""

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from delivery import ledger, reports, subscribing
from delivery.models import Delivery, Status
from delivery.publishing import prepare, publish
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber

HEADS = reverse("mq-head-of-line")
PUBLISH = reverse("mq-publish")


@pytest.fixture
def head_of_line(db):
    queue = Queue.objects.create(name="orders", ordered=True, max_attempts=5)
    Queue.objects.create(name="plain")
    billing, _ = create_subscriber("billing", subscribe=["orders"])
    subscribing.subscribe(billing, queue)
    publish(queue, [prepare("paid", {"order": n}) for n in (1, 2, 3)])
    deliveries = list(Delivery.objects.filter(subscriber=billing).order_by("seq"))
    return {"queue": queue, "billing": billing, "head": deliveries[0], "behind": deliveries[1:]}


@pytest.fixture
def viewer(django_user_model):
    user = django_user_model.objects.create_user("viewer", password="viewer-pass-1", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_delivery"))
    client = Client()
    client.force_login(user)
    return client


def shown_heads(client, **params):
    r = client.get(HEADS, params)
    assert r.status_code == 200
    return {h.delivery.pk: h for h in r.context["heads"]}, r.content.decode()


def test_it_shows_nothing_while_the_head_is_simply_ready(staff, head_of_line):
    found, html = shown_heads(staff)
    assert found == {}
    assert "Nothing holds an ordered subscription back" in html


def test_it_shows_the_head_in_flight_with_how_many_wait_behind_it(staff, head_of_line):
    [leased] = ledger.lease_deliveries(head_of_line["billing"], limit=10)
    assert leased["id"] == head_of_line["head"].pk  # an ordered subscription hands out its head alone

    found, html = shown_heads(staff)

    assert list(found) == [head_of_line["head"].pk]
    head = found[head_of_line["head"].pk]
    assert head.behind == 2
    assert head.reason.startswith("in flight (attempt 1)")
    assert "billing" in html and "Retry now" in html and "Skip" in html


def test_it_shows_a_head_waiting_for_its_retry_and_one_whose_attempts_pile_up(staff, head_of_line):
    ledger.lease_deliveries(head_of_line["billing"], limit=1)
    ledger.nack_delivery(
        head_of_line["billing"], head_of_line["head"].pk, retry_in=600, error="billing is down"
    )
    found, _ = shown_heads(staff)
    assert found[head_of_line["head"].pk].reason == "waiting for retry 2: billing is down"

    ledger.retry_now(Delivery.objects.filter(pk=head_of_line["head"].pk), reason="nacked again")
    found, _ = shown_heads(staff)
    assert found[head_of_line["head"].pk].reason == "ready again after 1 failed attempts: nacked again"


def test_it_filters_by_subscriber_as_the_subscriber_page_links(staff, head_of_line):
    ledger.lease_deliveries(head_of_line["billing"], limit=1)
    other, _ = create_subscriber("other")
    assert list(shown_heads(staff, subscriber=head_of_line["billing"].pk)[0]) == [head_of_line["head"].pk]
    assert shown_heads(staff, subscriber=other.pk)[0] == {}
    page = staff.get(
        reverse("admin:subscribers_subscriber_change", args=[head_of_line["billing"].pk])
    ).content.decode()
    assert f"{HEADS}?subscriber={head_of_line['billing'].pk}" in page


def test_retry_now_hands_the_head_out_again_at_once_and_is_recorded(staff, head_of_line, operator):
    ledger.lease_deliveries(head_of_line["billing"], limit=1)
    ledger.nack_delivery(head_of_line["billing"], head_of_line["head"].pk, retry_in=3600)
    assert ledger.lease_deliveries(head_of_line["billing"], limit=10) == []  # it blocks the rest

    r = staff.post(HEADS, {"delivery": head_of_line["head"].pk, "action": "retry"}, follow=True)

    assert r.status_code == 200
    head = Delivery.objects.get(pk=head_of_line["head"].pk)
    assert head.status == Status.PENDING and head.next_attempt_at <= timezone.now()
    assert head.last_error == "retried now by op"
    assert head.attempt == 1  # its attempts keep counting
    entry = LogEntry.objects.get(object_id=str(head.pk))
    assert (entry.user, entry.action_flag) == (operator, CHANGE)
    assert "retried now" in entry.get_change_message()
    assert [d["id"] for d in ledger.lease_deliveries(head_of_line["billing"], limit=10)] == [head.pk]


def test_skip_gives_up_on_the_head_so_the_next_one_goes_and_is_recorded(staff, head_of_line, operator):
    ledger.lease_deliveries(head_of_line["billing"], limit=1)

    r = staff.post(HEADS, {"delivery": head_of_line["head"].pk, "action": "skip"}, follow=True)

    assert r.status_code == 200
    head = Delivery.objects.get(pk=head_of_line["head"].pk)
    assert (head.status, head.last_error, head.ack_deadline) == (Status.DEAD, "skipped by op", None)
    entry = LogEntry.objects.get(object_id=str(head.pk))
    assert entry.user == operator and "skipped by op" in entry.get_change_message()
    # The next in seq order is handed out now.
    [leased] = ledger.lease_deliveries(head_of_line["billing"], limit=10)
    assert leased["id"] == head_of_line["behind"][0].pk
    assert reports.head_of(head.subscription_id).pk == head_of_line["behind"][0].pk


def test_it_does_nothing_to_a_delivery_that_is_no_longer_the_head(staff, head_of_line):
    second = head_of_line["behind"][0]
    r = staff.post(HEADS, {"delivery": second.pk, "action": "skip"}, follow=True)
    assert "no longer at the head" in r.content.decode()
    second.refresh_from_db()
    assert second.status == Status.PENDING
    assert not LogEntry.objects.exists()


def test_a_viewer_sees_the_heads_but_may_not_retry_or_skip(viewer, head_of_line):
    ledger.lease_deliveries(head_of_line["billing"], limit=1)
    found, html = shown_heads(viewer)
    assert list(found) == [head_of_line["head"].pk]
    assert 'value="retry"' not in html
    assert viewer.post(HEADS, {"delivery": head_of_line["head"].pk, "action": "skip"}).status_code == 403
    assert Delivery.objects.get(pk=head_of_line["head"].pk).status == Status.INFLIGHT


def test_anonymous_is_sent_to_the_admin_login(client, head_of_line):
    r = client.get(HEADS)
    assert r.status_code == 302 and r["Location"].startswith("/admin/login/")


# --- publish a test message ----------------------------------------------------------------------


def test_the_queue_list_links_to_the_operator_tools(staff, head_of_line):
    html = staff.get(reverse("admin:queues_queue_changelist")).content.decode()
    assert PUBLISH in html and HEADS in html


def test_it_publishes_a_test_message_to_every_matching_subscription(staff, head_of_line, operator):
    r = staff.post(
        PUBLISH,
        {"queue": head_of_line["queue"].pk, "event": "Refund", "payload": '{"order": 9, "note": null}'},
        follow=True,
    )

    assert r.status_code == 200
    message = Message.objects.get(queue=head_of_line["queue"], event__name="refund")
    assert (message.seq, message.payload_json, message.publisher) == (4, '{"order":9,"note":null}', None)
    assert Delivery.objects.filter(message=message, subscriber=head_of_line["billing"]).count() == 1
    assert "seq 4: 1 deliveries" in r.content.decode()
    assert LogEntry.objects.get(object_id=str(message.pk)).user == operator


def test_it_refuses_a_payload_that_is_not_json_or_a_bad_event_name(staff, head_of_line):
    r = staff.post(PUBLISH, {"queue": head_of_line["queue"].pk, "event": "create", "payload": "{oops"})
    assert r.status_code == 200 and "This is not JSON" in r.content.decode()
    r = staff.post(PUBLISH, {"queue": head_of_line["queue"].pk, "event": "no spaces", "payload": "1"})
    assert r.status_code == 200 and "is not valid" in r.content.decode()
    assert Message.objects.filter(queue=head_of_line["queue"]).count() == 3


def test_the_same_key_twice_publishes_once(staff, head_of_line):
    form = {"queue": head_of_line["queue"].pk, "event": "paid", "payload": "{}", "key": "k-1"}
    staff.post(PUBLISH, form)
    r = staff.post(PUBLISH, form, follow=True)
    assert "That key was used already" in r.content.decode()
    assert Message.objects.filter(queue=head_of_line["queue"], key="k-1").count() == 1


def test_a_staff_user_without_the_right_may_not_publish(viewer, head_of_line):
    assert viewer.get(PUBLISH).status_code == 403
    assert (
        viewer.post(PUBLISH, {"queue": head_of_line["queue"].pk, "event": "x", "payload": "1"}).status_code
        == 403
    )
