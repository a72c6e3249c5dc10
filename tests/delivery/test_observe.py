"""The latency histograms' observations (delivery.observe), in the test's own process (its
counts are this process's alone: no PROMETHEUS_MULTIPROC_DIR): what each publish and each ack
adds, and from when an ack's latency counts. tests/e2e/test_metrics_histograms.py has them
against real servers."""

from datetime import timedelta

import pytest
from django.utils import timezone

from delivery import ledger, observe
from delivery.models import Delivery
from delivery.publishing import prepare, publish
from mqsite import prometheus
from tests.support.personas import subscribed_owner
from tests.support.rest import post_messages


def sample(name, **labels):
    return prometheus.LOCAL.get_sample_value(name, labels) or 0


def latency_buckets(queue="db"):
    """{upper bound: observations at or under it} of the queue's ack latency."""
    return {
        le: sample("mq_delivery_latency_seconds_bucket", queue=queue, le=str(le))
        for le in observe.LATENCY_BUCKETS
    }


def added(before, after):
    """The bounds of the buckets the observations between the two readings fell in (each
    observation's smallest bucket)."""
    grew = {le: after[le] - before[le] for le in before}
    out, seen = [], 0
    for le in sorted(grew):
        out += [le] * int(grew[le] - seen)
        seen = grew[le]
    return out


@pytest.fixture
def owner(db):
    _, owner, _, _ = subscribed_owner()
    return owner


def delivery_of(answer):
    return Delivery.objects.get(message_id=answer["id"])


def test_an_ack_counts_from_the_publish_or_from_deliver_at(owner):
    queue = owner.subscribe_queues.get(name="db")
    [(now, _), (later, _)] = publish(queue, [prepare("e", 1), prepare("e", 2, delay_secs=600)])
    published = delivery_of(now).created_at
    deliver_at = published + timedelta(seconds=600)
    before = latency_buckets()

    # When the first is acked 0.3 s after its publish and the delayed one 1.5 s after its time
    ledger.ack_deliveries(owner, [delivery_of(now).id], now=published + timedelta(seconds=0.3))
    ledger.ack_deliveries(owner, [delivery_of(later).id], now=deliver_at + timedelta(seconds=1.5))

    # Then 0.3 s and 1.5 s (the wait it asked for is no latency), not 601.5 s
    assert added(before, latency_buckets()) == [0.5, 2.0]


def test_a_retried_delivery_counts_from_its_publish_and_an_ack_again_counts_nothing(owner):
    queue = owner.subscribe_queues.get(name="db")
    [(answer, _)] = publish(queue, [prepare("e", 1)])
    delivery = delivery_of(answer)
    ledger.lease_deliveries(owner, limit=1)
    ledger.nack_deliveries(owner, [delivery.id], retry_in=2)  # ready again later than it was made
    before = latency_buckets()

    acked_at = delivery.created_at + timedelta(seconds=7)
    assert ledger.ack_deliveries(owner, [delivery.id], now=acked_at)[0] == 1
    assert ledger.ack_deliveries(owner, [delivery.id], now=acked_at)[0] == 0

    assert added(before, latency_buckets()) == [10.0]


def test_a_webhook_success_is_an_ack_and_its_failure_is_not(owner):
    queue = owner.subscribe_queues.get(name="db")
    publish(queue, [prepare("e", 1), prepare("e", 2)])
    ok, failed = ledger.lease_deliveries(owner, limit=2)
    before = sample("mq_delivery_latency_seconds_count", queue="db")

    ledger.settle_posts(
        owner,
        [
            ledger.Posted(ok["id"], 1, True, 200, "", 5, False),
            ledger.Posted(failed["id"], 1, False, 500, "HTTP 500", 5, False),
        ],
    )

    assert sample("mq_delivery_latency_seconds_count", queue="db") == before + 1


def test_a_rest_publish_is_observed_once_whatever_its_messages_and_a_failed_call_not_at_all(owner):
    before = sample("mq_publish_duration_seconds_count", transport="rest")
    assert post_messages(owner, {"event": "e", "payload": 1}).status_code == 201
    batch = {"messages": [{"event": "e", "payload": i} for i in range(5)]}
    assert post_messages(owner, batch).status_code == 201
    assert sample("mq_publish_duration_seconds_count", transport="rest") == before + 2
    assert 0 < sample("mq_publish_duration_seconds_sum", transport="rest") < 60

    with pytest.raises(RuntimeError), observe.publishing("rest"):
        raise RuntimeError("the publish failed: nothing committed")
    assert sample("mq_publish_duration_seconds_count", transport="rest") == before + 2


def test_a_queue_the_process_has_not_named_yet_costs_one_query_once(owner, django_assert_max_num_queries):
    queue = owner.subscribe_queues.get(name="db")
    publish(queue, [prepare("e", 1), prepare("e", 2)])
    first, second = Delivery.objects.filter(subscriber=owner).order_by("id")
    observe._queue_names.pop(queue.pk, None)
    with django_assert_max_num_queries(2):  # the ack, the queue's name
        ledger.ack_deliveries(owner, [first.id], now=timezone.now())
    with django_assert_max_num_queries(1):
        ledger.ack_deliveries(owner, [second.id], now=timezone.now())
