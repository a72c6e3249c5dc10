"""The admin: what operators see and do.

The world: the `db` queue, with `logger` and `peer` both subscribed to every event of it; one
message published, which the logger has acked and the peer has not.
"""

import re
from datetime import timedelta
from unittest.mock import patch

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from delivery import ledger, presence, subscribing
from delivery.models import Delivery, Status
from delivery.publishing import prepare, publish
from delivery.reports import owed_to_subscriber
from queues.models import Event, Message, Queue
from subscribers.models import Connection, Subscriber, Subscription
from subscribers.tokens import hash_token
from tests.conftest import client_for
from tests.support.admin import act, change, changelist

TOKEN_SHOWN = re.compile(r"<code class='mq-token'>([^<]+)</code>")


def section(html, css_class):
    """The <table class="css_class"> ... </table> part of a page."""
    start = html.index(f'<table class="{css_class}">')
    return html[start : html.index("</table>", start)]


def publish_one(queue, event="create", payload=None):
    [(answer, _)] = publish(queue, [prepare(event, payload if payload is not None else {"n": 1})])
    return Message.objects.get(pk=answer["id"])


@pytest.fixture
def acked_and_owed(db_queue, logger, peer):
    logger_sub, _ = subscribing.subscribe(logger, db_queue)
    peer_sub, _ = subscribing.subscribe(peer, db_queue)
    message = publish_one(db_queue, payload={"table": "users", "row": 7})
    [leased] = ledger.lease_deliveries(logger, limit=10)
    ledger.ack_deliveries(logger, [leased["id"]])
    return {
        "queue": db_queue,
        "event": Event.objects.get(queue=db_queue, name="create"),
        "message": message,
        "logger": logger,
        "peer": peer,
        "logger_sub": logger_sub,
        "peer_sub": peer_sub,
        "acked": Delivery.objects.get(subscriber=logger),
        "owed": Delivery.objects.get(subscriber=peer),
    }


# --- every page answers ------------------------------------------------------------------------


def test_it_answers_every_changelist_and_change_page_with_the_data(staff, acked_and_owed):
    pages = [
        (acked_and_owed["queue"], "db"),
        (acked_and_owed["event"], "create"),
        (acked_and_owed["message"], "create"),
        (acked_and_owed["peer"], "peer"),
        (acked_and_owed["peer_sub"], "peer"),
        (acked_and_owed["owed"], "peer"),
    ]
    for obj, text in pages:
        r = staff.get(changelist(type(obj)))
        assert r.status_code == 200, (type(obj), r.content[:500])
        assert obj in list(r.context["cl"].result_list)
        assert text in r.content.decode()
        r = staff.get(change(obj))
        assert r.status_code == 200, (obj, r.content[:500])
        assert text in r.content.decode()
    assert staff.get(reverse("admin:index")).status_code == 200


def test_it_counts_what_each_queue_subscriber_and_subscription_is_owed(staff, acked_and_owed):
    ledger.kill_deliveries(Delivery.objects.filter(pk=acked_and_owed["owed"].pk))
    publish_one(acked_and_owed["queue"], "delete")  # one more pending for each of the two

    [queue] = staff.get(changelist(Queue)).context["cl"].result_list
    assert (queue.n_messages, queue.n_subscriptions) == (2, 2)
    assert (queue.n_pending, queue.n_inflight, queue.n_dead) == (2, 0, 1)

    subscribers = {s.name: s for s in staff.get(changelist(Subscriber)).context["cl"].result_list}
    assert (subscribers["peer"].n_pending, subscribers["peer"].n_dead) == (1, 1)
    assert (subscribers["logger"].n_pending, subscribers["logger"].n_dead) == (1, 0)

    subs = {s.subscriber.name: s for s in staff.get(changelist(Subscription)).context["cl"].result_list}
    assert (subs["peer"].n_pending, subs["peer"].n_dead) == (1, 1)

    [msg_new, msg_old] = staff.get(changelist(Message)).context["cl"].result_list
    assert (msg_old.n_deliveries, msg_old.n_unacked) == (2, 1)
    assert (msg_new.n_deliveries, msg_new.n_unacked) == (2, 2)


def test_it_asks_no_query_per_row_on_list_pages(staff, acked_and_owed, make_subscriber, make_queue):
    models = [Queue, Event, Message, Subscriber, Subscription, Delivery]

    def queries():
        counts = {}
        for model in models:
            with CaptureQueriesContext(connection) as ctx:
                assert staff.get(changelist(model)).status_code == 200
            counts[model.__name__] = len(ctx)
        return counts

    before = queries()
    for i in range(4):
        make_queue(f"q{i}")
        s = make_subscriber(f"extra{i}")
        subscribing.subscribe(s, acked_and_owed["queue"], "update")
    for i in range(5):
        publish_one(acked_and_owed["queue"], ["create", "update", "delete"][i % 3])
    assert Delivery.objects.count() > 10
    assert queries() == before


# --- subscribers and their tokens --------------------------------------------------------------


