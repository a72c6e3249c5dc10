"""Operational events: the queue mq.system, made by the server and published to by no
subscriber, carries webhook.disabled, webhook.enabled, delivery.dead and subscription.lagging;
Django signals of the same names are sent after the commit of the change (never on a
rollback)."""

import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone

from delivery import ledger, operational, signals, subscribing, webhook_health
from delivery.models import Delivery, Status
from queues.lookup import system_queue
from queues.models import SYSTEM_QUEUE, Queue
from subscribers.models import Subscription
from tests.conftest import client_for
from tests.support.publish import publish

pytestmark = pytest.mark.django_db

SIGNALS = {
    "webhook.disabled": signals.webhook_disabled,
    "webhook.enabled": signals.webhook_enabled,
    "delivery.dead": signals.delivery_dead,
    "subscription.lagging": signals.subscription_lagging,
}


@pytest.fixture(autouse=True)
def _forget_who_subscribes():
    """What this process knows of mq.system's subscriptions (operational.subscribed) outlives
    a test's rollback, which sends no signal: forgotten after each test."""
    operational.forget_subscribed()
    yield
    operational.forget_subscribed()


@pytest.fixture
def heard():
    """[(event name, payloads)] of the signals sent, in order."""
    got = []
    receivers = {}
    for name, signal in SIGNALS.items():

        def receiver(sender, payloads, name=name, **kwargs):
            got.append((name, payloads))

        receivers[name] = receiver
        signal.connect(receiver, weak=False)
    yield got
    for name, signal in SIGNALS.items():
        signal.disconnect(receivers[name])


@pytest.fixture
def watcher(make_subscriber):
    """An operator's monitor, subscribed to every event of mq.system."""
    watcher = make_subscriber("watcher", publish=(), subscribe=(SYSTEM_QUEUE,))
    subscribing.subscribe(watcher, system_queue())
    return watcher


def events_on_system_queue():
    """[(event, payload)] of what mq.system carries, oldest first."""
    rows = Delivery.objects.filter(queue__name=SYSTEM_QUEUE).order_by("seq")
    return [
        (d.event.name, json.loads(d.message.payload_json)) for d in rows.select_related("event", "message")
    ]


def leased(subscriber, n=1):
    return ledger.lease_deliveries(subscriber, limit=n)


# --- the queue ------------------------------------------------------------------------------------


def test_no_subscriber_may_publish_to_it_by_rest_whatever_its_rights(make_subscriber, watcher):
    everything = make_subscriber("everything", publish=("*",), subscribe=())
    granted = make_subscriber("granted", publish=(SYSTEM_QUEUE,), subscribe=())
    for subscriber in (everything, granted, watcher):
        answer = client_for(subscriber).post(
            f"/api/queues/{SYSTEM_QUEUE}/messages",
            {"event": "webhook.disabled", "payload": {}},
            format="json",
        )
        assert answer.status_code == 403 and "may not publish to mq.system" in answer.json()["detail"]
    assert Queue.objects.get(name=SYSTEM_QUEUE).last_seq == 0


def test_it_is_made_on_first_use_and_subscribed_to_like_any_queue(make_subscriber):
    assert not Queue.objects.filter(name=SYSTEM_QUEUE).exists()
    watcher = make_subscriber("watcher", publish=(), subscribe=(SYSTEM_QUEUE,))
    answer = client_for(watcher).post(
        "/api/subscriptions", {"queue": SYSTEM_QUEUE, "event": "delivery.dead"}, format="json"
    )
    assert answer.status_code == 201 and answer.json()["queue"] == SYSTEM_QUEUE
    listed = client_for(watcher).get("/api/queues").json()["queues"]
    assert [(q["name"], q["may_publish"], q["may_subscribe"]) for q in listed] == [
        (SYSTEM_QUEUE, False, True)
    ]


