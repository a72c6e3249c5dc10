"""/metrics: what an operator alerts on, from a snapshot of the database at most
MQ_METRICS_MAX_AGE_SECS old, for the scraper with MQ_METRICS_TOKEN or a staff login.

The world: queues `db` and `network`; `logger` subscribed to db, `hook` (a webhook
subscriber) to network; some messages acked, some pending, one dead, webhook attempts of
each outcome, one open websocket.
"""

import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from analytics import load
from dashboard import metrics, shared
from delivery import health, ledger, presence, subscribing, tallies
from delivery.models import Delivery, DeliveryAttempt, Status, WebhookHealth
from delivery.publishing import prepare, publish
from queues.models import Queue
from subscribers.models import Heartbeat, ServerProcess
from subscribers.provisioning import create_subscriber
from tests.support.run_folders import write_run
from tests.support.servers import start_daphne, start_redis

TOKEN = "s3cret-scrape"
BEARER = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def _scraper(settings):
    """The scraper's token, and no snapshot left over from another test."""
    settings.MQ_METRICS_TOKEN = TOKEN
    cache.clear()
    yield
    cache.clear()


def parse_metrics(text):
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def scrape(client, **headers):
    r = client.get("/metrics", **(headers or BEARER))
    assert r.status_code == 200, r.content
    assert r["Content-Type"].startswith("text/plain")
    return parse_metrics(r.content.decode())


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


# Counted by the processes and read at every scrape, not from the snapshot (mqsite.prometheus).
LIVE = ("process_", "mq_publish_duration_seconds", "mq_delivery_latency_seconds")


def from_snapshot(samples):
    return {key: v for key, v in samples.items() if not key[0].startswith(LIVE)}


@pytest.fixture
def traffic(db, settings):
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


def test_it_reports_what_the_database_holds(client, traffic):
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
    # Over the last minute in whole 10 s steps: 50 to 60 s.
    assert 5 / 60 <= value(samples, "mq_publish_rate_per_second", queue="db") <= 5 / 50
    assert 2 / 60 <= value(samples, "mq_ack_rate_per_second", queue="db") <= 2 / 50
    assert value(samples, "mq_ack_rate_per_second", queue="network") == 0
    assert value(samples, "mq_webhook_attempts", subscriber="hook", outcome="ok") == 1
    assert value(samples, "mq_webhook_attempts", subscriber="hook", outcome="http_error") == 1
    assert value(samples, "mq_webhook_attempts", subscriber="hook", outcome="error") == 2
    assert value(samples, "mq_connected_clients", subscriber="logger") == 1
    assert value(samples, "mq_queue_paused", queue="db") == 0


def test_it_reports_the_last_analytics_run_and_nothing_before_one(client, traffic, tmp_path):
    # Given no analytics run yet: no mq_analytics_* at all
    assert not [name for name, _ in scrape(client) if name.startswith("mq_analytics")]

    # Given a run loaded (an older one before it)
    out = str(tmp_path)
    load.load_run(out, write_run(out, events=[{"queue": "db", "event": "create", "messages": 1}]))
    run_id = write_run(
        out,
        events=[
            {
                "queue": "db",
                "event": "create",
                "messages": 30,
                "deliveries": 60,
                "dead_letter_rate": 0.05,
                "latency_p50_ms": 12.5,
                "latency_p95_ms": 80.0,
                "latency_p99_ms": 140.25,
            },
            {"queue": "network", "event": "error", "messages": 4},  # no deliveries, none acked
        ],
        manifest={
            "finished_at": "2026-11-25T12:00:42.500000+00:00",
            "duration_s": 42.5,
            "partitions": {"total": 10, "recomputed": 3, "reused": 7},
        },
    )
    load.load_run(out, run_id)
    cache.clear()

    # When
    samples = scrape(client)

    # Then the run's time, length and partitions, and its figures per queue and event
    finished = datetime(2026, 11, 25, 12, 0, 42, 500000, tzinfo=UTC).timestamp()
    assert value(samples, "mq_analytics_last_run_timestamp_seconds") == finished
    assert value(samples, "mq_analytics_last_run_duration_seconds") == 42.5
    assert value(samples, "mq_analytics_last_run_partitions", state="recomputed") == 3
    assert value(samples, "mq_analytics_last_run_partitions", state="reused") == 7
    assert value(samples, "mq_analytics_messages", queue="db", event="create") == 30
    assert value(samples, "mq_analytics_messages", queue="network", event="error") == 4
    assert value(samples, "mq_analytics_dead_letter_rate", queue="db", event="create") == 0.05
    for quantile, ms in (("0.5", 12.5), ("0.95", 80.0), ("0.99", 140.25)):
        assert value(samples, "mq_analytics_latency_ms", queue="db", event="create", quantile=quantile) == ms
    # ... and no made-up figure where there is none
    assert value(samples, "mq_analytics_dead_letter_rate", queue="network", event="error") is None
    assert not [k for k in samples if k[0] == "mq_analytics_latency_ms" and ("queue", "network") in k[1]]