def inline_management(prefix, total=0, initial=0):
    return {
        f"{prefix}-TOTAL_FORMS": str(total),
        f"{prefix}-INITIAL_FORMS": str(initial),
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "1000",
    }


def test_it_creates_a_subscriber_and_shows_its_token_once(staff, db_queue):
    r = staff.post(
        reverse("admin:subscribers_subscriber_add"),
        {
            "name": "dashboard",
            "is_active": "on",
            "webhook_url": "",
            "subscribe_queues": [db_queue.pk],
            **inline_management("subscriptions", total=1),
            "subscriptions-0-queue": db_queue.pk,
            "subscriptions-0-event": "",
        },
        follow=True,
    )
    assert r.status_code == 200
    shown = TOKEN_SHOWN.findall(r.content.decode())
    assert len(shown) == 1, r.content.decode()[:2000]
    token = shown[0]

    subscriber = Subscriber.objects.get(name="dashboard")
    assert subscriber.token_hash == hash_token(token)
    assert subscriber.token_hint == token[:10]
    stored = Subscriber.objects.filter(pk=subscriber.pk).values().get()
    assert not any(token in str(value) for value in stored.values())
    assert [q.name for q in subscriber.subscribe_queues.all()] == ["db"]

    # The token works, and the subscription made in the inline is the subscriber's.
    subscriber.token = token
    api = client_for(subscriber).get("/api/subscriptions")
    assert api.status_code == 200
    assert [(s["queue"], s["event"]) for s in api.json()["subscriptions"]] == [("db", None)]

    # Shown once: no later page has it, though the change page shows its hint.
    assert token not in staff.get(changelist(Subscriber)).content.decode()
    page = staff.get(change(subscriber)).content.decode()
    assert token not in page
    assert subscriber.token_hint in page
    assert subscriber.token_hash not in page
    assert subscriber.webhook_secret not in page


def test_it_rotates_a_token_with_the_action(staff, logger):
    old = logger.token
    r = act(staff, Subscriber, "issue_new_token", [logger])
    [new] = TOKEN_SHOWN.findall(r.content.decode())
    assert new != old
    logger.refresh_from_db()
    assert logger.token_hash == hash_token(new)

    logger.token = old
    assert client_for(logger).get("/api/subscriptions").status_code == 401
    logger.token = new
    assert client_for(logger).get("/api/subscriptions").status_code == 200


def test_it_shows_what_a_subscriber_is_owed(staff, acked_and_owed):
    publish_one(acked_and_owed["queue"], "delete")
    [owed] = owed_to_subscriber(acked_and_owed["peer"])
    assert (owed.subscription, owed.pending, owed.inflight, owed.dead) == (
        acked_and_owed["peer_sub"],
        2,
        0,
        0,
    )
    assert owed.oldest_pending_at == acked_and_owed["owed"].created_at

    table = section(staff.get(change(acked_and_owed["peer"])).content.decode(), "mq-owed")
    assert "db/*" in table
    assert f"subscription__id__exact={acked_and_owed['peer_sub'].pk}" in table
    assert ">2</span>" in table  # the pending count, linked to those deliveries

    [owed] = owed_to_subscriber(acked_and_owed["logger"])
    assert (owed.pending, owed.inflight, owed.dead) == (1, 0, 0)


def reasons(subscriber):
    """{subscription: [(reason code, words, until, error)]} as owed_to_subscriber says."""
    return {
        o.subscription: [(r.code, r.words, r.until, r.error) for r in o.reasons]
        for o in owed_to_subscriber(subscriber)
    }


def why_cell(staff, subscriber):
    """The "why" cells of the subscriber's owed table, one per subscription."""
    table = section(staff.get(change(subscriber)).content.decode(), "mq-owed")
    return re.findall(r'<ul class="mq-why">(.*?)</ul>', table, re.S)