async def _socket_publish(token):
    from tests.support.sockets import connect, recv, send

    comm = await connect(token)
    await send(
        comm, {"type": "publish", "queue": SYSTEM_QUEUE, "event": "delivery.dead", "payload": {}, "ref": "r"}
    )
    answer = await recv(comm)
    await comm.disconnect()
    return answer


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_no_subscriber_may_publish_to_it_by_socket_whatever_its_rights():
    from channels.db import database_sync_to_async

    from subscribers.provisioning import create_subscriber

    @database_sync_to_async
    def given():
        system_queue()
        return create_subscriber("everything", publish=["*", SYSTEM_QUEUE], subscribe=["*"])[1]

    answer = await _socket_publish(await given())
    assert answer["type"] == "error" and answer["code"] == "forbidden" and answer["ref"] == "r"
    assert await database_sync_to_async(lambda: Queue.objects.get(name=SYSTEM_QUEUE).last_seq)() == 0


def test_a_subscriber_that_may_publish_everywhere_is_not_shown_it(make_subscriber, db_queue):
    system_queue()
    publisher = make_subscriber("publisher", publish=("*",), subscribe=())
    assert [q["name"] for q in client_for(publisher).get("/api/queues").json()["queues"]] == ["db"]


# --- delivery.dead --------------------------------------------------------------------------------


def test_a_delivery_dead_of_attempts_is_told_after_commit(
    owner, db_queue, watcher, heard, django_capture_on_commit_callbacks
):
    db_queue.max_attempts = 1
    db_queue.save()
    ((answer, _),) = publish(db_queue)
    (delivery,) = leased(owner)
    with django_capture_on_commit_callbacks() as callbacks:
        ledger.nack_deliveries(owner, [delivery["id"]])
    assert heard == []  # not before the commit
    for callback in callbacks:
        callback()
    expected = {
        "queue": "db",
        "event": "create",
        "subscriber": "logger",
        "message_id": answer["id"],
        "delivery_id": delivery["id"],
        "reason": "max_attempts",
    }
    ((name, (payload,)),) = heard
    assert name == "delivery.dead" and payload.items() >= expected.items()
    assert payload["attempts"] == 1 and "dead after 1 attempts" in payload["error"]
    ((event, published),) = events_on_system_queue()
    assert event == "delivery.dead" and published == payload
    (told,) = Delivery.objects.filter(subscriber=watcher)
    assert told.status == Status.PENDING  # owed to the watcher, by every transport


def test_nothing_is_told_of_a_death_rolled_back(
    owner, db_queue, watcher, heard, django_capture_on_commit_callbacks
):
    publish(db_queue)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            ledger.kill_deliveries(Delivery.objects.all())
            raise RuntimeError("the operator's transaction fails")
    assert callbacks == [] and heard == [] and events_on_system_queue() == []
    assert Delivery.objects.get(subscriber=owner).status == Status.PENDING


@pytest.mark.parametrize("path", ["expired lease", "closed socket", "failed push", "killed", "skipped"])
def test_every_path_to_dead_tells_of_it(
    owner, db_queue, watcher, heard, django_capture_on_commit_callbacks, path
):
    db_queue.max_attempts = 1
    db_queue.save()
    publish(db_queue)
    with django_capture_on_commit_callbacks(execute=True):
        if path in ("killed", "skipped"):
            mine = Delivery.objects.filter(subscriber=owner)
            if path == "killed":
                ledger.kill_deliveries(mine)
            else:
                ledger.skip_deliveries(mine, "op")
        else:
            (delivery,) = ledger.lease_deliveries(owner, limit=1, holder="h1")
            if path == "expired lease":
                ledger.expire_overdue_leases(now=timezone.now() + timedelta(seconds=60))
            elif path == "closed socket":
                ledger.release_held(["h1"], spend=True)
            else:
                ledger.fail_delivery(delivery["id"], "h1", "HTTP 500")
    reason = {"killed": "killed", "skipped": "skipped"}.get(path, "max_attempts")
    ((name, (payload,)),) = heard
    assert name == "delivery.dead" and payload["reason"] == reason and payload["subscriber"] == "logger"
    assert [e for e, _ in events_on_system_queue()] == ["delivery.dead"]


