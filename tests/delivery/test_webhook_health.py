"""Webhooks that keep failing: counted once per batch, disabled after MQ_WEBHOOK_DISABLE_FAILURES
failures in a row over MQ_WEBHOOK_DISABLE_AFTER_SECS, their deliveries kept owed with no attempt
spent, enabled again by an operator (admin action, manage.py webhook) to deliver everything in
order; and the trace context as HTTP headers. Posts go to a real receiver on loopback."""

import io
import json
import time
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.core.cache import cache
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from delivery import publishing, subscribing, tasks, webhook_health
from delivery.models import Delivery, Status, WebhookHealth
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber
from tests.support import admin as admin_pages
from tests.support.publish import publish

pytestmark = pytest.mark.django_db

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def hooked(db_queue, receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    settings.MQ_BACKOFF_BASE_SECS = 0.01
    settings.MQ_BACKOFF_MAX_SECS = (
        0.02  # (equal to the base, the backoff SQL has no step: a CASE of an ELSE alone)
    )
    db_queue.max_attempts = 1000  # nothing dies of attempts here: what is tested is disabling
    db_queue.save()
    subscriber, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(subscriber, db_queue)
    cache.clear()
    yield subscriber
    cache.clear()


@pytest.fixture
def enqueued(monkeypatch):
    jobs = []
    monkeypatch.setattr(tasks.deliver_webhooks, "delay", jobs.append)
    return jobs


def run_jobs(subscriber, times):
    """The webhook job `times` times, each after the last one's retry fell due (a job posts
    until the first failure of an unordered queue, then ends)."""
    for _ in range(times):
        tasks.deliver_webhooks(subscriber.pk)
        time.sleep(0.03)


def health(subscriber):
    return WebhookHealth.objects.get(pk=subscriber.pk)


def attempts():
    return sorted(Delivery.objects.values_list("id", "status", "attempt"))


@override_settings(MQ_WEBHOOK_DISABLE_FAILURES=3, MQ_WEBHOOK_DISABLE_AFTER_SECS=60)
def test_it_is_disabled_after_enough_failures_over_the_period_and_its_deliveries_stay_owed(
    hooked, db_queue, receiver, enqueued, django_capture_on_commit_callbacks
):
    receiver.default = (500, 0)
    publish(db_queue, 3)
    # Given: more failures in a row than the setting, but all within the period
    run_jobs(hooked, 4)
    assert health(hooked).failures == 4 and health(hooked).disabled_since is None
    # When: the first of them is older than the period, and one more fails
    WebhookHealth.objects.filter(pk=hooked.pk).update(first_failure_at=timezone.now() - timedelta(seconds=61))
    with django_capture_on_commit_callbacks(execute=True):
        run_jobs(hooked, 1)
    # Then: disabled, with since when, after how many failures and the last error
    state = health(hooked)
    assert state.disabled_since is not None and state.disabled_after == 5
    assert "HTTP 500" in state.last_error
    # ... and no more posts: its deliveries stay pending, no attempt spent, none dead
    posts, before = len(receiver.requests), attempts()
    assert all(status == Status.PENDING for _, status, _ in before)
    run_jobs(hooked, 3)
    time.sleep(0.05)
    assert tasks.sweep()["webhook_jobs"] == 0 and enqueued == []
    assert tasks.enqueue_webhooks([hooked.pk]) == 0 and tasks.enqueue_webhooks([hooked.pk], kept=True) == 0
    assert len(receiver.requests) == posts and attempts() == before


@override_settings(MQ_WEBHOOK_DISABLE_FAILURES=3, MQ_WEBHOOK_DISABLE_AFTER_SECS=0)
def test_a_success_resets_the_count(hooked, db_queue, receiver):
    receiver.script = [(500, 0), (503, 0)]  # then 200s
    publish(db_queue, 2)
    run_jobs(hooked, 2)
    assert health(hooked).failures == 2
    run_jobs(hooked, 1)
    state = health(hooked)
    assert state.failures == 0 and state.first_failure_at is None and state.last_success_at is not None
    assert state.disabled_since is None
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}
    # Two failures more do not reach the three in a row: the count started again
    receiver.script = [(500, 0), (500, 0)]
    publish(db_queue, 1, start=10)
    run_jobs(hooked, 2)
    assert health(hooked).failures == 2 and health(hooked).disabled_since is None