def test_it_says_why_what_a_subscriber_is_owed_waits(staff, acked_and_owed, django_assert_num_queries):
    peer, sub = acked_and_owed["peer"], acked_and_owed["peer_sub"]
    publish_one(acked_and_owed["queue"], "delete")

    # Two ready, and nothing would push them: they wait for the peer to pull.
    assert reasons(peer) == {
        sub: [("pulled", "2 waiting to be pulled: no open websocket and no webhook", None, "")]
    }
    # One taken and being worked on; the other refused with an error, retried in a minute.
    first, second = ledger.lease_deliveries(peer, limit=10)
    retried = ledger.nack_delivery(peer, second["id"], retry_in=60, error="peer: disk full")
    with django_assert_num_queries(3):  # however much is owed, to however many subscriptions
        owed = reasons(peer)
    assert owed == {
        sub: [
            ("retrying", "1 waiting for a retry", retried.next_attempt_at, "peer: disk full"),
            ("inflight", "1 in flight, to be acked", first["ack_deadline"], ""),
        ]
    }
    [why] = why_cell(staff, peer)
    assert 'data-reason="retrying"' in why and "last error: <code>peer: disk full</code>" in why
    assert 'data-reason="inflight"' in why and re.search(r"until .* \(in (29|30) s\)", why)

    # A ready one, with a websocket open: it is pushed; with a webhook and none, posted.
    ledger.ack_deliveries(peer, [first["id"]])
    publish_one(acked_and_owed["queue"], "update")
    presence.open_connection(peer, "ws.peer.1")
    assert [r[0] for r in reasons(peer)[sub]] == ["retrying", "pushed"]
    presence.close_connection("ws.peer.1")
    Subscriber.objects.filter(pk=peer.pk).update(webhook_url="https://hooks.example.com/peer")
    peer.refresh_from_db()
    assert reasons(peer)[sub][-1][:2] == (
        "pushed",
        "1 ready: the webhook worker posts them to https://hooks.example.com/peer",
    )

    # A paused queue, an inactive subscriber: nothing is handed out, whatever the transport.
    Queue.objects.filter(pk=acked_and_owed["queue"].pk).update(paused=True)
    Subscriber.objects.filter(pk=peer.pk).update(is_active=False)
    peer.refresh_from_db()
    assert [r[0] for r in reasons(peer)[sub]] == ["inactive", "paused", "retrying"]

    # What is dead says so; the logger, owed nothing more once it acks, has no reasons.
    ledger.kill_deliveries(Delivery.objects.filter(pk=retried.pk))
    assert reasons(peer)[sub][-1][0] == "dead"
    Queue.objects.filter(pk=acked_and_owed["queue"].pk).update(paused=False)
    ledger.ack_deliveries(
        acked_and_owed["logger"],
        [d["id"] for d in ledger.lease_deliveries(acked_and_owed["logger"], limit=10)],
    )
    assert reasons(acked_and_owed["logger"]) == {acked_and_owed["logger_sub"]: []}
    assert "nothing owed" in section(staff.get(change(acked_and_owed["logger"])).content.decode(), "mq-owed")


def test_it_says_what_blocks_an_ordered_subscription_and_links_its_head(staff, acked_and_owed, make_queue):
    peer = acked_and_owed["peer"]
    orders = make_queue("orders", ordered=True)
    Subscriber.objects.get(pk=peer.pk).subscribe_queues.add(orders)
    sub, _ = subscribing.subscribe(peer, orders)
    for n in range(3):
        publish_one(orders, "paid", {"order": n})
    head = next(d for d in ledger.lease_deliveries(peer, limit=10) if d["queue"] == "orders")

    assert reasons(peer)[sub] == [
        ("blocked", "2 blocked behind the head of line (ordered: one at a time)", None, ""),
        ("inflight", "1 in flight, to be acked", head["ack_deadline"], ""),
    ]
    why = why_cell(staff, peer)[1]  # db/*, then orders/*
    link = f"{reverse('mq-head-of-line')}?subscriber={peer.pk}&amp;queue={orders.pk}"
    assert f'<a href="{link}">head of line' in why

    # The head refused and waiting for its retry still holds the others back.
    ledger.nack_delivery(peer, head["id"], retry_in=120, error="shop: 503")
    assert [(r[0], r[3]) for r in reasons(peer)[sub]] == [("blocked", ""), ("retrying", "shop: 503")]


def test_it_unsubscribes_a_subscription_deleted_in_the_admin(staff, acked_and_owed):
    r = staff.post(
        reverse("admin:subscribers_subscription_delete", args=[acked_and_owed["peer_sub"].pk]),
        {"post": "yes"},
    )
    assert r.status_code == 302
    assert not Subscription.objects.filter(pk=acked_and_owed["peer_sub"].pk).exists()
    # What it was owed is dropped, not left behind without a subscription.
    assert not Delivery.objects.filter(pk=acked_and_owed["owed"].pk).exists()
    assert Delivery.objects.filter(pk=acked_and_owed["acked"].pk, status=Status.ACKED).exists()


def test_it_deletes_a_subscriber_with_its_deliveries(staff, acked_and_owed):
    r = staff.post(
        reverse("admin:subscribers_subscriber_delete", args=[acked_and_owed["peer"].pk]), {"post": "yes"}
    )
    assert r.status_code == 302
    assert not Subscriber.objects.filter(pk=acked_and_owed["peer"].pk).exists()
    assert not Delivery.objects.filter(subscriber_id=acked_and_owed["peer"].pk).exists()
    assert Delivery.objects.filter(pk=acked_and_owed["acked"].pk).exists()


def test_it_refuses_a_subscription_to_an_event_of_another_queue(staff, acked_and_owed, make_queue):
    other = make_queue("network")
    foreign = Event.objects.create(queue=other, name="down")
    r = staff.post(
        reverse("admin:subscribers_subscription_add"),
        {"subscriber": acked_and_owed["peer"].pk, "queue": acked_and_owed["queue"].pk, "event": foreign.pk},
    )
    assert r.status_code == 200
    assert "is not an event of the queue db" in r.content.decode()
    assert not Subscription.objects.filter(event=foreign).exists()


# --- deliveries: read-only, moved only by the actions -------------------------------------------