def test_a_death_on_mq_system_itself_is_never_told(
    owner, db_queue, watcher, heard, django_capture_on_commit_callbacks
):
    publish(db_queue)
    with django_capture_on_commit_callbacks(execute=True):
        ledger.kill_deliveries(Delivery.objects.filter(subscriber=owner))
    assert len(events_on_system_queue()) == 1
    heard.clear()
    with django_capture_on_commit_callbacks(execute=True):
        ledger.kill_deliveries(Delivery.objects.filter(subscriber=watcher))  # the event's own delivery
    assert heard == [] and len(events_on_system_queue()) == 1


def test_without_a_subscription_nothing_is_published_but_the_signal_is_sent(
    owner, db_queue, heard, django_capture_on_commit_callbacks
):
    publish(db_queue)
    with django_capture_on_commit_callbacks(execute=True):
        ledger.kill_deliveries(Delivery.objects.all())
    assert [name for name, _ in heard] == ["delivery.dead"]
    assert Queue.objects.filter(name=SYSTEM_QUEUE, last_seq__gt=0).count() == 0


def test_a_subscription_to_another_event_of_mq_system_is_not_published_to(
    owner, db_queue, make_subscriber, django_capture_on_commit_callbacks
):
    lagging_only = make_subscriber("lagging-only", publish=(), subscribe=(SYSTEM_QUEUE,))
    subscribing.subscribe(lagging_only, system_queue(), "subscription.lagging")
    publish(db_queue)
    with django_capture_on_commit_callbacks(execute=True):
        ledger.kill_deliveries(Delivery.objects.all())
    assert (
        events_on_system_queue() == []
        and system_queue().__class__.objects.get(name=SYSTEM_QUEUE).last_seq == 0
    )


# --- webhook.disabled, webhook.enabled ------------------------------------------------------------


def test_disabling_and_enabling_a_webhook_are_told(
    make_subscriber, watcher, heard, settings, django_capture_on_commit_callbacks
):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    hooked = make_subscriber("hooked", webhook_url="http://127.0.0.1:9/hook")
    with django_capture_on_commit_callbacks(execute=True):
        webhook_health.record_failures(hooked, 1, "HTTP 500: down")
    settings.MQ_WEBHOOK_DISABLE_FAILURES, settings.MQ_WEBHOOK_DISABLE_AFTER_SECS = 2, 0
    with django_capture_on_commit_callbacks() as callbacks:
        assert webhook_health.record_failures(hooked, 1, "HTTP 502: still down") is True
    assert heard == []
    for callback in callbacks:
        callback()
    with django_capture_on_commit_callbacks(execute=True):
        webhook_health.enable(hooked, by="op")
    assert [name for name, _ in heard] == ["webhook.disabled", "webhook.enabled"]
    disabled = heard[0][1][0]
    assert disabled["subscriber"] == "hooked" and disabled["failures"] == 2 and disabled["by"] is None
    assert disabled["last_error"] == "HTTP 502: still down" and disabled["disabled_since"]
    assert heard[1][1][0]["by"] == "op"
    assert [(e, p["subscriber"]) for e, p in events_on_system_queue()] == [
        ("webhook.disabled", "hooked"),
        ("webhook.enabled", "hooked"),
    ]


# --- subscription.lagging -------------------------------------------------------------------------


