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


def two_queues_of_history(db, network, logger, peer, n=24):
    """n messages over ten days in db (create, delete) and network (error): the logger acks all
    of them, the peer (of db) acks, leaves pending or dead-letters some; latencies and
    attempts varied. The subscriptions are made here."""
    from delivery import subscribing

    logger.subscribe_queues.add(network)  # a subscription is owed only what its right allows
    for queue in (db, network):
        subscribing.subscribe(logger, queue)
    subscribing.subscribe(peer, db)
    for i in range(n):
        queue, event = ((db, "create"), (db, "delete"), (network, "error"))[i % 3]
        message_id = publish_at(queue, event, days_ago(10 - i * 0.3), {"i": i})
        outcomes = {logger: Status.ACKED}
        if queue == db:
            outcomes[peer] = (Status.ACKED, Status.ACKED, Status.PENDING, Status.DEAD)[i % 4]
        settle(message_id, outcomes, latency_ms=40 + 173 * i, attempts=1 + i % 3)


def expected_events():
    """{(queue, event): figures} of the rows in the database now, counted in plain Python:
    messages, deliveries, acked, dead, attempts_mean (acked and dead) and the sorted latencies
    (ms, publish to ack)."""
    events = {}
    for m in Message.objects.values("queue__name", "event__name"):
        key = (m["queue__name"], m["event__name"])
        e = events.setdefault(
            key, {"messages": 0, "deliveries": 0, "acked": 0, "dead": 0, "settled": [], "latencies": []}
        )
        e["messages"] += 1
    for d in Delivery.objects.values(
        "queue__name", "event__name", "status", "attempt", "created_at", "acked_at"
    ):
        e = events[(d["queue__name"], d["event__name"])]
        e["deliveries"] += 1
        e["acked"] += d["status"] == Status.ACKED
        e["dead"] += d["status"] == Status.DEAD
        if d["status"] in (Status.ACKED, Status.DEAD):
            e["settled"].append(d["attempt"])
        if d["status"] == Status.ACKED:
            e["latencies"].append((d["acked_at"] - d["created_at"]).total_seconds() * 1000)
    for e in events.values():
        e["attempts_mean"] = sum(e["settled"]) / len(e["settled"]) if e["settled"] else None
        e["latencies"].sort()
    return events
