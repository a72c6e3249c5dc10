"""Webhook delivery: signed posts to a real receiver on loopback, retries on the backoff
schedule, death after max_attempts, and the SSRF guard."""

import base64
import hashlib
import hmac
import json
import time
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.test import override_settings
from django.utils import timezone
from standardwebhooks import Webhook

from delivery import subscribing, tasks, webhooks
from delivery.models import Delivery, DeliveryAttempt, Status
from subscribers.provisioning import create_subscriber
from tests.support.publish import publish
from tests.support.receivers import Receiver
from tests.support.ssrf_urls import UNSAFE_URLS

pytestmark = pytest.mark.django_db


@pytest.fixture
def hooked(db_queue, receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    subscriber, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(subscriber, db_queue)
    return subscriber


def test_a_2xx_answer_acks_and_the_post_is_signed(hooked, db_queue, receiver):
    ((answer, _),) = publish(db_queue)
    assert tasks.deliver_webhooks(hooked.pk) == 1
    ((_, path, headers, body),) = receiver.requests
    assert path == "/hook"
    delivery = Delivery.objects.get()
    assert delivery.status == Status.ACKED
    frame = json.loads(body)
    assert frame["type"] == "message" and frame["id"] == delivery.pk and frame["message_id"] == answer["id"]
    assert frame["payload"] == {"n": 0} and frame["queue"] == "db" and frame["event"] == "create"
    assert headers["webhook-id"] == str(delivery.pk)
    # the Standard Webhooks reference library verifies it ...
    Webhook(hooked.webhook_secret).verify(body, headers)
    # ... and so does the spec computed by hand
    key = base64.b64decode(hooked.webhook_secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.{body.decode()}".encode()
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected}"
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 5
    (attempt,) = DeliveryAttempt.objects.all()
    assert attempt.ok and attempt.status_code == 200 and attempt.number == 1


def test_a_tampered_body_fails_verification(hooked, db_queue, receiver):
    publish(db_queue)
    tasks.deliver_webhooks(hooked.pk)
    ((_, _, headers, body),) = receiver.requests
    with pytest.raises(Exception):  # noqa: B017 - the library raises its own WebhookVerificationError
        Webhook(hooked.webhook_secret).verify(body.replace(b'"n":0', b'"n":1'), headers)


@override_settings(MQ_BACKOFF_BASE_SECS=0.3)
def test_failures_are_retried_on_the_backoff_schedule_then_acked(hooked, db_queue, receiver):
    receiver.script = [(500, 0), (503, 0), (200, 0)]
    publish(db_queue)
    deadline = time.monotonic() + 10
    while Delivery.objects.get().status != Status.ACKED and time.monotonic() < deadline:
        tasks.deliver_webhooks(hooked.pk)
        time.sleep(0.02)
    delivery = Delivery.objects.get()
    assert delivery.status == Status.ACKED and delivery.attempt == 3
    times = [t for t, *_ in receiver.requests]
    assert len(times) == 3
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert 0.28 < gaps[0] < 0.6 and 0.58 < gaps[1] < 0.9  # 0.3 s, then doubled
    outcomes = list(DeliveryAttempt.objects.order_by("number").values_list("number", "ok", "status_code"))
    assert outcomes == [(1, False, 500), (2, False, 503), (3, True, 200)]


@override_settings(MQ_BACKOFF_BASE_SECS=0.05)
def test_it_is_dead_after_max_attempts_with_the_reason_kept(hooked, db_queue, receiver):
    db_queue.max_attempts = 3
    db_queue.save()
    receiver.default = (500, 0)
    publish(db_queue)
    deadline = time.monotonic() + 10
    while Delivery.objects.get().status != Status.DEAD and time.monotonic() < deadline:
        tasks.deliver_webhooks(hooked.pk)
        time.sleep(0.02)
    delivery = Delivery.objects.get()
    assert delivery.status == Status.DEAD
    assert "HTTP 500" in delivery.last_error and "dead after 3 attempts" in delivery.last_error
    assert len(receiver.requests) == 3 and DeliveryAttempt.objects.count() == 3
    tasks.deliver_webhooks(hooked.pk)
    assert len(receiver.requests) == 3  # nothing more once dead


@pytest.fixture
def enqueued(monkeypatch):
    """The webhook jobs enqueued (subscriber ids), none of them run; no claim left over."""
    jobs = []
    monkeypatch.setattr(tasks.deliver_webhooks, "delay", jobs.append)
    cache.clear()
    yield jobs
    cache.clear()


def test_a_failing_endpoint_stops_the_job_and_gives_back_the_rest(
    hooked, db_queue, receiver, enqueued, django_capture_on_commit_callbacks
):
    receiver.default = (500, 0)
    publish(db_queue, 5)
    with django_capture_on_commit_callbacks(execute=True):
        tasks.deliver_webhooks(hooked.pk)
    assert len(receiver.requests) == 1
    rows = sorted(Delivery.objects.values_list("attempt", "status", "last_error"))
    assert rows[:4] == [(0, "pending", tasks.NOT_POSTED)] * 4  # not blamed on a closed connection
    assert rows[4][:2] == (1, "pending") and "HTTP 500" in rows[4][2]
    # Neither the failure (its retry is not due) nor the untried rest set off another job
    # now: the sweeper takes them when due, one job at a time.
    assert enqueued == []


def test_it_enqueues_one_job_per_subscriber_at_a_time(hooked, db_queue, enqueued):
    tasks.enqueue_webhooks([hooked.pk])
    tasks.enqueue_webhooks([hooked.pk])  # another wake-up while the job waits in the broker
    assert tasks.sweep()["webhook_jobs"] == 0
    assert enqueued == [hooked.pk]
    tasks.deliver_webhooks(hooked.pk)  # the job runs and ends: its claim goes with it
    tasks.enqueue_webhooks([hooked.pk])
    assert enqueued == [hooked.pk, hooked.pk]


def test_a_wake_up_asks_again_about_a_subscriber_once_it_is_given_a_webhook(
    logger, receiver, enqueued, settings, django_assert_num_queries
):
    """The web processes' wake-ups keep the subscribers they found without a webhook (no
    query after every commit for a subscriber that pulls), until a change is announced."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    # Given: a subscriber that pulls, found without a webhook by a wake-up
    assert tasks.enqueue_webhooks([logger.pk], kept=True) == 0
    with django_assert_num_queries(0):
        assert tasks.enqueue_webhooks([logger.pk], kept=True) == 0
    # When: it is given a webhook (a save: announced)
    logger.webhook_url = receiver.url
    logger.save()
    # Then: the next wake-up enqueues its job, and goes on asking (a socket may open)
    assert tasks.enqueue_webhooks([logger.pk], kept=True) == 1
    assert enqueued == [logger.pk]
    with django_assert_num_queries(1):
        tasks.enqueue_webhooks([logger.pk], kept=True)


def test_a_job_leaves_the_subscriber_to_the_job_already_running(hooked, db_queue, receiver):
    cache.set(tasks.claim_key(hooked.pk), "running:webhook:other", timeout=5)
    try:
        publish(db_queue)
        assert tasks.deliver_webhooks(hooked.pk) == 0
        assert receiver.requests == [] and Delivery.objects.get().status == Status.PENDING
        assert cache.get(tasks.claim_key(hooked.pk)) == "running:webhook:other"  # not ours to drop
    finally:
        cache.clear()


def test_a_job_waits_for_a_retry_due_within_the_lookahead(hooked, db_queue, receiver):
    publish(db_queue)
    due = timezone.now() + timedelta(seconds=0.6)
    Delivery.objects.update(next_attempt_at=due)
    assert tasks.deliver_webhooks(hooked.pk) == 1
    assert len(receiver.requests) == 1
    assert DeliveryAttempt.objects.get().at >= due  # not before the ledger said
    assert Delivery.objects.get().status == Status.ACKED
    # due later than the lookahead: the job ends, and the sweeper will enqueue one in time
    publish(db_queue)
    Delivery.objects.filter(status=Status.PENDING).update(
        next_attempt_at=timezone.now() + timedelta(seconds=tasks.RETRY_LOOKAHEAD_SECS + 2)
    )
    started = time.monotonic()
    assert tasks.deliver_webhooks(hooked.pk) == 0
    assert time.monotonic() - started < 0.5


@override_settings(MQ_BACKOFF_BASE_SECS=0.3)
def test_an_ordered_queues_line_is_retried_by_the_job_when_its_backoff_ends(
    hooked, db_queue, receiver, enqueued
):
    """On an ordered queue nothing may pass a failed post: the job waits for its retry rather
    than end and leave it to a sweep (a second more, and a Celery round trip, per failure).
    Then the line goes on, in order, in the same job."""
    db_queue.ordered = True
    db_queue.save()
    receiver.script = [(200, 0), (500, 0)]  # the second message fails once
    publish(db_queue, 4)
    started = time.monotonic()
    assert tasks.deliver_webhooks(hooked.pk) == 4
    assert time.monotonic() - started < 1.5
    posted = [json.loads(body)["payload"]["n"] for *_, body in receiver.requests]
    assert posted == [0, 1, 1, 2, 3]
    times = [t for t, *_ in receiver.requests]
    assert times[2] - times[1] >= 0.28  # the retry waited for its backoff
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}
    assert enqueued == []  # no job was needed beside this one


def test_an_ordered_line_moves_head_by_head_and_leaves_room_for_the_subscribers_other_queues(
    hooked, db_queue, make_queue, receiver, enqueued, monkeypatch
):
    """After each post of an ordered line the job leases the line's next head alone, with no
    read of the subscriber's other subscriptions; so a message of its other queue, published
    while the line drains, must still go within WEBHOOK_HEAD_ROUNDS posts, not after the line.
    The line stays in order, each message once."""
    db_queue.ordered = True
    db_queue.save()
    other = make_queue("other")
    hooked.subscribe_queues.add(other)
    subscribing.subscribe(hooked, other)
    line = 3 * tasks.WEBHOOK_HEAD_ROUNDS
    publish(db_queue, line)
    post_one = tasks.post_one

    def post_and_publish(subscriber, delivery, client):
        outcome = post_one(subscriber, delivery, client)
        if len(receiver.requests) == 3:  # a few posts into the line, another message comes
            publish(other, start=100)
        return outcome

    monkeypatch.setattr(tasks, "post_one", post_and_publish)
    assert tasks.deliver_webhooks(hooked.pk) == line + 1
    posted = [json.loads(body)["payload"]["n"] for *_, body in receiver.requests]
    assert [n for n in posted if n < 100] == list(range(line))
    assert posted.index(100) <= 3 + tasks.WEBHOOK_HEAD_ROUNDS
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_the_sweeper_enqueues_for_work_due_before_its_next_run(hooked, db_queue, enqueued):
    publish(db_queue)
    later = timezone.now() + timedelta(seconds=tasks.RETRY_LOOKAHEAD_SECS + 2)
    Delivery.objects.update(next_attempt_at=later)
    assert tasks.sweep()["webhook_jobs"] == 0
    Delivery.objects.update(next_attempt_at=timezone.now() + timedelta(seconds=0.5))
    assert tasks.sweep()["webhook_jobs"] == 1 and enqueued == [hooked.pk]


def test_a_nack_with_a_backoff_wakes_nobody_and_one_due_now_does(
    hooked, db_queue, monkeypatch, django_capture_on_commit_callbacks
):
    from delivery import ledger
    from mqsite import bus

    woken = []
    monkeypatch.setattr(bus, "send", lambda kind, ids: kind == bus.WAKE and woken.append(list(ids)))
    publish(db_queue, 2)
    first, second = ledger.lease_deliveries(hooked, limit=2)
    with django_capture_on_commit_callbacks(execute=True):
        ledger.nack_delivery(hooked, first["id"])  # retried after its backoff: nothing to do now
    assert woken == []
    with django_capture_on_commit_callbacks(execute=True):
        ledger.nack_delivery(hooked, second["id"], retry_in=0)
    assert woken == [[hooked.pk]]


def test_no_answer_within_the_timeout_is_a_failed_attempt(hooked, db_queue, receiver, settings):
    settings.MQ_WEBHOOK_TIMEOUT_SECS = 0.3
    receiver.default = (200, 1.0)
    publish(db_queue)
    tasks.deliver_webhooks(hooked.pk)
    delivery = Delivery.objects.get()
    assert delivery.status == Status.PENDING and "Timeout" in delivery.last_error


def test_a_redirect_is_not_followed(hooked, db_queue, receiver):
    target = Receiver()
    try:
        receiver.redirect_to = target.url
        receiver.default = (302, 0)
        publish(db_queue)
        tasks.deliver_webhooks(hooked.pk)
        assert target.requests == []
        assert "HTTP 302" in Delivery.objects.get().last_error
    finally:
        target.close()


def test_a_subscriber_with_a_live_socket_is_not_posted_to(hooked, db_queue, receiver):
    from delivery import presence

    presence.open_connection(hooked, "specific.test!1")
    publish(db_queue)
    assert tasks.deliver_webhooks(hooked.pk) == 0
    assert receiver.requests == []


def test_the_sweeper_expires_leases_and_enqueues_due_webhook_jobs(hooked, db_queue, enqueued):
    publish(db_queue)
    result = tasks.sweep()
    assert enqueued == [hooked.pk] and result["webhook_jobs"] == 1
    tasks.sweep()
    assert enqueued == [hooked.pk]  # the job is still queued: not a second one
    # an overdue lease comes back to pending
    Delivery.objects.update(status=Status.INFLIGHT, attempt=1, ack_deadline=timezone.now())
    assert tasks.sweep()["expired"] == 1
    assert Delivery.objects.get().status == Status.PENDING


@pytest.mark.parametrize("url", UNSAFE_URLS)
def test_unsafe_webhook_urls_are_refused(url, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(webhooks.UnsafeURL):
        webhooks.resolve_safe(url)


def test_a_public_address_passes_the_guard(settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False
    _, port, address = webhooks.resolve_safe("https://93.184.216.34/hook")
    assert str(address) == "93.184.216.34" and port == 443


def test_the_guard_refuses_at_send_time_too(db_queue, receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    subscriber, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(subscriber, db_queue)
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False  # an operator turned it off later
    publish(db_queue)
    tasks.deliver_webhooks(subscriber.pk)
    assert receiver.requests == []
    assert "refused" in Delivery.objects.get().last_error


def test_an_unsafe_url_is_refused_where_it_is_entered(db, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError):
        create_subscriber("bad", webhook_url="http://169.254.169.254/")


def test_a_paused_subscription_is_posted_nothing_and_wakes_no_job_until_resumed(hooked, db_queue, receiver):
    from subscribers.models import Subscription

    subscribing.pause(Subscription.objects.filter(subscriber=hooked))
    publish(db_queue, 3)
    assert tasks.deliver_webhooks(hooked.pk) == 0
    assert receiver.requests == []
    # Neither the job's look for a retry nor the sweep's due read sees paused work.
    assert tasks.next_due_at(hooked.pk, timezone.now() - timedelta(seconds=1)) is None
    assert tasks.sweep()["webhook_jobs"] == 0
    subscribing.resume(Subscription.objects.filter(subscriber=hooked))
    assert tasks.deliver_webhooks(hooked.pk) == 3
    assert sorted(json.loads(body)["payload"]["n"] for *_, body in receiver.requests) == [0, 1, 2]
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_an_ordered_lines_next_head_after_an_ack_waits_while_paused(hooked, make_queue):
    """The job's next heads after an ack (ledger.lease_heads_after, no read first) respect the
    pause: the delivery in flight is acked as usual, the line waits, and goes on in order."""
    from delivery import ledger
    from subscribers.models import Subscription

    line = make_queue("line", ordered=True)
    hooked.subscribe_queues.add(line)
    sub, _ = subscribing.subscribe(hooked, line)
    publish(line, 3)
    (head,) = ledger.lease_deliveries(hooked, limit=5, holder="job")
    assert head["seq"] == 1
    subscribing.pause(Subscription.objects.filter(pk=sub.pk))
    assert ledger.ack_deliveries(hooked, [head["id"]])[0] == 1
    assert ledger.lease_heads_after(hooked, [head["id"]], limit=5, holder="job") == []
    assert ledger.lease_deliveries(hooked, limit=5, holder="job") == []
    subscribing.resume(Subscription.objects.filter(pk=sub.pk))
    assert [d["seq"] for d in ledger.lease_heads_after(hooked, [head["id"]], limit=5, holder="job")] == [2]
