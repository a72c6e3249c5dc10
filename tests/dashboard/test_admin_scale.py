"""The admin on big tables: the work of each page does not grow with the rows behind it.

A page's queries are counted with a small backlog and again with a twentyfold one; the lists
of the big tables (deliveries, dead letters, messages) never count a whole table; sorting is
by indexed columns only; and no form would list every message in a select.

The world: the `db` queue, with `logger` and `peer` subscribed to every event of it.
"""

import re
from datetime import timedelta
from unittest.mock import patch

import pytest
from django.contrib import admin
from django.contrib.admin.widgets import ForeignKeyRawIdWidget
from django.db import connection
from django.db.models import Min
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from delivery import big_lists, ledger, subscribing
from delivery.big_lists import BoundedCountPaginator
from delivery.models import DeadLetter, Delivery, Status
from delivery.publishing import prepare, publish
from delivery.reports import oldest_pending_at, owed_to_subscriber
from queues.models import Event, Message, Queue
from subscribers.models import Connection, Subscriber, Subscription
from tests.support.admin import change, changelist


def publish_many(queue, n, event="create"):
    publish(queue, [prepare(event, {"n": k}) for k in range(n)])


@pytest.fixture
def both_subscribed(db_queue, logger, peer):
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    return {"queue": db_queue, "logger": logger, "peer": peer}


