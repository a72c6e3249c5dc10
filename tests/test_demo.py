"""The demo a newcomer's first `make run` brings: the seeds (made by bootstrap, once, on a fresh
install) and `manage.py demo`, which publishes and acks so that counters move."""

import json
import stat
from io import StringIO

import pytest
from django.core.management import call_command

from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.models import Subscriber, Subscription
from subscribers.tokens import hash_token


@pytest.fixture
def var_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    settings.PORT = 8123
    return tmp_path


def run(*args):
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def seeded():
    return {
        "queues": {q.name: q.max_attempts for q in Queue.objects.all()},
        "subscriptions": sorted(
            (s.subscriber.name, s.queue.name, s.event.name if s.event_id else None)
            for s in Subscription.objects.select_related("subscriber", "queue", "event")
        ),
        "subscribers": sorted(Subscriber.objects.values_list("name", "token_hash")),
    }


def test_bootstrap_seeds_the_demo_once_and_then_leaves_it_alone(db, var_dir):
    first = run("bootstrap")
    world = seeded()
    again = run("bootstrap")

    assert world["queues"] == {"db": 10, "filesystem": 10, "network": 3}
    assert world["subscriptions"] == [
        ("dashboard", "db", "create"),
        ("logger", "db", None),
        ("logger", "filesystem", None),
        ("monitor", "db", "create"),
        ("monitor", "network", "error"),
    ]
    assert seeded() == world  # idempotent: nothing new, no token issued again
    assert first == again
    for url in ("http://127.0.0.1:8123/", "http://127.0.0.1:8123/admin/", "http://127.0.0.1:8123/api/docs/"):
        assert any(line.endswith(url) for line in first.splitlines()), first

    # The tokens are kept for the newcomer (owner-only) and are the subscribers' own.
    path = var_dir / "demo_tokens"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    tokens = dict(line.split() for line in path.read_text().splitlines())
    assert sorted(tokens) == ["dashboard", "logger", "monitor"]
    for name, token in tokens.items():
        assert Subscriber.objects.get(name=name).token_hash == hash_token(token)
    assert str(path) in first


def test_bootstrap_seeds_nothing_where_a_queue_exists(db, var_dir):
    Queue.objects.create(name="mine")
    out = run("bootstrap")
    assert list(Queue.objects.values_list("name", flat=True)) == ["mine"]
    assert not Subscriber.objects.exists()
    assert "demo:" not in out
    assert "http://127.0.0.1:8123/" in out


def test_bootstrap_may_be_told_not_to_seed(db, var_dir):
    run("bootstrap", "--no-demo")
    assert not Queue.objects.exists()


def test_the_demo_publishes_a_bounded_number_and_its_subscribers_ack_them(db, var_dir):
    run("bootstrap")

    out = run("demo", "--count", "24", "--rate", "200", "--poison-every", "0", "--seed", "7")

    summary = json.loads(out.splitlines()[-1])
    assert Message.objects.count() == summary["published"] == 24
    deliveries = Delivery.objects.all()
    assert deliveries.count() > 0
    # Every delivery made is settled, acked by its demo subscriber.
    assert set(deliveries.values_list("status", flat=True)) == {Status.ACKED}
    assert summary["acked"] == deliveries.count()
    assert summary["nacked"] == 0
    assert {q for q in Message.objects.values_list("queue__name", flat=True)} <= {
        "db",
        "filesystem",
        "network",
    }
    # Latency is real: the demo subscribers work a moment before they ack.
    assert all(d.acked_at > d.created_at for d in deliveries)


def test_a_malformed_report_is_refused_by_the_monitor_until_it_is_dead(db, var_dir, settings):
    settings.MQ_BACKOFF_BASE_SECS = 0.05  # retried within the test's time
    settings.MQ_BACKOFF_MAX_SECS = 0.1
    run("bootstrap")

    out = run("demo", "--count", "40", "--rate", "400", "--poison-every", "2", "--seed", "3")

    summary = json.loads(out.splitlines()[-1])
    dead = Delivery.objects.filter(status=Status.DEAD)
    assert dead.exists()
    assert set(dead.values_list("subscriber__name", "queue__name", "event__name")) == {
        ("monitor", "network", "error")
    }
    assert all(d.attempt == 3 and "malformed" in d.last_error for d in dead)
    assert summary["nacked"] == 3 * dead.count()
    assert not Delivery.objects.filter(status__in=(Status.PENDING, Status.INFLIGHT)).exists()


def test_the_demo_says_what_is_missing_without_the_seeds(db, var_dir):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="bootstrap"):
        run("demo", "--count", "1")
