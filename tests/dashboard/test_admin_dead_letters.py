"""Dead letters in the admin: the list by queue and subscriber, each delivery's attempt history,
and the operator's redeliver and purge.

The world: queues `db` and `network`, each giving up after one attempt. The logger (subscribed
to both) nacked db#1 and network#1, which died, and acked db#2. The peer (db) nacked db#1,
which died, and has db#2 pending. The monitor (db, by webhook) had db#1 answered 500 by its
receiver, which died with that attempt on record, and has db#2 pending. An outsider has
nothing. Every death went through the ledger.
"""

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from delivery import ledger, subscribing, tasks
from delivery.models import DeadLetter, Delivery, DeliveryAttempt, Status
from delivery.publishing import prepare, publish
from queues.models import Message
from subscribers.provisioning import create_subscriber
from tests.support.admin import act, change, changelist
from tests.support.receivers import Receiver


def publish_to(queue, event, n=1):
    return publish(queue, [prepare(event, {"n": i}) for i in range(n)])


def die_by_nack(subscriber, queue):
    """Lease the subscriber's first ready delivery of the queue and nack it: with one attempt
    allowed, the ledger marks it dead."""
    [leased] = ledger.lease_deliveries(subscriber, limit=1, queue=queue)
    return ledger.nack_delivery(subscriber, leased["id"])


def listed(client, **params):
    r = client.get(changelist(DeadLetter), params)
    assert r.status_code == 200, r.content[:500]
    return {(d.subscriber.name, d.queue.name, d.seq) for d in r.context["cl"].result_list}


@pytest.fixture
def failing_receiver():
    r = Receiver(default=(500, 0))
    yield r
    r.close()


@pytest.fixture
def dead_letters(db_queue, make_queue, logger, peer, outsider, failing_receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    db = db_queue
    db.max_attempts = 1
    db.save()
    network = make_queue("network", max_attempts=1)
    monitor, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=failing_receiver.url)
    logger.subscribe_queues.add(network)  # a subscription is owed only what its right allows
    for subscriber, queue in [(logger, db), (logger, network), (peer, db), (monitor, db)]:
        subscribing.subscribe(subscriber, queue)
    publish_to(db, "create", 2)
    publish_to(network, "down")

    die_by_nack(logger, db)
    die_by_nack(logger, network)
    [second] = ledger.lease_deliveries(logger, limit=1, queue=db)
    ledger.ack_deliveries(logger, [second["id"]])
    die_by_nack(peer, db)
    assert tasks.deliver_webhooks(monitor.pk) == 0  # db#1 answered 500: dead; db#2 given back

    def delivery(subscriber, queue, seq):
        return Delivery.objects.get(subscriber=subscriber, queue=queue, seq=seq)

    return {
        "db": db,
        "network": network,
        "logger": logger,
        "peer": peer,
        "monitor": monitor,
        "outsider": outsider,
        "receiver": failing_receiver,
        "logger_dead": delivery(logger, db, 1),
        "logger_network_dead": delivery(logger, network, 1),
        "logger_acked": delivery(logger, db, 2),
        "peer_dead": delivery(peer, db, 1),
        "peer_pending": delivery(peer, db, 2),
        "monitor_dead": delivery(monitor, db, 1),
        "monitor_pending": delivery(monitor, db, 2),
    }


ALL_DEAD = {("logger", "db", 1), ("logger", "network", 1), ("peer", "db", 1), ("monitor", "db", 1)}


def test_the_world_died_through_the_ledger(dead_letters):
    dead = set(
        Delivery.objects.filter(status=Status.DEAD).values_list("subscriber__name", "queue__name", "seq")
    )
    assert dead == ALL_DEAD
    assert dead_letters["logger_acked"].status == Status.ACKED
    assert (dead_letters["peer_pending"].status, dead_letters["monitor_pending"].status) == (
        Status.PENDING,
    ) * 2
    assert "HTTP 500" in dead_letters["monitor_dead"].last_error
    assert len(dead_letters["receiver"].requests) == 1