def test_it_redelivers_deliveries_with_the_action(staff, acked_and_owed):
    ledger.kill_deliveries(Delivery.objects.filter(pk=acked_and_owed["owed"].pk))
    r = act(staff, Delivery, "redeliver", [acked_and_owed["owed"], acked_and_owed["acked"]])
    assert "1 deliveries put back to pending" in r.content.decode()
    owed = Delivery.objects.get(pk=acked_and_owed["owed"].pk)
    assert (owed.status, owed.attempt) == (Status.PENDING, 0)
    assert Delivery.objects.get(pk=acked_and_owed["acked"].pk).status == Status.ACKED
    assert [d["id"] for d in ledger.lease_deliveries(acked_and_owed["peer"], limit=10)] == [owed.pk]


def test_it_kills_deliveries_with_the_action(staff, acked_and_owed):
    r = act(staff, Delivery, "kill", [acked_and_owed["owed"], acked_and_owed["acked"]])
    assert "1 deliveries marked dead" in r.content.decode()
    owed = Delivery.objects.get(pk=acked_and_owed["owed"].pk)
    assert (owed.status, owed.last_error) == (Status.DEAD, "killed by an operator")
    assert Delivery.objects.get(pk=acked_and_owed["acked"].pk).status == Status.ACKED
    assert ledger.lease_deliveries(acked_and_owed["peer"], limit=10) == []


def test_it_never_edits_a_delivery_in_a_form(staff, acked_and_owed):
    owed = acked_and_owed["owed"]
    page = staff.get(change(owed)).content.decode()
    assert 'name="status"' not in page
    assert 'name="attempt"' not in page
    assert "users" in page  # the payload is shown

    r = staff.post(change(owed), {"status": "acked", "attempt": "5"})
    assert r.status_code == 403
    assert staff.get(reverse("admin:delivery_delivery_add")).status_code == 403
    assert (
        staff.post(reverse("admin:delivery_delivery_delete", args=[owed.pk]), {"post": "yes"}).status_code
        == 403
    )
    owed.refresh_from_db()
    assert (owed.status, owed.attempt) == (Status.PENDING, 0)


def test_it_filters_and_searches_deliveries(staff, acked_and_owed, make_queue):
    other = make_queue("network")
    acked_and_owed["peer"].subscribe_queues.add(other)  # a subscription is owed only what its right allows
    subscribing.subscribe(acked_and_owed["peer"], other)
    publish_one(other, "down")
    down = Event.objects.get(queue=other, name="down")

    def listed(**params):
        r = staff.get(changelist(Delivery), params)
        assert r.status_code == 200
        return {(d.subscriber.name, d.queue.name, d.status) for d in r.context["cl"].result_list}

    assert listed(status__exact="acked") == {("logger", "db", "acked")}
    assert listed(queue__id__exact=other.pk) == {("peer", "network", "pending")}
    assert listed(event=down.pk) == {("peer", "network", "pending")}
    assert listed(subscriber__id__exact=acked_and_owed["logger"].pk) == {("logger", "db", "acked")}
    assert listed(q=str(acked_and_owed["message"].pk)) == {
        ("logger", "db", "acked"),
        ("peer", "db", "pending"),
    }
    assert listed(q="logg") == {("logger", "db", "acked")}
    assert listed(q="99999999999999999999999") == set()
    assert listed(event="nonsense") == set()


# --- messages -------------------------------------------------------------------------------------


def test_it_shows_which_subscriptions_have_not_acked_a_message(staff, acked_and_owed):
    page = staff.get(change(acked_and_owed["message"])).content.decode()
    table = section(page, "mq-not-acked")
    assert "peer" in table
    assert "logger" not in table
    assert "&quot;table&quot;: &quot;users&quot;" in page  # the payload, pretty-printed

    ledger.ack_deliveries(acked_and_owed["peer"], [acked_and_owed["owed"].pk])
    page = staff.get(change(acked_and_owed["message"])).content.decode()
    assert 'class="mq-not-acked"' not in page
    assert "Every subscription has acknowledged it." in page


def test_it_redelivers_a_message_to_those_that_have_not_acked_it(staff, acked_and_owed):
    ledger.kill_deliveries(Delivery.objects.filter(pk=acked_and_owed["owed"].pk))
    act(staff, Message, "redeliver_unacked", [acked_and_owed["message"]])
    assert Delivery.objects.get(pk=acked_and_owed["owed"].pk).status == Status.PENDING
    assert Delivery.objects.get(pk=acked_and_owed["acked"].pk).status == Status.ACKED


def test_it_never_makes_or_edits_a_message_in_a_form(staff, acked_and_owed, django_user_model):
    message = acked_and_owed["message"]
    assert staff.get(reverse("admin:queues_message_add")).status_code == 403
    assert staff.post(change(message), {"payload_json": "{}"}).status_code == 403
    message.refresh_from_db()
    assert message.payload_json == '{"table":"users","row":7}'

    # Only a superuser may delete one.
    clerk = django_user_model.objects.create_user("clerk", password="pw-clerk-1", is_staff=True)
    clerk.user_permissions.add(*_perms("queues", "message", "view", "delete"))
    client = Client()
    client.force_login(clerk)
    assert client.get(change(message)).status_code == 200
    url = reverse("admin:queues_message_delete", args=[message.pk])
    assert client.post(url, {"post": "yes"}).status_code == 403
    assert Message.objects.filter(pk=message.pk).exists()
    assert staff.post(url, {"post": "yes"}).status_code == 302
    assert not Message.objects.filter(pk=message.pk).exists()


