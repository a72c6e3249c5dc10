"""Build delivery history in the database with known ages, outcomes and latencies, through the
publish service and the ledger where they can make it."""

from datetime import timedelta

from django.utils import timezone

from delivery import ledger, publishing
from delivery.models import Delivery, Status
from queues.models import Message


def publish_at(queue, event, at, payload=None):
    """Publish one message as if at `at`: the message and its deliveries made then."""
    answer = publishing.publish(queue, [publishing.prepare(event, payload)])[0][0]
    Message.objects.filter(id=answer["id"]).update(created_at=at)
    Delivery.objects.filter(message_id=answer["id"]).update(created_at=at, next_attempt_at=at)
    return answer["id"]


def delivery_of(message_id, subscriber):
    return Delivery.objects.get(message_id=message_id, subscriber=subscriber)


def settle(message_id, outcomes, *, latency_ms=100, attempts=1):
    """Move each subscriber's delivery of the message: outcomes = {subscriber: status}.

    acked goes through the ledger's ack (at publish + latency_ms), dead through the operator's
    kill; in flight is set as a lease leaves it (the lease itself hands out the oldest first,
    whatever was asked).
    """
    for subscriber, status in outcomes.items():
        d = delivery_of(message_id, subscriber)
        Delivery.objects.filter(id=d.id).update(attempt=attempts, delivered_at=d.created_at)
        if status == Status.ACKED:
            ledger.ack_deliveries(subscriber, [d.id], now=d.created_at + timedelta(milliseconds=latency_ms))
        elif status == Status.DEAD:
            ledger.kill_deliveries(Delivery.objects.filter(id=d.id))
        elif status == Status.INFLIGHT:
            Delivery.objects.filter(id=d.id).update(
                status=Status.INFLIGHT, ack_deadline=timezone.now() + timedelta(seconds=30)
            )
        else:
            assert status == Status.PENDING


def days_ago(days):
    return timezone.now() - timedelta(days=days)