# --- the list ------------------------------------------------------------------------------------


def test_it_lists_only_dead_letters_by_queue_and_subscriber(staff, dead_letters):
    assert listed(staff) == ALL_DEAD
    assert listed(staff, queue__id__exact=dead_letters["network"].pk) == {("logger", "network", 1)}
    assert listed(staff, subscriber__id__exact=dead_letters["peer"].pk) == {("peer", "db", 1)}
    assert listed(
        staff, queue__id__exact=dead_letters["db"].pk, subscriber__id__exact=dead_letters["logger"].pk
    ) == {("logger", "db", 1)}
    assert listed(staff, subscriber__id__exact=dead_letters["outsider"].pk) == set()


def test_it_offers_as_filters_only_the_queues_and_subscribers_that_have_dead_letters(
    staff, dead_letters, make_queue
):
    make_queue("quiet")
    r = staff.get(changelist(DeadLetter))
    choices = {
        spec.title: {str(c["display"]) for c in spec.choices(r.context["cl"])}
        for spec in r.context["cl"].filter_specs
    }
    assert choices["queue"] == {"All", "db", "network"}
    assert choices["subscriber"] == {"All", "logger", "peer", "monitor"}


def test_it_shows_the_last_error_when_it_died_and_its_tries(staff, dead_letters):
    r = staff.get(changelist(DeadLetter))
    rows = {(d.subscriber.name, d.queue.name): d for d in r.context["cl"].result_list}

    monitor = rows[("monitor", "db")]
    [attempt] = DeliveryAttempt.objects.filter(delivery=dead_letters["monitor_dead"])
    assert (monitor.attempt, monitor.n_tries, monitor.died_at) == (1, 1, attempt.at)
    assert "HTTP 500" in monitor.last_error and "dead after 1 attempts" in monitor.last_error

    # Died of a nack, never posted: no tries, and it died about when it was last handed out.
    logger = rows[("logger", "db")]
    assert (logger.attempt, logger.n_tries) == (1, 0)
    assert logger.died_at == dead_letters["logger_dead"].delivered_at
    assert logger.last_error == "nacked by the client; dead after 1 attempts"

    page = r.content.decode()
    columns = [
        "subscriber_name",
        "queue_name",
        "event_name",
        "seq",
        "attempt",
        "tries",
        "short_error",
        "died",
    ]
    for column in columns:
        assert f'class="sortable column-{column}' in page or f'class="column-{column}' in page, column
    assert "Webhook tries" in page and "Died (about)" in page
    assert "HTTP 500" in page and "nacked by the client" in page


def test_it_sorts_dead_letters_by_when_they_died(staff, dead_letters):
    r = staff.get(changelist(DeadLetter), {"o": "9"})  # the 9th column: died, ascending
    times = [d.died_at for d in r.context["cl"].result_list]
    assert len(times) == 4 and times == sorted(times)


def test_it_asks_no_query_per_row_on_the_dead_letters_list(staff, dead_letters, make_subscriber):
    def queries():
        with CaptureQueriesContext(connection) as ctx:
            assert staff.get(changelist(DeadLetter)).status_code == 200
        return len(ctx)

    before = queries()
    for i in range(3):
        s = make_subscriber(f"extra{i}")
        subscribing.subscribe(s, dead_letters["db"])
        subscribing.subscribe(s, dead_letters["network"])
    publish_to(dead_letters["db"], "update", 2)
    publish_to(dead_letters["network"], "down", 2)
    for i in range(3):
        s = dead_letters["db"].subscriptions.get(subscriber__name=f"extra{i}").subscriber
        for _ in range(2):
            die_by_nack(s, dead_letters["db"])
            die_by_nack(s, dead_letters["network"])
    tasks.deliver_webhooks(dead_letters["monitor"].pk)  # another try and death, with its attempt row
    assert Delivery.objects.filter(status=Status.DEAD).count() > 15
    assert queries() == before