def grow(both_subscribed, n):
    """n more messages: 2n more deliveries, some in flight, some dead, one retrying."""
    publish_many(both_subscribed["queue"], n)
    leased = ledger.lease_deliveries(both_subscribed["peer"], limit=max(n // 5, 2))
    ledger.kill_deliveries(Delivery.objects.filter(pk=leased[0]["id"]))
    ledger.nack_delivery(both_subscribed["peer"], leased[1]["id"], retry_in=60, error="busy")


def pages(both_subscribed):
    message = Message.objects.order_by("id").first()
    delivery = Delivery.objects.filter(subscriber=both_subscribed["peer"]).order_by("id").first()
    dead = DeadLetter.objects.filter(status=Status.DEAD).first()
    event = Event.objects.get(queue=both_subscribed["queue"], name="create")
    return [
        changelist(model)
        for model in (Delivery, DeadLetter, Message, Subscriber, Subscription, Connection, Queue, Event)
    ] + [
        changelist(Delivery) + f"?status__exact=pending&subscriber__id__exact={both_subscribed['peer'].pk}",
        changelist(Message) + f"?queue__id__exact={both_subscribed['queue'].pk}",
        change(both_subscribed["peer"]),
        change(both_subscribed["logger"]),
        change(message),
        change(delivery),
        change(dead),
        change(both_subscribed["queue"]),
        change(event),
        change(Subscription.objects.get(subscriber=both_subscribed["peer"])),
    ]


def count_queries(client, urls):
    for url in urls:
        client.get(url)  # once to fill the caches (content types) that a first view fills
    counts = {}
    for url in urls:
        with CaptureQueriesContext(connection) as ctx:
            r = client.get(url)
        assert r.status_code == 200, (url, r.content[:300])
        counts[url] = len(ctx)
    return counts


def test_it_asks_as_many_queries_of_every_page_for_200_messages_as_for_10(staff, both_subscribed):
    grow(both_subscribed, 10)
    urls = pages(both_subscribed)
    before = count_queries(staff, urls)
    grow(both_subscribed, 190)
    assert Delivery.objects.count() == 400
    assert count_queries(staff, urls) == before


def test_it_asks_as_many_queries_of_a_message_page_for_ten_subscribers_as_for_two(
    staff, both_subscribed, make_subscriber
):
    def page_queries():
        message = Message.objects.order_by("-id").first()
        return count_queries(staff, [change(message)])[change(message)]

    publish_many(both_subscribed["queue"], 1)
    before = page_queries()
    for k in range(8):
        subscribing.subscribe(make_subscriber(f"extra{k}"), both_subscribed["queue"])
    publish_many(both_subscribed["queue"], 1)
    assert Delivery.objects.filter(message=Message.objects.order_by("-id").first()).count() == 10
    assert page_queries() == before


def top_level_counts(sqls):
    return [sql for sql in sqls if re.match(r"\s*SELECT\s+COUNT\(", sql, re.I)]


def test_it_never_counts_a_whole_big_table_on_its_list(staff, both_subscribed):
    grow(both_subscribed, 30)
    for url in [
        changelist(Delivery),
        changelist(Delivery) + "?status__exact=pending",
        changelist(Delivery) + f"?queue__id__exact={both_subscribed['queue'].pk}",
        changelist(DeadLetter),
        changelist(Message),
        changelist(Message) + f"?queue__id__exact={both_subscribed['queue'].pk}",
    ]:
        with CaptureQueriesContext(connection) as ctx:
            assert staff.get(url).status_code == 200
        counts = top_level_counts(q["sql"] for q in ctx.captured_queries)
        # One count, of at most COUNT_AT_MOST + 1 rows: none of the whole table ("M total").
        assert len(counts) == 1, (url, counts)
        assert re.search(rf"LIMIT {big_lists.COUNT_AT_MOST + 1}\b", counts[0]), (url, counts[0])


def test_it_shows_a_bounded_count_as_more_than_and_pages_up_to_it(staff, both_subscribed):
    grow(both_subscribed, 30)  # 60 deliveries
    with (
        patch.object(big_lists, "COUNT_AT_MOST", 25),
        patch("delivery.admin.deliveries.DeliveryAdmin.list_per_page", 10),
    ):
        r = staff.get(changelist(Delivery))
        html = r.content.decode()
        # Counted in whole pages: three of ten.
        assert "more than 30 deliveries" in html
        cl = r.context["cl"]
        assert (cl.result_count, cl.paginator.num_pages) == (30, 3)
        # The pages counted are reachable, newest first, ten a page; the next is not offered.
        newest = list(Delivery.objects.order_by("-id").values_list("id", flat=True))
        third = staff.get(changelist(Delivery), {"p": 3}).context["cl"].result_list
        assert [d.pk for d in third] == newest[20:30]
        assert staff.get(changelist(Delivery), {"p": 4}).status_code == 302  # ?e=1: no such page

    # Under the bound the count is exact.
    r = staff.get(changelist(Delivery) + "?status__exact=dead")
    assert r.context["cl"].result_count == Delivery.objects.filter(status=Status.DEAD).count() == 1
    assert "more than" not in r.content.decode() and "about" not in r.content.decode()


def test_it_shows_the_planners_estimate_of_an_unfiltered_big_table_labelled(staff, both_subscribed):
    grow(both_subscribed, 30)
    paginator = BoundedCountPaginator(Delivery.objects.order_by("-id"), 100)
    with patch.object(big_lists, "ESTIMATE_ABOVE", 1):
        if connection.vendor == "postgresql":
            # What autovacuum does on its own in time: the estimate is the statistics'.
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE delivery_delivery")
            assert paginator.count == 60 and paginator.count_words == "about 60"
            html = staff.get(changelist(Delivery)).content.decode()
            assert '<span class="mq-count"' in html and "about 60 deliveries" in html
        else:
            # SQLite keeps no such estimate: the rows are counted (up to the bound).
            assert paginator.count == 60 and paginator.count_words == ""
    # A filtered list is never estimated.
    filtered = BoundedCountPaginator(Delivery.objects.filter(status=Status.PENDING).order_by("-id"), 100)
    with patch.object(big_lists, "ESTIMATE_ABOVE", 1):
        assert filtered.count == Delivery.objects.filter(status=Status.PENDING).count()


@pytest.mark.parametrize("model", [Delivery, Message])
def test_it_sorts_a_big_list_only_by_indexed_columns(staff, both_subscribed, model):
    grow(both_subscribed, 5)
    model_admin = admin.site._registry[model]
    r = staff.get(changelist(model))
    cl = r.context["cl"]
    unindexed = [
        i
        for i, column in enumerate(cl.list_display)
        if column not in model_admin.sortable_by and column != "action_checkbox"
    ]
    assert unindexed
    newest_first = list(model.objects.order_by("-id").values_list("id", flat=True))
    for i in unindexed:
        # Neither a header link nor a hand-written ?o= sorts by it: the default order stays.
        listed = staff.get(changelist(model), {"o": str(i)}).context["cl"].result_list
        assert [o.pk for o in listed] == newest_first[: len(listed)], cl.list_display[i]
    oldest_first = staff.get(changelist(model), {"o": str(cl.list_display.index("id"))})
    assert [o.pk for o in oldest_first.context["cl"].result_list] == sorted(newest_first)[:100]


@pytest.mark.parametrize("model", [Delivery, Message])
def test_it_would_edit_foreign_keys_of_big_tables_by_id_not_in_a_select(operator, model):
    request = RequestFactory().get("/")
    request.user = operator
    model_admin = admin.site._registry[model]
    for field in model._meta.get_fields():
        if field.many_to_one and field.concrete:
            formfield = model_admin.formfield_for_dbfield(field, request)
            assert isinstance(formfield.widget, ForeignKeyRawIdWidget), field.name


def test_it_finds_a_subscribers_oldest_pending_delivery_across_its_subscriptions(
    staff, both_subscribed, make_queue
):
    peer = both_subscribed["peer"]
    network = make_queue("network")
    peer.subscribe_queues.add(network)
    subscribing.subscribe(peer, network)
    now = timezone.now()
    for queue, secs_ago in [(both_subscribed["queue"], 300), (network, 200), (both_subscribed["queue"], 100)]:
        with patch("django.utils.timezone.now", return_value=now - timedelta(seconds=secs_ago)):
            publish_many(queue, 1)

    def listed():
        rows = {s.name: s for s in staff.get(changelist(Subscriber)).context["cl"].result_list}
        # The same as the MIN over every pending row, and as oldest_pending_at says.
        recount = Delivery.objects.filter(subscriber=peer, status=Status.PENDING).aggregate(
            at=Min("created_at")
        )
        assert rows["peer"].oldest_pending_at == recount["at"]
        probed = Subscriber.objects.annotate(at=oldest_pending_at("subscriber")).get(pk=peer.pk).at
        assert probed == recount["at"]
        return rows["peer"].oldest_pending_at

    assert listed() == now - timedelta(seconds=300)
    # Once the oldest (db #1) is acked, the oldest is the network one, older than db #2.
    [first] = ledger.lease_deliveries(peer, limit=1, queue=both_subscribed["queue"])
    ledger.ack_deliveries(peer, [first["id"]])
    assert listed() == now - timedelta(seconds=200)
    ledger.ack_deliveries(peer, [d["id"] for d in ledger.lease_deliveries(peer, limit=10)])
    assert listed() is None


def test_it_counts_what_a_subscriber_is_owed_without_its_subscription(both_subscribed):
    """Pending deliveries whose subscription was deleted outside unsubscribe (which drops
    them) are counted apart, and said to be never handed out."""
    publish_many(both_subscribed["queue"], 3)
    Subscription.objects.filter(subscriber=both_subscribed["peer"]).delete()
    [orphaned] = owed_to_subscriber(both_subscribed["peer"])
    oldest = Delivery.objects.filter(subscriber=both_subscribed["peer"]).aggregate(at=Min("created_at"))["at"]
    assert (orphaned.subscription, orphaned.pending, orphaned.oldest_pending_at) == (None, 3, oldest)
    assert [r.code for r in orphaned.reasons] == ["orphaned"]


def test_it_finds_the_heads_of_line_in_as_many_queries_for_200_messages_as_for_3(
    staff, make_queue, make_subscriber
):
    orders = make_queue("orders", ordered=True)
    billing = make_subscriber("billing", subscribe=["orders"])
    subscribing.subscribe(billing, orders)
    publish_many(orders, 3, "paid")
    [held] = ledger.lease_deliveries(billing, limit=10)  # ordered: the head alone

    def heads_page():
        url = reverse("mq-head-of-line")
        staff.get(url)
        with CaptureQueriesContext(connection) as ctx:
            r = staff.get(url)
        [head] = r.context["heads"]
        return len(ctx), head

    before, head = heads_page()
    assert (head.delivery.pk, head.behind) == (held["id"], 2)
    publish_many(orders, 197, "paid")
    after, head = heads_page()
    assert (after, head.delivery.pk, head.behind) == (before, held["id"], 199)


def test_it_asks_as_many_queries_of_a_subscribers_page_for_six_subscriptions_as_for_one(
    staff, both_subscribed, make_queue
):
    peer = both_subscribed["peer"]
    before = count_queries(staff, [change(peer)])[change(peer)]
    for k in range(5):
        queue = make_queue(f"more{k}")
        peer.subscribe_queues.add(queue)
        subscribing.subscribe(peer, queue)
        publish_many(queue, 3)
    r = staff.get(change(peer))
    assert r.content.decode().count('name="subscriptions-') > 5 * 3  # each row has its fields
    assert count_queries(staff, [change(peer)])[change(peer)] == before