def test_a_lagging_subscription_is_told_once_per_crossing(
    owner, db_queue, watcher, heard, django_capture_on_commit_callbacks
):
    call_command("createqueue", "db", "--lag-alert-secs", "10", stdout=open("/dev/null", "w"))
    publish(db_queue)
    subscription = Subscription.objects.get(subscriber=owner)
    with django_capture_on_commit_callbacks(execute=True):
        assert operational.check_lagging() == []  # 0 s old: not lagging
        Delivery.objects.filter(subscriber=owner).update(created_at=timezone.now() - timedelta(seconds=11))
        assert operational.check_lagging() == [subscription.pk]
        assert operational.check_lagging() == []  # still lagging: told once
    ((name, (payload,)),) = heard
    assert name == "subscription.lagging"
    assert payload["subscriber"] == "logger" and payload["queue"] == "db" and payload["event"] is None
    assert payload["lag_alert_secs"] == 10 and payload["oldest_pending_age_s"] >= 11
    assert [e for e, _ in events_on_system_queue()] == ["subscription.lagging"]
    # It recovers (acked), and crosses again: told again
    (delivery,) = leased(owner)
    ledger.ack_deliveries(owner, [delivery["id"]])
    operational.check_lagging()
    subscription.refresh_from_db()
    assert subscription.lagging_since is None
    publish(db_queue, start=1)
    Delivery.objects.filter(subscriber=owner, status=Status.PENDING).update(
        created_at=timezone.now() - timedelta(seconds=30)
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert operational.check_lagging() == [subscription.pk]
    assert [name for name, _ in heard] == ["subscription.lagging", "subscription.lagging"]


def test_the_sweep_checks_the_lag(owner, db_queue, heard, django_capture_on_commit_callbacks):
    from delivery import tasks

    db_queue.lag_alert_secs = 5
    db_queue.save()
    publish(db_queue)
    Delivery.objects.update(created_at=timezone.now() - timedelta(seconds=6))
    with django_capture_on_commit_callbacks(execute=True):
        assert tasks.sweep()["lagging"] == 1
        assert tasks.sweep()["lagging"] == 0
    assert [name for name, _ in heard] == ["subscription.lagging"]


def test_createqueue_sets_and_clears_the_lag_alert(db):
    call_command("createqueue", "db", "--lag-alert-secs", "30", stdout=open("/dev/null", "w"))
    assert Queue.objects.get(name="db").lag_alert_secs == 30
    call_command("createqueue", "db", "--lag-alert-secs", "0", stdout=open("/dev/null", "w"))
    assert Queue.objects.get(name="db").lag_alert_secs is None


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_socket_nack_that_kills_tells_of_it(heard):
    """The socket's nack runs on the event loop (the async connection on PostgreSQL): its
    deaths are told once its transaction committed, from a thread."""
    from channels.db import database_sync_to_async

    from subscribers.provisioning import create_subscriber

    @database_sync_to_async
    def given():
        queue = Queue.objects.create(name="db", max_attempts=1)
        owner, _ = create_subscriber("owner", publish=["db"], subscribe=["db"])
        subscribing.subscribe(owner, queue)
        watcher, _ = create_subscriber("watcher", subscribe=[SYSTEM_QUEUE])
        subscribing.subscribe(watcher, system_queue())
        publish(queue)
        return owner, ledger.lease_deliveries(owner, limit=1)[0]["id"]

    owner, delivery_id = await given()
    nacked = await ledger.anack_deliveries(owner, [delivery_id])
    assert nacked.done[delivery_id][0] == Status.DEAD
    ((name, (payload,)),) = heard
    assert (
        name == "delivery.dead" and payload["delivery_id"] == delivery_id and payload["subscriber"] == "owner"
    )
    told = await database_sync_to_async(events_on_system_queue)()
    assert [e for e, _ in told] == ["delivery.dead"]


def test_the_admin_sets_a_queues_lag_alert(staff, db):
    from django.urls import reverse

    form = {
        "name": "db",
        "max_attempts": "3",
        "ack_timeout": "30",
        "retention_days": "7",
        "lag_alert_secs": "120",
    }
    for inline in ("events", "subscriptions"):
        form.update({f"{inline}-TOTAL_FORMS": "0", f"{inline}-INITIAL_FORMS": "0"})
    answer = staff.post(reverse("admin:queues_queue_add"), form)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert Queue.objects.get(name="db").lag_alert_secs == 120
