"""Webhook hardening in one process: a hard deadline for the whole post against a real peer
that drips bytes, the claim renewed while its job runs and lapsing soon after it stops, the
queues the tasks are routed to, and whether a failure looks permanent, as operators see it."""

import re
import threading
import time

import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from delivery import subscribing, tasks
from delivery.models import Delivery, DeliveryAttempt, Status
from mqsite.celery import app
from subscribers.provisioning import create_subscriber
from tests.support.publish import publish
from tests.support.receivers import Dripper, Receiver

pytestmark = pytest.mark.django_db

DEADLINE = 1.5  # MQ_WEBHOOK_TIMEOUT_SECS in these tests; the contract's 10 s otherwise


@pytest.fixture
def hook(db_queue, settings):
    """Subscribe a webhook subscriber at `url` to db."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    settings.MQ_WEBHOOK_TIMEOUT_SECS = DEADLINE
    cache.clear()

    def make(url, name="monitor"):
        subscriber, _ = create_subscriber(name, subscribe=["db"], webhook_url=url)
        subscribing.subscribe(subscriber, db_queue)
        return subscriber

    yield make
    cache.clear()


def post_threads():
    return {t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor")}


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_peer_dripping_bytes_fails_the_attempt_at_the_deadline(hook, db_queue, part):
    dripper = Dripper(part=part, interval=1.0, lasting=6.0)  # a byte a second, past the deadline
    try:
        subscriber = hook(dripper.url)
        publish(db_queue)
        before = post_threads()
        started = time.monotonic()
        assert tasks.deliver_webhooks(subscriber.pk) == 0
        took = time.monotonic() - started
    finally:
        dripper.close()
    print(f"dripping {part}: the job ended {took:.3f} s after it started (deadline {DEADLINE} s)")
    assert dripper.connections, "the post reached the dripping peer"
    # The job (and the thread running it) is free at the deadline, not when the peer stops.
    assert DEADLINE <= took < DEADLINE + 0.4
    assert post_threads() <= before  # no post thread left behind
    (attempt,) = DeliveryAttempt.objects.all()
    assert not attempt.ok and not attempt.permanent
    assert DEADLINE * 1000 <= attempt.duration_ms < DEADLINE * 1000 + 300
    assert f"no complete answer within {DEADLINE:g} s" in attempt.error
    delivery = Delivery.objects.get()
    assert delivery.status == Status.PENDING and delivery.attempt == 1  # retried on the schedule


def test_a_claim_is_held_while_its_job_runs_and_lapses_soon_after_renewal_stops(hook, db_queue, monkeypatch):
    # The worker's renewer as it runs, on shorter clocks: a claim living 1 s, renewed every 0.3 s.
    monkeypatch.setattr(tasks, "CLAIM_RUNNING_SECS", 1.0)
    monkeypatch.setattr(tasks, "CLAIM_RENEW_SECS", 0.3)
    enqueued = []
    monkeypatch.setattr(tasks.deliver_webhooks, "delay", enqueued.append)
    subscriber = hook("http://127.0.0.1:1/hook")  # never posted to here
    publish(db_queue)
    key, mine = tasks.claim_key(subscriber.pk), "running:webhook:dying"
    tasks.claims.hold(key, mine)  # a job starts
    time.sleep(2.5)  # more than twice the claim's life
    assert cache.get(key) == mine  # renewed all along
    assert tasks.enqueue_webhooks([subscriber.pk]) == 0  # nobody piles onto the job
    with tasks.claims.lock:  # its worker dies: nobody renews it any more
        del tasks.claims.held[key]
    died = time.monotonic()
    while cache.get(key) is not None and time.monotonic() - died < 5:
        time.sleep(0.02)
    lapsed = time.monotonic() - died
    print(f"claim lapsed {lapsed:.3f} s after its last renewer stopped (life 1 s)")
    assert lapsed <= 1.1
    assert tasks.enqueue_webhooks([subscriber.pk]) == 1 and enqueued == [subscriber.pk]


def test_a_job_releases_its_claim_when_it_ends(hook, db_queue):
    receiver = Receiver()
    try:
        subscriber = hook(receiver.url)
        publish(db_queue)
        assert tasks.deliver_webhooks(subscriber.pk) == 1
        assert cache.get(tasks.claim_key(subscriber.pk)) is None
        assert tasks.claims.held == {}
    finally:
        receiver.close()


def test_sweeper_and_archive_have_a_queue_of_their_own_apart_from_the_posts():
    def queue_of(name):
        return app.amqp.router.route({}, name)["queue"].name

    assert queue_of("delivery.tasks.sweep") == "maintenance"
    assert queue_of("analytics.tasks.archive_history") == "maintenance"
    assert queue_of("delivery.tasks.deliver_webhooks") == "webhooks"


@pytest.mark.parametrize(
    ("status", "permanent"),
    [(400, True), (404, True), (410, True), (408, False), (429, False), (500, False), (503, False)],
)
def test_a_failure_is_recorded_as_permanent_or_transient(hook, db_queue, status, permanent):
    receiver = Receiver(default=(status, 0))
    try:
        subscriber = hook(receiver.url)
        publish(db_queue)
        tasks.deliver_webhooks(subscriber.pk)
    finally:
        receiver.close()
    (attempt,) = DeliveryAttempt.objects.all()
    assert (attempt.ok, attempt.status_code, attempt.permanent) == (False, status, permanent)
    # retried on the contract's schedule either way
    delivery = Delivery.objects.get()
    assert delivery.status == Status.PENDING and delivery.next_attempt_at is not None


def test_refused_urls_and_unreachable_endpoints(hook, db_queue, settings):
    subscriber = hook("http://127.0.0.1:1/hook")  # nothing listens: a connection error
    publish(db_queue)
    tasks.deliver_webhooks(subscriber.pk)
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False  # now the same URL is refused
    Delivery.objects.update(next_attempt_at=timezone.now())
    tasks.deliver_webhooks(subscriber.pk)
    first, second = DeliveryAttempt.objects.order_by("number")
    assert "ConnectError" in first.error and not first.permanent
    assert second.error.startswith("refused:") and second.permanent


def test_the_admin_shows_whether_each_failure_looks_permanent(hook, db_queue, operator):
    receiver = Receiver(script=[(500, 0), (404, 0), (200, 0)])
    try:
        subscriber = hook(receiver.url)
        publish(db_queue)
        for _ in range(3):
            Delivery.objects.update(next_attempt_at=timezone.now())
            tasks.deliver_webhooks(subscriber.pk)
    finally:
        receiver.close()
    delivery = Delivery.objects.get()
    assert delivery.status == Status.ACKED
    client = Client()
    client.force_login(operator)
    page = client.get(reverse("admin:delivery_delivery_change", args=[delivery.pk]))
    assert page.status_code == 200
    shown = re.findall(r'class="field-failure">\s*<p>([^<]*)</p>', page.content.decode())
    assert shown == ["transient", "permanent", "-"]  # the 500, the 404, the 200
    assert [a.permanent for a in DeliveryAttempt.objects.order_by("number")] == [False, True, False]


def test_it_logs_an_endpoints_answer_escaped_on_one_line_and_truncated(hook, db_queue, caplog):
    """An endpoint's answer is the endpoint's text: a CR LF in it must not forge a log line."""
    receiver = Receiver(default=(500, 0), body=b"oops\r\nFAKE LOG LINE level=CRITICAL " + b"x" * 1000)
    try:
        subscriber = hook(receiver.url)
        publish(db_queue)
        with caplog.at_level("INFO", logger="delivery.tasks"):
            tasks.deliver_webhooks(subscriber.pk)
    finally:
        receiver.close()
    [record] = [r for r in caplog.records if "webhook of monitor failed" in r.getMessage()]
    line = record.getMessage()
    assert "\r" not in line and "\n" not in line
    assert r"oops\r\nFAKE LOG LINE" in line  # escaped, still readable
    assert len(line) < 300 and "x" * 200 not in line  # truncated
    # The ledger keeps the error as it was (the admin escapes it when it shows it).
    assert "\r\nFAKE LOG LINE" in Delivery.objects.get().last_error
