"""How each subscriber's webhook is doing (WebhookHealth), and disabling one that keeps failing.

The webhook job writes it once per batch of posts, not per post: a failed batch adds its
failures to the count in one upsert; a batch with a success resets the count (only when there
is one to reset: a healthy webhook's batches write nothing); the job's end notes its last
success. A webhook whose every attempt failed for MQ_WEBHOOK_DISABLE_AFTER_SECS and at least
MQ_WEBHOOK_DISABLE_FAILURES attempts in a row is disabled by a compare-and-set UPDATE (of two
jobs at once, one disables it and tells). While disabled, no job leases for it
(delivery.tasks), so its deliveries stay pending with no attempt spent, and none dies of
attempts; a socket of its subscriber still receives them. Enabling it again makes its failed
deliveries ready at once and wakes its job, which delivers everything owed, in order where the
queue is ordered (the lease's rule).
"""

from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from mqsite import bus

from . import ledger, operational
from .models import Delivery, Status, WebhookHealth


def record_failures(subscriber, failures, error, now=None):
    """A batch of posts to the subscriber's webhook had `failures` failed attempts and no
    success (the last error `error`): count them, and disable the webhook if it has failed
    for long enough (webhook.disabled, after the commit). Returns whether it is disabled now.
    One statement, and one more only when the thresholds are passed."""
    now = now or timezone.now()
    table = WebhookHealth._meta.db_table
    at = connection.ops.adapt_datetimefield_value(now)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {table} (subscriber_id, failures, first_failure_at, last_failure_at, last_error)
            VALUES (%s, %s, %s, %s, %s)
            ON CONFLICT (subscriber_id) DO UPDATE SET
                failures = {table}.failures + excluded.failures,
                first_failure_at = COALESCE({table}.first_failure_at, excluded.first_failure_at),
                last_failure_at = excluded.last_failure_at,
                last_error = excluded.last_error
            RETURNING failures, disabled_since
            """,
            [subscriber.pk, failures, at, at, error],
        )
        count, disabled_since = cursor.fetchone()
        if disabled_since is not None or count < settings.MQ_WEBHOOK_DISABLE_FAILURES:
            return disabled_since is not None
        # Both thresholds, checked again in the UPDATE: compare-and-set, told once.
        since = connection.ops.adapt_datetimefield_value(
            now - timedelta(seconds=settings.MQ_WEBHOOK_DISABLE_AFTER_SECS)
        )
        cursor.execute(
            f"""
            UPDATE {table} SET disabled_since = %s, disabled_after = failures
            WHERE subscriber_id = %s AND disabled_since IS NULL AND failures >= %s
              AND first_failure_at <= %s
            """,
            [at, subscriber.pk, settings.MQ_WEBHOOK_DISABLE_FAILURES, since],
        )
        if cursor.rowcount != 1:
            return False
        operational.webhook_disabled(subscriber.name, WebhookHealth.objects.get(pk=subscriber.pk))
    return True


def record_success(subscriber, reset, now=None):
    """Posts to the subscriber's webhook succeeded: note it, and with `reset` (it had failures
    counted) reset the count. One upsert."""
    now = now or timezone.now()
    table = WebhookHealth._meta.db_table
    at = connection.ops.adapt_datetimefield_value(now)
    resets = ", failures = 0, first_failure_at = NULL" if reset else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {table} (subscriber_id, failures, last_error, last_success_at)
            VALUES (%s, 0, '', %s)
            ON CONFLICT (subscriber_id) DO UPDATE SET last_success_at = excluded.last_success_at{resets}
            """,
            [subscriber.pk, at],
        )


def is_disabled(subscriber_id):
    return WebhookHealth.objects.filter(pk=subscriber_id, disabled_since__isnull=False).exists()


def disable(subscriber, by, now=None):
    """An operator disables the subscriber's webhook (`by`: who, for webhook.disabled): as if
    it had failed for too long. Returns whether it changed (False: disabled already)."""
    now = now or timezone.now()
    with transaction.atomic():
        health, _ = WebhookHealth.objects.select_for_update().get_or_create(subscriber=subscriber)
        if health.disabled_since is not None:
            return False
        health.disabled_since, health.disabled_after = now, health.failures
        health.save(update_fields=["disabled_since", "disabled_after"])
        operational.webhook_disabled(subscriber.name, health, by)
    return True


def enable(subscriber, by, now=None):
    """Enable the subscriber's webhook again (an operator, `by`): its count starts again from
    nothing, the deliveries whose posts failed are ready at once (ledger.retry_now: those that
    waited for a retry), and its job is woken to deliver everything owed. Returns whether it
    changed (False: it was not disabled)."""
    now = now or timezone.now()
    with transaction.atomic():
        health = WebhookHealth.objects.select_for_update().filter(pk=subscriber.pk).first()
        if health is None or health.disabled_since is None:
            return False
        operational.webhook_enabled(subscriber.name, health, by)
        health.disabled_since = health.disabled_after = health.first_failure_at = None
        health.failures = 0
        health.save(update_fields=["disabled_since", "disabled_after", "first_failure_at", "failures"])
        # Only what was tried (attempt > 0) and waits for its retry: a delayed message keeps its time.
        waiting = Delivery.objects.filter(
            subscriber=subscriber, status=Status.PENDING, attempt__gt=0, next_attempt_at__gt=now
        )
        ledger.retry_now(waiting, reason=f"webhook enabled again by {by}", now=now)
        bus.send_after_commit(bus.WAKE, [subscriber.pk])
    return True


def health_of(subscriber):
    """Its WebhookHealth, or None when nothing was recorded yet."""
    return WebhookHealth.objects.filter(pk=subscriber.pk).first()


def disabled_webhooks():
    """[(subscriber name, WebhookHealth)] of the disabled webhooks, the most recent first."""
    rows = WebhookHealth.objects.filter(disabled_since__isnull=False).select_related("subscriber")
    return [(h.subscriber.name, h) for h in rows.order_by("-disabled_since")]