def test_a_healthy_webhook_notes_its_last_success_at_most_once_a_minute(hooked, db_queue, receiver):
    publish(db_queue, 3)
    assert tasks.deliver_webhooks(hooked.pk) == 3
    state = health(hooked)
    assert state.failures == 0 and state.last_success_at is not None and not state.disabled
    publish(db_queue, 1, start=3)
    assert tasks.deliver_webhooks(hooked.pk) == 1
    assert health(hooked).last_success_at == state.last_success_at  # no write a job
    WebhookHealth.objects.filter(pk=hooked.pk).update(
        last_success_at=state.last_success_at - timedelta(minutes=2)
    )
    publish(db_queue, 1, start=4)
    assert tasks.deliver_webhooks(hooked.pk) == 1
    assert health(hooked).last_success_at > state.last_success_at


@override_settings(MQ_WEBHOOK_DISABLE_FAILURES=2, MQ_WEBHOOK_DISABLE_AFTER_SECS=0)
def test_enabling_it_again_delivers_everything_owed_in_order(
    hooked, db_queue, receiver, django_capture_on_commit_callbacks
):
    db_queue.ordered = True
    db_queue.save()
    receiver.default = (500, 0)
    publish(db_queue, 5)
    run_jobs(hooked, 3)
    assert health(hooked).disabled
    failed_posts = len(receiver.requests)
    assert failed_posts == 2  # the head, twice; nothing passed it
    publish(db_queue, 2, start=5)  # more owed while disabled
    run_jobs(hooked, 1)
    assert len(receiver.requests) == failed_posts
    # When: the endpoint is fixed and the webhook enabled again
    receiver.default = (200, 0)
    with django_capture_on_commit_callbacks(execute=True):
        assert webhook_health.enable(hooked, by="op") is True
    assert webhook_health.enable(hooked, by="op") is False  # once
    assert tasks.deliver_webhooks(hooked.pk) == 7
    # Then: everything owed, in seq order
    posted = [json.loads(body)["payload"]["n"] for _, _, _, body in receiver.requests[failed_posts:]]
    assert posted == list(range(7))
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}
    assert health(hooked).failures == 0 and not health(hooked).disabled


def test_the_post_carries_the_messages_trace_context_as_http_headers(hooked, db_queue, receiver):
    outgoing = publishing.prepare(
        "create", {"n": 0}, headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1", "other": "x"}
    )
    publishing.publish(db_queue, [outgoing])
    publish(db_queue, 1, start=1)  # one without
    assert tasks.deliver_webhooks(hooked.pk) == 2
    with_trace, without = ({k.lower(): v for k, v in r[2].items()} for r in receiver.requests)
    assert with_trace["traceparent"] == TRACEPARENT and with_trace["tracestate"] == "vendor=1"
    assert "other" not in with_trace  # other headers go in the body only
    assert "traceparent" not in without and "tracestate" not in without


def test_the_admin_disables_and_enables_it_with_history(hooked, db_queue, receiver, staff):
    publish(db_queue, 2)
    page = admin_pages.act(staff, Subscriber, "disable_webhook", [hooked])
    assert page.status_code == 200 and health(hooked).disabled
    assert tasks.deliver_webhooks(hooked.pk) == 0 and receiver.requests == []
    shown = staff.get(admin_pages.change(hooked)).content.decode()
    assert "mq-webhook-disabled" in shown and "manage.py webhook enable monitor" in shown
    listed = staff.get(admin_pages.changelist(Subscriber)).content.decode()
    assert "mq-webhook-disabled" in listed
    admin_pages.act(staff, Subscriber, "enable_webhook", [hooked])
    assert not health(hooked).disabled
    history = list(
        LogEntry.objects.filter(object_id=str(hooked.pk))
        .order_by("action_time")
        .values_list("change_message", flat=True)
    )
    assert history == ["disabled the webhook", "enabled the webhook again"]
    assert tasks.deliver_webhooks(hooked.pk) == 2


def test_manage_py_webhook_shows_enables_and_disables_it(hooked):
    out = io.StringIO()
    call_command("webhook", "disable", "monitor", "--json", stdout=out)
    state = json.loads(out.getvalue())
    assert state["disabled"] is True and state["changed"] is True and state["disabled_since"]
    out = io.StringIO()
    call_command("webhook", "status", "monitor", stdout=out)
    assert out.getvalue().startswith("monitor: webhook disabled since ")
    out = io.StringIO()
    call_command("webhook", "enable", "monitor", "--json", stdout=out)
    state = json.loads(out.getvalue())
    assert state["disabled"] is False and state["changed"] is True and state["failures"] == 0
    out = io.StringIO()
    call_command("webhook", "enable", "monitor", stdout=out)
    assert out.getvalue().strip() == "monitor: webhook enabled (unchanged)"


def test_manage_py_webhook_refuses_an_unknown_subscriber(db):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no subscriber named 'nobody'"):
        call_command("webhook", "enable", "nobody")