# --- the attempt history -----------------------------------------------------------------------


def test_it_shows_the_attempt_history_on_the_delivery_page(staff, dead_letters):
    dead = dead_letters["monitor_dead"]
    failing_receiver = dead_letters["receiver"]
    # The operator redelivers; the endpoint is fixed; the second try is acked.
    ledger.redeliver(Delivery.objects.filter(pk=dead.pk))
    failing_receiver.default = (200, 0)
    tasks.deliver_webhooks(dead_letters["monitor"].pk)
    dead.refresh_from_db()
    assert dead.status == Status.ACKED

    r = staff.get(change(Delivery, dead.pk))
    assert r.status_code == 200
    [inline] = r.context["inline_admin_formsets"]
    shown = [(f.original.number, f.original.ok, f.original.status_code, f.original.error) for f in inline]
    # Oldest first; numbering starts again after the redelivery.
    assert [s[:3] for s in shown] == [(1, False, 500), (1, True, 200)]
    assert shown[0][3].startswith("HTTP 500")
    page = r.content.decode()
    assert "Webhook attempts" in page and "HTTP 500" in page
    assert 'name="attempts-0-error"' not in page  # read-only: no form fields


def test_it_shows_the_attempt_history_on_the_dead_letter_page(staff, dead_letters):
    r = staff.get(change(DeadLetter, dead_letters["monitor_dead"].pk))
    assert r.status_code == 200
    [inline] = r.context["inline_admin_formsets"]
    assert [(f.original.ok, f.original.status_code) for f in inline] == [(False, 500)]
    assert "HTTP 500" in r.content.decode()
    # A delivery that is not dead is not a dead letter.
    assert staff.get(change(DeadLetter, dead_letters["peer_pending"].pk), follow=True).redirect_chain


# --- redeliver ---------------------------------------------------------------------------------


def test_it_redelivers_dead_letters_to_pending(staff, dead_letters):
    dead = [dead_letters["logger_dead"], dead_letters["peer_dead"]]
    r = act(staff, DeadLetter, "redeliver", [d.pk for d in dead] + [dead_letters["logger_acked"].pk])
    assert "2 deliveries put back to pending" in r.content.decode()
    for d in dead:
        d.refresh_from_db()
        assert (d.status, d.attempt, d.last_error) == (Status.PENDING, 0, "redelivered by an operator")
    # The acked one was never a dead letter: untouched.
    assert Delivery.objects.get(pk=dead_letters["logger_acked"].pk).status == Status.ACKED
    assert listed(staff) == ALL_DEAD - {("logger", "db", 1), ("peer", "db", 1)}
    # Ready now: the next lease hands it out.
    assert [d["id"] for d in ledger.lease_deliveries(dead_letters["logger"], limit=10)] == [
        dead_letters["logger_dead"].pk
    ]


def test_it_redelivers_every_dead_letter_of_a_filtered_list(staff, dead_letters):
    r = act(
        staff,
        DeadLetter,
        "redeliver",
        [dead_letters["monitor_dead"].pk],
        query=f"?queue__id__exact={dead_letters['db'].pk}",
        select_across="1",
    )
    assert "3 deliveries put back to pending" in r.content.decode()
    assert listed(staff) == {("logger", "network", 1)}


# --- purge ----------------------------------------------------------------------------------------


def test_it_asks_before_purging_and_says_what_would_go(staff, dead_letters):
    pks = [dead_letters["monitor_dead"].pk, dead_letters["peer_dead"].pk, dead_letters["peer_pending"].pk]
    r = act(staff, Delivery, "purge", pks)
    page = r.content.decode()
    assert r.status_code == 200 and not r.redirect_chain
    assert "Purge 2 dead deliveries?" in page
    assert "The other 1 selected (not dead) are left alone" in page
    assert "monitor" in page and "peer" in page
    assert Delivery.objects.filter(pk__in=pks).count() == 3  # nothing deleted yet