SECRET_SHOWN = re.compile(r"<code class='mq-webhook-secret'>([^<]+)</code>")


def test_staff_who_may_only_view_subscribers_never_see_the_webhook_secret(staff, logger, django_user_model):
    logger.webhook_url = "https://example.com/hook"
    logger.save()
    viewer = django_user_model.objects.create_user("viewer", password="x-password-1", is_staff=True)
    viewer.user_permissions.add(*_perms("subscribers", "subscriber", "view"))
    client = Client()
    client.force_login(viewer)

    for url in (
        changelist(Subscriber),
        change(logger),
        reverse("admin:subscribers_subscriber_history", args=[logger.pk]),
    ):
        page = client.get(url)
        assert page.status_code == 200
        assert logger.webhook_secret not in page.content.decode()
    # Nor can they rotate it to be shown a new one.
    r = act(client, Subscriber, "rotate_webhook_secret", [logger])
    assert not SECRET_SHOWN.findall(r.content.decode())
    assert Subscriber.objects.get(pk=logger.pk).webhook_secret == logger.webhook_secret


def test_a_subscribers_first_webhook_comes_with_a_secret_shown_once(staff, db_queue, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False
    form = {"name": "hooked", "is_active": "on", "webhook_url": "", **inline_management("subscriptions")}
    r = staff.post(reverse("admin:subscribers_subscriber_add"), form, follow=True)
    assert r.status_code == 200 and not SECRET_SHOWN.findall(r.content.decode())  # no webhook yet
    hooked = Subscriber.objects.get(name="hooked")
    unseen = hooked.webhook_secret

    form = {**form, "webhook_url": "https://example.com/hook", **inline_management("connections")}
    r = staff.post(change(hooked), form, follow=True)

    [shown] = SECRET_SHOWN.findall(r.content.decode())
    hooked.refresh_from_db()
    assert hooked.webhook_url == "https://example.com/hook"
    assert shown == hooked.webhook_secret != unseen  # a secret nobody saw before, shown now
    r = staff.post(change(hooked), {**form, "webhook_url": "https://example.com/other"}, follow=True)
    assert not SECRET_SHOWN.findall(r.content.decode())  # changing the URL keeps it, unshown
    hooked.refresh_from_db()
    assert hooked.webhook_secret == shown


def test_an_operator_rotates_the_webhook_secret_and_is_shown_it_once(staff, logger, settings):
    settings.MQ_WEBHOOK_SECRET_GRACE_SECS = 600
    old = logger.webhook_secret

    r = act(staff, Subscriber, "rotate_webhook_secret", [logger])

    [new] = SECRET_SHOWN.findall(r.content.decode())
    logger.refresh_from_db()
    assert new == logger.webhook_secret != old
    assert logger.webhook_secrets(timezone.now()) == [new, old]
    assert logger.webhook_secrets(timezone.now() + timedelta(seconds=601)) == [new]
    page = staff.get(change(logger)).content.decode()
    assert new not in page and old not in page and "still signs posts until" in page


def _perms(app_label, model, *actions):
    from django.contrib.auth.models import Permission

    return Permission.objects.filter(
        content_type__app_label=app_label, codename__in=[f"{a}_{model}" for a in actions]
    )


# --- queues ----------------------------------------------------------------------------------------


def test_it_creates_a_queue_with_its_name_lower_cased(staff, db):
    form = {
        "ordered": "on",
        "max_attempts": "3",
        "ack_timeout": "30",
        "retention_days": "7",
        **inline_management("events"),
        **inline_management("subscriptions"),
    }
    r = staff.post(reverse("admin:queues_queue_add"), {**form, "name": "Network"})
    assert r.status_code == 302, r.content.decode()[:2000]
    queue = Queue.objects.get(name="network")
    assert (queue.ordered, queue.max_attempts) == (True, 3)

    r = staff.post(reverse("admin:queues_queue_add"), {**form, "name": "no spaces!"})
    assert r.status_code == 200
    assert "is not valid" in r.content.decode()
    assert Queue.objects.count() == 1


def test_it_sets_a_queues_default_ttl_and_the_api_shows_it(staff, operator_client):
    form = {
        "max_attempts": "10",
        "ack_timeout": "30",
        "retention_days": "7",
        "ttl_secs": "120",
        **inline_management("events"),
        **inline_management("subscriptions"),
    }
    r = staff.post(reverse("admin:queues_queue_add"), {**form, "name": "expiring"})
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Queue.objects.get(name="expiring").ttl_secs == 120
    r = staff.post(reverse("admin:queues_queue_add"), {**form, "name": "never", "ttl_secs": "0"})
    assert (
        r.status_code == 200 and not Queue.objects.filter(name="never").exists()
    )  # 0 is no TTL: leave it empty
    staff.post(reverse("admin:queues_queue_add"), {**form, "name": "never", "ttl_secs": ""})
    assert Queue.objects.get(name="never").ttl_secs is None
    queues = {q["name"]: q for q in operator_client.get("/api/queues").json()["queues"]}
    assert queues["expiring"]["ttl_secs"] == 120 and queues["never"]["ttl_secs"] is None


def test_it_subscribes_to_one_event_of_a_queue_in_its_inline(staff, acked_and_owed, outsider, make_queue):
    queue, event = acked_and_owed["queue"], acked_and_owed["event"]
    foreign = Event.objects.create(queue=make_queue("network"), name="down")
    form = {
        "ordered": "",
        "max_attempts": "10",
        "ack_timeout": "30",
        "retention_days": "7",
        **inline_management("events", total=1, initial=1),
        "events-0-id": event.pk,
        "events-0-queue": queue.pk,
        **inline_management("subscriptions", total=3, initial=2),
        "subscriptions-0-id": acked_and_owed["logger_sub"].pk,
        "subscriptions-0-queue": queue.pk,
        "subscriptions-1-id": acked_and_owed["peer_sub"].pk,
        "subscriptions-1-queue": queue.pk,
        "subscriptions-2-queue": queue.pk,
        "subscriptions-2-subscriber": outsider.pk,
    }
    # Only this queue's events may be chosen.
    r = staff.post(change(queue), {**form, "subscriptions-2-event": foreign.pk})
    assert r.status_code == 200
    assert "Select a valid choice" in r.content.decode()
    assert not outsider.subscriptions.exists()

    # Nor a subscriber without the right: such a subscription would be owed nothing.
    r = staff.post(change(queue), {**form, "subscriptions-2-event": event.pk})
    assert r.status_code == 200
    assert "outsider may not subscribe to db" in r.content.decode()
    assert not outsider.subscriptions.exists()

    outsider.subscribe_queues.add(queue)
    r = staff.post(change(queue), {**form, "subscriptions-2-event": event.pk})
    assert r.status_code == 302, r.content.decode()[:3000]
    [sub] = outsider.subscriptions.all()
    assert (sub.queue, sub.event) == (queue, event)
    # A message to that event now reaches the new subscription too.
    message = publish_one(queue, "create")
    assert set(message.deliveries.values_list("subscriber__name", flat=True)) == {
        "logger",
        "peer",
        "outsider",
    }


def test_it_pauses_and_resumes_queues(staff, acked_and_owed):
    act(staff, Queue, "pause", [acked_and_owed["queue"]])
    assert Queue.objects.get(pk=acked_and_owed["queue"].pk).paused
    assert ledger.lease_deliveries(acked_and_owed["peer"], limit=10) == []

    act(staff, Queue, "resume", [acked_and_owed["queue"]])
    assert not Queue.objects.get(pk=acked_and_owed["queue"].pk).paused
    assert [d["id"] for d in ledger.lease_deliveries(acked_and_owed["peer"], limit=10)] == [
        acked_and_owed["owed"].pk
    ]


# --- who may come in ---------------------------------------------------------------------------------


def test_it_keeps_everyone_but_staff_out(acked_and_owed, django_user_model):
    user = django_user_model.objects.create_user("someone", password="pw-someone-1")
    plain = Client()
    plain.force_login(user)
    bearer = Client(HTTP_AUTHORIZATION=f"Bearer {acked_and_owed['peer'].token}")
    urls = [
        reverse("admin:index"),
        changelist(Delivery),
        change(acked_and_owed["owed"]),
        changelist(Subscriber),
    ]
    for client in (Client(), plain, bearer):
        for url in urls:
            r = client.get(url)
            assert r.status_code == 302, url
            assert r["Location"].startswith(reverse("admin:login"))
    r = plain.post(changelist(Delivery), {"action": "kill", "_selected_action": [acked_and_owed["owed"].pk]})
    assert r.status_code == 302
    assert Delivery.objects.get(pk=acked_and_owed["owed"].pk).status == Status.PENDING


# --- who is connected now ----------------------------------------------------------------------


def ago(secs):
    """Patch the clock `secs` seconds back, for what reads timezone.now() meanwhile."""
    return patch("django.utils.timezone.now", return_value=timezone.now() - timedelta(seconds=secs))


def row_of(html, text):
    """The changelist row (<tr> ... </tr>) that contains `text`."""
    [row] = [r for r in html.split("<tr")[1:] if text in r]
    return row


@pytest.fixture
def connected(acked_and_owed, make_queue):
    """The peer, also subscribed to network/down, has one socket open holding its db delivery;
    two network messages wait for it, the first published two and a half minutes ago."""
    peer = acked_and_owed["peer"]
    network = make_queue("network")
    peer.subscribe_queues.add(network)  # a subscription is owed only what its right allows
    subscribing.subscribe(peer, network, "down")
    with ago(150):
        oldest = publish_one(network, "down")
    publish_one(network, "down")
    connection = presence.open_connection(peer, "ws.peer.1", "10.0.0.7")
    [held] = ledger.lease_deliveries(peer, limit=10, queue=acked_and_owed["queue"], holder="ws.peer.1")
    assert held["id"] == acked_and_owed["owed"].pk
    return {
        **acked_and_owed,
        "connection": connection,
        "oldest": Delivery.objects.get(message=oldest, subscriber=peer),
    }


def test_it_lists_who_is_connected_with_what_it_receives_and_its_backlog(staff, connected):
    peer, logger = connected["peer"], connected["logger"]
    # The logger's socket stopped beating a minute ago (its server died): it shows as stale.
    presence.open_connection(logger, "ws.logger.1")
    with ago(60):
        presence.heartbeat(["ws.logger.1"])

    r = staff.get(changelist(Connection))
    assert r.status_code == 200
    rows = {c.subscriber.name: c for c in r.context["cl"].result_list}
    assert set(rows) == {"peer", "logger"}
    row = rows["peer"]
    assert row == connected["connection"]
    # The backlog is the subscriber's, counted from the ledger.
    peer_deliveries = Delivery.objects.filter(subscriber=peer)
    assert (row.n_pending, row.n_inflight) == (2, 1)
    assert peer_deliveries.filter(status=Status.PENDING).count() == 2
    assert list(peer_deliveries.filter(status=Status.INFLIGHT).values_list("pk", flat=True)) == [
        connected["owed"].pk
    ]
    assert row.oldest_pending_at == connected["oldest"].created_at
    assert (rows["logger"].n_pending, rows["logger"].n_inflight, rows["logger"].oldest_pending_at) == (
        0,
        0,
        None,
    )

    html = r.content.decode()
    assert "Connected now" in html
    peer_row = row_of(html, "10.0.0.7")
    assert f'href="{change(peer)}"' in peer_row
    assert "db/*" in peer_row and "network/down" in peer_row
    assert "2 min" in peer_row  # the oldest pending, published 150 s ago
    assert "mq-stale" not in peer_row
    logger_row = row_of(html, f'href="{change(logger)}"')
    assert "mq-stale" in logger_row and "stale</span>" in logger_row
    assert "db/*" in logger_row

    # Sorted by the age of the oldest pending: nothing pending is the youngest.
    def by_age(order):
        listed = staff.get(changelist(Connection), {"o": order}).context["cl"].result_list
        return [c.subscriber.name for c in listed]

    column = str(r.context["cl"].list_display.index("oldest_pending"))
    assert by_age(column) == ["logger", "peer"]
    assert by_age(f"-{column}") == ["peer", "logger"]

    live = staff.get(changelist(Connection), {"heartbeat": "live"}).context["cl"].result_list
    assert [c.subscriber.name for c in live] == ["peer"]

    # The subscriber list has them too: how many sockets each has open, and its backlog.
    subscribers = {s.name: s for s in staff.get(changelist(Subscriber)).context["cl"].result_list}
    assert (subscribers["peer"].n_connections, subscribers["logger"].n_connections) == (1, 1)
    assert subscribers["peer"].n_pending == 2
    assert subscribers["peer"].oldest_pending_at == connected["oldest"].created_at
    assert subscribers["logger"].oldest_pending_at is None
    html = staff.get(changelist(Subscriber)).content.decode()
    assert "2 min" in row_of(html, f'href="{change(peer)}"')


def test_it_asks_no_query_per_row_on_the_connected_now_list(staff, connected, make_subscriber, make_queue):
    pages = [changelist(Connection), changelist(Subscriber), change(connected["peer"])]

    def queries():
        counts = {}
        for url in pages:
            with CaptureQueriesContext(connection) as ctx:
                assert staff.get(url).status_code == 200
            counts[url] = len(ctx)
        return counts

    before = queries()
    other = make_queue("other")
    for i in range(4):
        s = make_subscriber(f"extra{i}")
        subscribing.subscribe(s, connected["queue"], "update")
        subscribing.subscribe(s, other)
        presence.open_connection(s, f"ws.extra.{i}")
        presence.open_connection(s, f"ws.extra.{i}.b")
    presence.open_connection(connected["peer"], "ws.peer.2")
    for _ in range(3):
        publish_one(connected["queue"], "update")
        publish_one(other, "x")
    assert Connection.objects.count() == 10
    assert queries() == before


def test_it_shows_a_subscribers_connections_on_its_page(staff, connected):
    peer = connected["peer"]
    r = staff.get(change(peer))
    assert r.status_code == 200
    [inline] = [f for f in r.context["inline_admin_formsets"] if f.formset.model is Connection]
    assert [form.original for form in inline] == [connected["connection"]]
    html = r.content.decode()
    assert "Connected now" in html
    assert "ws.peer.1" in html and "10.0.0.7" in html
    assert 'name="connections-0-remote_addr"' not in html  # read-only

    # Saving the subscriber leaves its connections alone, even one closed meanwhile.
    presence.close_connection("ws.peer.1")
    presence.open_connection(peer, "ws.peer.2", "10.0.0.8")
    form = {
        "name": "peer",
        "is_active": "on",
        "webhook_url": "",
        "subscribe_queues": [q.pk for q in peer.subscribe_queues.all()],
        "publish_queues": [q.pk for q in peer.publish_queues.all()],
        **inline_management("subscriptions", total=2, initial=2),
        **inline_management("connections", total=1, initial=1),
        "connections-0-id": connected["connection"].pk,
        "connections-0-subscriber": peer.pk,
    }
    for i, sub in enumerate(peer.subscriptions.order_by("queue__name")):
        form.update({f"subscriptions-{i}-id": sub.pk, f"subscriptions-{i}-subscriber": peer.pk})
    r = staff.post(change(peer), {**form, "name": "peer2"})
    assert r.status_code == 302, r.content.decode()[:3000]
    assert Subscriber.objects.get(pk=peer.pk).name == "peer2"
    assert list(Connection.objects.values_list("channel_name", "remote_addr")) == [("ws.peer.2", "10.0.0.8")]

    # A subscriber being added has no connections to show.
    r = staff.get(reverse("admin:subscribers_subscriber_add"))
    assert not [f for f in r.context["inline_admin_formsets"] if f.formset.model is Connection]


def test_it_hands_back_what_a_connection_deleted_in_the_admin_held(staff, connected):
    held = connected["owed"]
    held.refresh_from_db()
    assert (held.status, held.lease_holder) == (Status.INFLIGHT, "ws.peer.1")

    page = staff.get(change(connected["connection"])).content.decode()
    assert 'name="remote_addr"' not in page
    r = staff.post(
        reverse("admin:subscribers_connection_delete", args=[connected["connection"].pk]), {"post": "yes"}
    )
    assert r.status_code == 302
    assert not Connection.objects.exists()
    held.refresh_from_db()
    assert (held.status, held.lease_holder) == (Status.PENDING, "")
    assert held.next_attempt_at <= timezone.now()
    assert [
        d["id"] for d in ledger.lease_deliveries(connected["peer"], limit=10, queue=connected["queue"])
    ] == [held.pk]


def test_it_hands_back_what_connections_deleted_by_the_action_held(staff, connected):
    peer = connected["peer"]
    second = presence.open_connection(peer, "ws.peer.2")
    [other] = ledger.lease_deliveries(peer, limit=1, holder="ws.peer.2")
    kept = presence.open_connection(connected["logger"], "ws.logger.1")

    r = staff.post(
        changelist(Connection),
        {
            "action": "delete_selected",
            "_selected_action": [connected["connection"].pk, second.pk],
            "post": "yes",
        },
    )
    assert r.status_code == 302
    assert list(Connection.objects.all()) == [kept]
    assert set(
        Delivery.objects.filter(pk__in=[connected["owed"].pk, other["id"]]).values_list("status", flat=True)
    ) == {Status.PENDING}
    assert not Delivery.objects.filter(status=Status.INFLIGHT).exists()


def test_it_lets_only_a_superuser_close_a_connection_and_never_add_or_edit_one(
    staff, connected, django_user_model
):
    conn = connected["connection"]
    assert staff.get(reverse("admin:subscribers_connection_add")).status_code == 403
    assert staff.post(change(conn), {"remote_addr": "1.2.3.4"}).status_code == 403

    clerk = django_user_model.objects.create_user("clerk", password="pw-clerk-1", is_staff=True)
    clerk.user_permissions.add(*_perms("subscribers", "connection", "view", "delete", "add", "change"))
    client = Client()
    client.force_login(clerk)
    assert client.get(changelist(Connection)).status_code == 200
    assert client.get(change(conn)).status_code == 200
    url = reverse("admin:subscribers_connection_delete", args=[conn.pk])
    assert client.post(url, {"post": "yes"}).status_code == 403
    client.post(
        changelist(Connection), {"action": "delete_selected", "_selected_action": [conn.pk], "post": "yes"}
    )
    assert Connection.objects.filter(pk=conn.pk, remote_addr="10.0.0.7").exists()
    assert Delivery.objects.get(pk=connected["owed"].pk).status == Status.INFLIGHT


def test_it_keeps_everyone_but_staff_out_of_the_connections(connected, django_user_model):
    conn = connected["connection"]
    user = django_user_model.objects.create_user("someone", password="pw-someone-1")
    plain = Client()
    plain.force_login(user)
    bearer = Client(HTTP_AUTHORIZATION=f"Bearer {connected['peer'].token}")
    delete = reverse("admin:subscribers_connection_delete", args=[conn.pk])
    for client in (Client(), plain, bearer):
        for url in (changelist(Connection), change(conn), delete):
            r = client.get(url)
            assert r.status_code == 302, url
            assert r["Location"].startswith(reverse("admin:login"))
        r = client.post(delete, {"post": "yes"})
        assert r.status_code == 302 and r["Location"].startswith(reverse("admin:login"))
        r = client.post(
            changelist(Connection),
            {"action": "delete_selected", "_selected_action": [conn.pk], "post": "yes"},
        )
        assert r.status_code == 302 and r["Location"].startswith(reverse("admin:login"))
    assert Connection.objects.filter(pk=conn.pk).exists()
    assert Delivery.objects.get(pk=connected["owed"].pk).status == Status.INFLIGHT