def test_it_reports_failing_webhooks_and_the_processes_that_do_the_work(client, traffic):
    # Given no process has beaten and no sweep has run: none alive, and no sweep age at all
    samples = scrape(client)
    assert value(samples, "mq_processes_alive", kind="web") == 0
    assert value(samples, "mq_processes_alive", kind="worker") == 0
    assert not [name for name, _ in samples if name == "mq_sweep_last_run_age_seconds"]
    assert not [name for name, _ in samples if name.startswith("mq_webhook_disabled")]

    # Given a worker beating, a sweep 3 s ago, and the hook's webhook disabled after 60 failures
    now = timezone.now()
    ServerProcess.objects.create(name="maintenance@host", kind="worker", last_beat=now)
    Heartbeat.objects.create(name=health.SWEEP, at=now - timedelta(seconds=3))
    WebhookHealth.objects.create(
        subscriber=traffic["hook"], failures=60, first_failure_at=now, disabled_since=now, disabled_after=60
    )
    cache.clear()

    # Then
    samples = scrape(client)
    assert value(samples, "mq_processes_alive", kind="worker") == 1
    assert value(samples, "mq_processes_alive", kind="web") == 0
    assert 3 <= value(samples, "mq_sweep_last_run_age_seconds") < 10
    assert value(samples, "mq_webhook_consecutive_failures", subscriber="hook") == 60
    assert value(samples, "mq_webhook_disabled", subscriber="hook") == 1

    # When it is enabled again and one post succeeds: nothing failing, nothing disabled
    WebhookHealth.objects.filter(pk=traffic["hook"].pk).update(failures=0, disabled_since=None)
    cache.clear()
    samples = scrape(client)
    assert value(samples, "mq_webhook_consecutive_failures", subscriber="hook") == 0
    assert value(samples, "mq_webhook_disabled", subscriber="hook") == 0


def test_the_oldest_pending_age_grows_with_time(client, traffic):
    Delivery.objects.filter(subscriber=traffic["logger"], status=Status.PENDING).update(
        created_at=timezone.now() - timedelta(minutes=10)
    )
    age = value(scrape(client), "mq_oldest_pending_age_seconds", queue="db", subscriber="logger")
    assert 600 <= age < 660


def test_the_publish_counter_survives_messages_leaving_the_hot_tables(client, traffic):
    traffic["db"].messages.all().delete()  # as the archive would, for acked history
    assert value(scrape(client), "mq_messages_published_total", queue="db") == 5


