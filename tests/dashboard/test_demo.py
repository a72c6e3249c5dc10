"""The demo a newcomer's first `make run` brings: the seeds (made by bootstrap, once, on a fresh
install) and `manage.py demo`, which publishes and acks so that counters move: beside a running
server as its real clients, and without one through the ledger."""

import json
import stat
import threading
import time

import pytest
from django.db import connection

from dashboard import demo
from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.models import Connection, Subscriber, Subscription
from subscribers.tokens import hash_token
from tests.support.commands import command_output
from tests.support.servers import free_port, start_daphne


def run_without_server(*args):
    """The demo where no server answers (a port nothing listens on): it says so, and serves its
    subscribers through the ledger."""
    out = command_output("demo", "--url", f"http://127.0.0.1:{free_port()}", "--server-wait", "0", *args)
    assert "nothing answers at" in out and "through the ledger" in out, out
    return out


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
    first = command_output("bootstrap")
    world = seeded()
    again = command_output("bootstrap")

    assert world["queues"] == {"db": 10, "filesystem": 10, "network": 3}
    assert world["subscriptions"] == [
        ("dashboard", "db", "create"),
        ("logger", "db", None),
        ("logger", "filesystem", None),
        ("monitor", "db", "create"),
        ("monitor", "network", "error"),
    ]
    assert seeded() == world  # idempotent: nothing new, no token issued again
    assert first.splitlines()[1:] == again.splitlines()[1:]  # but the password, shown once
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
    out = command_output("bootstrap")
    assert list(Queue.objects.values_list("name", flat=True)) == ["mine"]
    assert not Subscriber.objects.exists()
    assert "demo:" not in out
    assert "http://127.0.0.1:8123/" in out


def test_bootstrap_may_be_told_not_to_seed(db, var_dir):
    command_output("bootstrap", "--no-demo")
    assert not Queue.objects.exists()


def test_without_a_server_the_demo_publishes_a_bounded_number_and_acks_them_itself(db, var_dir):
    command_output("bootstrap")

    out = run_without_server("--count", "24", "--rate", "200", "--poison-every", "0", "--seed", "7")

    summary = json.loads(out.splitlines()[-1])
    assert Message.objects.count() == summary["published"] == 24
    assert summary["via"] == {"dashboard": "ledger", "logger": "ledger", "monitor": "ledger"}
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
    command_output("bootstrap")

    out = run_without_server("--count", "40", "--rate", "400", "--poison-every", "2", "--seed", "3")

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
        command_output("demo", "--count", "1")


@pytest.fixture
def daphne(transactional_db):
    # Retries within the test's time, so that a refused report dies in seconds.
    server = start_daphne({"MQ_BACKOFF_BASE_SECS": "0.05", "MQ_BACKOFF_MAX_SECS": "0.1"})
    yield server
    server.stop()


def test_beside_a_running_server_the_demo_subscribers_are_its_connected_clients(
    var_dir, daphne, monkeypatch, admin_client
):
    # Given a fresh install served by a real server, and subscribers that work quickly
    monkeypatch.setattr(demo, "WORK_SECS", {name: (0.05, 0.2) for name in demo.SUBSCRIBERS})
    command_output("bootstrap")
    dashboard = Subscriber.objects.get(name="dashboard")
    seen = {"connected": set(), "listed": set(), "dashboard acked while connected": False}
    done = threading.Event()

    def watch():  # what an operator sees while the demo runs
        try:
            while not done.is_set():
                connected = set(Connection.objects.values_list("subscriber__name", flat=True))
                seen["connected"] |= connected
                listed = admin_client.get("/api/connections").json()["connections"]
                seen["listed"] |= {c["subscriber"] for c in listed}
                if (
                    "dashboard" in connected
                    and Delivery.objects.filter(subscriber=dashboard, status=Status.ACKED).exists()
                ):
                    seen["dashboard acked while connected"] = True
                time.sleep(0.1)
        finally:
            connection.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    # When the demo runs against it
    try:
        out = command_output(
            "demo",
            *("--url", daphne.http, "--server-wait", "0", "--count", "60", "--rate", "30"),
            *("--poison-every", "3", "--seed", "3"),  # three malformed reports
        )
    finally:
        done.set()
        watcher.join()

    # Then the dashboard and the monitor were on websockets (presence and the API saw them),
    # the logger pulled, and every message went through the server.
    summary = json.loads(out.splitlines()[-1])
    assert summary["via"] == {"dashboard": "websocket", "logger": "pull", "monitor": "websocket"}, out
    assert seen["connected"] == seen["listed"] == {"dashboard", "monitor"}
    assert seen["dashboard acked while connected"]
    assert summary["published"] == Message.objects.count() == 60
    # Published over REST, by demo subscribers that may publish there.
    assert set(Message.objects.values_list("publisher__name", flat=True)) <= set(demo.SUBSCRIBERS)
    # Everything was settled through the server: acked, or, for refused reports, dead.
    assert not Delivery.objects.filter(status__in=(Status.PENDING, Status.INFLIGHT)).exists()
    acked = Delivery.objects.filter(status=Status.ACKED)
    assert summary["acked"] == acked.count() > 0
    assert {"dashboard", "logger", "monitor"} == set(acked.values_list("subscriber__name", flat=True))
    dead = Delivery.objects.filter(status=Status.DEAD)
    assert set(dead.values_list("subscriber__name", "queue__name", "event__name")) == {
        ("monitor", "network", "error")
    }
    assert all(d.attempt == 3 and "nacked by the client: monitor: malformed" in d.last_error for d in dead)
    assert summary["nacked"] == 3 * dead.count()
    # And the sockets closed with the demo: nobody shows as connected any more.
    deadline = time.monotonic() + 10
    while Connection.objects.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Connection.objects.exists()
