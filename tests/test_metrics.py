"""/metrics: what an operator alerts on, read from the database at each scrape.

The world: queues `db` and `network`; `logger` subscribed to db, `hook` (a webhook
subscriber) to network; some messages acked, some pending, one dead, webhook attempts of
each outcome, one open websocket.
"""

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from delivery import ledger
from delivery.models import Delivery, DeliveryAttempt, Status
from queues.models import Queue
from queues.publishing import prepare, publish
from subscribers import presence, subscribing
from subscribers.provisioning import create_subscriber


def scrape(client, **headers):
    r = client.get("/metrics", **headers)
    assert r.status_code == 200, r.content
    assert r["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def world(db, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    db_queue = Queue.objects.create(name="db")
    network = Queue.objects.create(name="network")
    logger, _ = create_subscriber("logger", subscribe=["db"])
    hook, _ = create_subscriber("hook", subscribe=["network"], webhook_url="http://127.0.0.1:9/hook")
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(hook, network)
    publish(db_queue, [prepare("create", i) for i in range(5)])
    publish(network, [prepare("error", i) for i in range(3)])
    leased = ledger.lease_deliveries(logger, limit=2)
    ledger.ack_deliveries(logger, [d["id"] for d in leased])
    hook_deliveries = list(Delivery.objects.filter(subscriber=hook).order_by("id"))
    ledger.kill_deliveries(Delivery.objects.filter(pk=hook_deliveries[0].pk))
    now = timezone.now()
    for number, (ok, code, error) in enumerate(
        [(True, 200, ""), (False, 500, "HTTP 500"), (False, None, "timed out"), (False, None, "refused")], 1
    ):
        DeliveryAttempt.objects.create(
            delivery=hook_deliveries[1], number=number, at=now, ok=ok, status_code=code, error=error
        )
    presence.open_connection(logger, "specific.logger-1")
    return {"db": db_queue, "network": network, "logger": logger, "hook": hook}


def test_it_reports_what_the_database_holds(client, world):
    samples = scrape(client)

    assert value(samples, "mq_messages_published_total", queue="db") == 5
    assert value(samples, "mq_messages_published_total", queue="network") == 3
    for queue in ("db", "network"):
        for status in Status.values:
            expected = Delivery.objects.filter(queue__name=queue, status=status).count()
            got = value(
                samples,
                "mq_deliveries",
                queue=queue,
                event="create" if queue == "db" else "error",
                status=status,
            )
            assert (got or 0) == expected, (queue, status)
    assert value(samples, "mq_pending_deliveries", queue="db", subscriber="logger") == 3
    assert value(samples, "mq_pending_deliveries", queue="network", subscriber="hook") == 2
    oldest = Delivery.objects.filter(subscriber__name="logger", status=Status.PENDING).order_by("created_at")[
        0
    ]
    age = value(samples, "mq_oldest_pending_age_seconds", queue="db", subscriber="logger")
    assert 0 <= age <= (timezone.now() - oldest.created_at).total_seconds() + 1
    assert value(samples, "mq_publish_rate_per_second", queue="db") == pytest.approx(5 / 60)
    assert value(samples, "mq_ack_rate_per_second", queue="db") == pytest.approx(2 / 60)
    assert value(samples, "mq_ack_rate_per_second", queue="network") == 0
    assert value(samples, "mq_webhook_attempts", subscriber="hook", outcome="ok") == 1
    assert value(samples, "mq_webhook_attempts", subscriber="hook", outcome="http_error") == 1
    assert value(samples, "mq_webhook_attempts", subscriber="hook", outcome="error") == 2
    assert value(samples, "mq_connected_clients", subscriber="logger") == 1
    assert value(samples, "mq_queue_paused", queue="db") == 0


def test_the_oldest_pending_age_grows_with_time(client, world):
    Delivery.objects.filter(subscriber=world["logger"], status=Status.PENDING).update(
        created_at=timezone.now() - timedelta(minutes=10)
    )
    age = value(scrape(client), "mq_oldest_pending_age_seconds", queue="db", subscriber="logger")
    assert 600 <= age < 660


def test_the_publish_counter_survives_messages_leaving_the_hot_tables(client, world):
    world["db"].messages.all().delete()  # as the archive would, for acked history
    assert value(scrape(client), "mq_messages_published_total", queue="db") == 5


def test_it_is_public_unless_a_token_is_set(client, world, settings, operator):
    settings.MQ_METRICS_TOKEN = "s3cret-scrape"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert (
        value(
            scrape(client, HTTP_AUTHORIZATION="Bearer s3cret-scrape"),
            "mq_connected_clients",
            subscriber="logger",
        )
        == 1
    )
    client.force_login(operator)
    assert client.get("/metrics").status_code == 200


def test_it_asks_the_same_number_of_queries_however_many_rows(client, world, django_assert_max_num_queries):
    with django_assert_max_num_queries(20) as first:
        scrape(client)
    publish(world["db"], [prepare(f"e{i}", i) for i in range(10)])
    for i in range(3):
        s, _ = create_subscriber(f"more{i}", subscribe=["db"])
        subscribing.subscribe(s, world["db"])
        presence.open_connection(s, f"specific.more-{i}")
    with django_assert_max_num_queries(len(first.captured_queries)):
        scrape(client)