def test_it_is_private_by_default(client, traffic, settings, django_user_model):
    """Without credentials 401 with a JSON body that says what to send; a logged-in user who is
    not staff 403; a staff login or the token 200; MQ_METRICS_PUBLIC opens it."""
    r = client.get("/metrics")
    assert r.status_code == 401 and "MQ_METRICS_TOKEN" in r.json()["detail"]
    assert r["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert value(scrape(client), "mq_connected_clients", subscriber="logger") == 1

    settings.MQ_METRICS_TOKEN = ""  # no token set: private all the same, and "" is no token
    r = client.get("/metrics", HTTP_AUTHORIZATION="Bearer ")
    assert r.status_code == 401 and "staff" in r.json()["detail"]
    client.force_login(django_user_model.objects.create_user("plain", password="plain-password-1"))
    r = client.get("/metrics")
    assert r.status_code == 403 and "staff" in r.json()["detail"]
    client.force_login(django_user_model.objects.create_user("op", password="op-password-1", is_staff=True))
    assert client.get("/metrics").status_code == 200
    client.logout()
    settings.MQ_METRICS_PUBLIC = True
    assert client.get("/metrics").status_code == 200


def one_computation_queries():
    tallies.fold()  # as the computation will: then it has nothing to fold
    with CaptureQueriesContext(connection) as one:
        shared.compute()
    return len(one.captured_queries)


def test_a_loop_of_scrapes_costs_the_database_one_computation(client, traffic):
    """Fifty scrapes within MQ_METRICS_MAX_AGE_SECS (5): the queries of one computation, then
    none (no session, no token lookup: the token is a setting)."""
    per_computation = one_computation_queries()
    assert per_computation >= 5
    cache.clear()
    with CaptureQueriesContext(connection) as scrapes:
        for _ in range(50):
            scrape(client)
    assert len(scrapes.captured_queries) == per_computation


def test_a_snapshot_older_than_max_age_is_computed_again(client, traffic, settings):
    # Wide enough that a loaded machine (make test's passes side by side) scrapes twice within it.
    settings.MQ_METRICS_MAX_AGE_SECS = 2
    first = scrape(client)
    assert value(first, "mq_messages_published_total", queue="db") == 5
    publish(traffic["db"], [prepare("create", i) for i in range(10)])
    same = scrape(client)
    assert from_snapshot(same) == from_snapshot(first)  # the snapshot, not the database
    time.sleep(2.05)
    fresh = scrape(client)
    assert value(fresh, "mq_messages_published_total", queue="db") == 15
    taken = value(fresh, "mq_metrics_snapshot_timestamp_seconds")
    assert taken > value(first, "mq_metrics_snapshot_timestamp_seconds")
    assert abs(time.time() - taken) < 3


def test_while_another_process_computes_the_older_snapshot_is_served_at_once(client, traffic):
    older = (time.time() - 60, shared.compute()[1])
    cache.set(shared.KEY, older, 60)
    assert cache.add(shared.LOCK_KEY, 1, 60)  # another process is computing
    started = time.monotonic()
    with CaptureQueriesContext(connection) as queries:
        r = client.get("/metrics", **BEARER)
    assert r.status_code == 200 and r.content.startswith(metrics.exposition(*older)) and int(r["Age"]) >= 60
    assert time.monotonic() - started < 0.5 and not queries.captured_queries


def test_with_no_snapshot_yet_a_scrape_waits_for_the_process_computing_it(client, traffic):
    theirs = (time.time(), shared.compute()[1])
    cache.clear()
    assert cache.add(shared.LOCK_KEY, 1, 60)
    threading.Timer(0.3, lambda: cache.set(shared.KEY, theirs, 60)).start()
    started = time.monotonic()
    with CaptureQueriesContext(connection) as queries:
        r = client.get("/metrics", **BEARER)
    assert r.status_code == 200 and r.content.startswith(metrics.exposition(*theirs))
    assert 0.25 < time.monotonic() - started < 2 and not queries.captured_queries


def test_concurrent_scrapes_compute_one_snapshot(monkeypatch):
    computed = []

    def slow_compute():
        computed.append(1)
        time.sleep(0.3)
        return time.time(), {"one": 1}

    monkeypatch.setattr(shared, "compute", slow_compute)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(shared.current()[1])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 1 and answers == [{"one": 1}] * 8


@pytest.mark.django_db(transaction=True)
def test_two_servers_share_one_snapshot_per_window_through_redis(traffic):
    """Two Daphne processes on one Redis, scraped in turn for 4 s with a 2 s max age: the same
    snapshots from both, at most one computation per window, none older than the max age plus a
    computation when it was asked for; without the token each answers 401."""
    redis = start_redis()
    max_age, run_secs = 2.0, 4.0
    env = {"REDIS_URL": redis.url, "MQ_METRICS_TOKEN": TOKEN, "MQ_METRICS_MAX_AGE_SECS": str(max_age)}
    servers = [start_daphne(env), start_daphne(env)]
    try:
        for server in servers:
            r = httpx.get(f"{server.http}/metrics", timeout=5)
            assert r.status_code == 401 and r.json()["detail"]
        seen, ages = {0: set(), 1: set()}, []
        scrapes = 0
        started = time.time()
        # At least a dozen scrapes, however slow the machine (a loaded one made 10 in 4 s).
        while time.time() - started < run_secs or scrapes < 12:
            which = scrapes % 2
            asked = time.time()
            r = httpx.get(
                f"{servers[which].http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
            )
            assert r.status_code == 200
            taken = value(parse_metrics(r.text), "mq_metrics_snapshot_timestamp_seconds")
            ages.append(asked - taken)
            seen[which].add(taken)
            scrapes += 1
        elapsed = time.time() - started
        computations = seen[0] | seen[1]
        assert len(computations) <= elapsed / max_age + 1, (scrapes, sorted(computations))
        assert seen[0] & seen[1]  # one process's snapshot served by the other
        assert max(ages) < max_age + 1, max(ages)
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def test_it_asks_the_same_number_of_queries_however_many_rows(
    client, traffic, settings, django_assert_max_num_queries
):
    settings.MQ_METRICS_MAX_AGE_SECS = 0  # every scrape computes
    with django_assert_max_num_queries(30) as first:
        scrape(client)
    publish(traffic["db"], [prepare(f"e{i}", i) for i in range(10)])
    for i in range(3):
        s, _ = create_subscriber(f"more{i}", subscribe=["db"])
        subscribing.subscribe(s, traffic["db"])
        presence.open_connection(s, f"specific.more-{i}")
    with django_assert_max_num_queries(len(first.captured_queries)):
        scrape(client)