def test_it_purges_dead_deliveries_only(staff, dead_letters):
    everyone = [dead_letters[k].pk for k in dead_letters if k.endswith(("_dead", "_acked", "_pending"))]
    messages = Message.objects.count()
    r = act(staff, Delivery, "purge", everyone, post="yes")
    assert "4 dead deliveries purged" in r.content.decode()
    assert not Delivery.objects.filter(status=Status.DEAD).exists()
    assert sorted(Delivery.objects.values_list("subscriber__name", "status")) == [
        ("logger", "acked"),
        ("monitor", "pending"),
        ("peer", "pending"),
    ]
    assert not DeliveryAttempt.objects.exists()  # the history went with its delivery
    assert Message.objects.count() == messages
    assert listed(staff) == set()


def test_it_purges_the_dead_letters_of_one_queue_through_the_confirmation(staff, dead_letters):
    query = f"?queue__id__exact={dead_letters['network'].pk}"
    form = {"select_across": "1"}
    asked = act(staff, DeadLetter, "purge", [dead_letters["logger_network_dead"].pk], query=query, **form)
    assert "Purge 1 dead delivery?" in asked.content.decode()
    r = act(
        staff, DeadLetter, "purge", [dead_letters["logger_network_dead"].pk], query=query, post="yes", **form
    )
    assert "1 dead deliveries purged" in r.content.decode()
    assert listed(staff) == ALL_DEAD - {("logger", "network", 1)}


# --- who may -------------------------------------------------------------------------------------


def staff_with(django_user_model, *codenames):
    user = django_user_model.objects.create_user(
        f"staff-{len(codenames)}", password="pw-x-12345", is_staff=True
    )
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="delivery", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def test_it_lets_only_those_who_may_change_redeliver_and_only_those_who_may_delete_purge(
    dead_letters, django_user_model
):
    viewer = staff_with(django_user_model, "view_delivery")
    assert listed(viewer) == ALL_DEAD  # no grant of its own is needed to see dead letters
    r = viewer.get(changelist(DeadLetter))
    assert set(r.context["cl"].model_admin.get_actions(r.wsgi_request)) == set()
    act(viewer, DeadLetter, "redeliver", [dead_letters["peer_dead"].pk])
    act(viewer, Delivery, "purge", [dead_letters["peer_dead"].pk], post="yes")
    assert Delivery.objects.get(pk=dead_letters["peer_dead"].pk).status == Status.DEAD

    operator = staff_with(django_user_model, "view_delivery", "change_delivery")
    act(operator, Delivery, "purge", [dead_letters["peer_dead"].pk], post="yes")
    assert Delivery.objects.filter(pk=dead_letters["peer_dead"].pk).exists()
    act(operator, DeadLetter, "redeliver", [dead_letters["peer_dead"].pk])
    assert Delivery.objects.get(pk=dead_letters["peer_dead"].pk).status == Status.PENDING

    purger = staff_with(django_user_model, "view_delivery", "change_delivery", "delete_delivery")
    act(purger, DeadLetter, "purge", [dead_letters["logger_dead"].pk], post="yes")
    assert not Delivery.objects.filter(pk=dead_letters["logger_dead"].pk).exists()


def test_it_keeps_everyone_but_staff_out_of_the_dead_letters(dead_letters, django_user_model):
    user = django_user_model.objects.create_user("someone", password="pw-someone-1")
    plain = Client()
    plain.force_login(user)
    for client in (Client(), plain):
        r = client.get(changelist(DeadLetter))
        assert r.status_code == 302 and r["Location"].startswith(reverse("admin:login"))
        r = client.post(
            changelist(DeadLetter),
            {"action": "purge", "_selected_action": [dead_letters["peer_dead"].pk], "post": "yes"},
        )
        assert r.status_code == 302
    assert Delivery.objects.get(pk=dead_letters["peer_dead"].pk).status == Status.DEAD
