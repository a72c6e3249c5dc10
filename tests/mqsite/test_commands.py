"""The manage.py commands of the contract (docs/commands.md and each command's --help)."""

import json
import os
import queue as threadqueue
import signal
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import CommandError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIRequestFactory

from delivery import ledger, publishing, subscribing, wakeups
from delivery.models import Delivery, Status
from delivery.reports import queue_stats
from queues.models import Event, Message, Queue
from subscribers.auth import BearerTokenAuthentication, subscriber_for_token
from subscribers.models import Subscriber, Subscription
from tests.support import servers
from tests.support.commands import command_output, listen
from tests.support.fields import DELIVERY_FIELDS, PUBLISHED_FIELDS

STATS_FIELDS = ["queue", "event", "published", "pending", "inflight", "acked", "dead", "connected"]


def publish_event(queue, event, payload=None):
    return publishing.publish(queue, [publishing.prepare(event, payload)])[0][0]


def parse_time(text):
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text[:-1] + "+00:00")


# --- createqueue --------------------------------------------------------------------------------


def test_it_creates_a_queue_with_the_given_settings(db):
    out = command_output(
        "createqueue",
        "Audit",
        "--ordered",
        "--max-attempts",
        "3",
        "--ack-timeout",
        "5",
        "--retention-days",
        "2",
    )

    q = Queue.objects.get()
    assert (q.name, q.ordered, q.max_attempts, q.ack_timeout, q.retention_days) == ("audit", True, 3, 5, 2)
    assert out.startswith("created queue audit")


def test_it_creates_a_queue_with_the_contract_defaults(db):
    command_output("createqueue", "db")

    q = Queue.objects.get(name="db")
    assert (q.ordered, q.max_attempts, q.ack_timeout, q.retention_days) == (False, 10, 30, 7)


def test_it_updates_only_the_settings_given_and_is_idempotent(db):
    command_output("createqueue", "audit", "--ordered", "--max-attempts", "3")
    publish_event(Queue.objects.get(name="audit"), "create", {"a": 1})

    out = command_output("createqueue", "AUDIT", "--ack-timeout", "9")
    again = command_output("createqueue", "audit", "--ack-timeout", "9")

    q = Queue.objects.get()
    assert (q.ordered, q.max_attempts, q.ack_timeout, q.retention_days) == (True, 3, 9, 7)
    assert q.last_seq == 1  # the publishers' counter is never written back
    assert out.startswith("updated queue audit")
    assert again.startswith("unchanged: queue audit")
    command_output("createqueue", "audit", "--no-ordered")
    assert not Queue.objects.get().ordered


@pytest.mark.parametrize("name", ["Bad Name!", "_leading", "x" * 65, ""])
def test_it_refuses_a_bad_queue_name(db, name):
    with pytest.raises(CommandError, match="is not valid"):
        command_output("createqueue", name)
    assert not Queue.objects.exists()


def test_it_refuses_a_bad_setting_and_changes_nothing(make_queue):
    make_queue("db", max_attempts=4)

    with pytest.raises(CommandError, match="max-attempts"):
        command_output("createqueue", "db", "--max-attempts", "0", "--ack-timeout", "5")

    q = Queue.objects.get()
    assert (q.max_attempts, q.ack_timeout) == (4, 30)


# --- createsubscriber ---------------------------------------------------------------------------


def test_it_makes_a_subscriber_with_repeated_flags_and_star(make_queue):
    for name in ("db", "fs", "net"):
        make_queue(name)

    out = command_output(
        "createsubscriber", "monitor", "--publish", "db", "--publish", "FS", "net", "--subscribe", "*"
    )

    s = Subscriber.objects.get(name="monitor")
    assert set(s.publish_queues.values_list("name", flat=True)) == {"db", "fs", "net"}
    assert not s.publish_all
    assert s.subscribe_all and not s.subscribe_queues.exists()
    lines = out.splitlines()
    assert subscriber_for_token(lines[-1]) == s
    assert not any(line.startswith("webhook secret:") for line in lines)


def test_it_makes_a_subscriber_that_may_use_nothing_without_flags(db):
    out = command_output("createsubscriber", "idle")

    s = Subscriber.objects.get(name="idle")
    assert not (s.publish_all or s.subscribe_all or s.publish_queues.exists() or s.subscribe_queues.exists())
    assert subscriber_for_token(out.splitlines()[-1]) == s


def test_it_prints_the_webhook_secret_and_then_the_token(db_queue):
    out = command_output(
        "createsubscriber", "hooked", "--subscribe", "db", "--webhook", "https://example.com/hook"
    )

    s = Subscriber.objects.get(name="hooked")
    lines = out.splitlines()
    assert s.webhook_url == "https://example.com/hook"
    assert f"webhook secret: {s.webhook_secret}" in lines
    assert s.webhook_secret.startswith("whsec_")
    assert subscriber_for_token(lines[-1]) == s


def test_it_refuses_an_unknown_queue_and_makes_nothing(db_queue):
    with pytest.raises(CommandError, match="nope"):
        command_output("createsubscriber", "app", "--publish", "db", "--subscribe", "nope")
    assert not Subscriber.objects.exists()


def test_run_again_it_sets_the_subscriber_as_asked_with_a_new_token(logger, db_queue, make_queue):
    make_queue("net")
    subscribing.subscribe(logger, db_queue)
    old_token = command_output("createsubscriber", "logger", "--publish", "net").splitlines()[-1]
    secret = Subscriber.objects.get(name="logger").webhook_secret

    out = command_output(
        "createsubscriber", "logger", "--subscribe", "db", "net", "--webhook", "https://example.com/h"
    )

    s = Subscriber.objects.get(name="logger")
    assert Subscriber.objects.filter(name="logger").count() == 1
    assert "updated subscriber logger" in out
    assert set(s.subscribe_queues.values_list("name", flat=True)) == {"db", "net"}
    assert not s.publish_queues.exists()  # as the command says, not added to what it had
    assert s.webhook_url == "https://example.com/h"
    # Its first webhook: a secret never shown before (not the one made with the row), shown now.
    assert s.webhook_secret != secret and f"webhook secret: {s.webhook_secret}" in out.splitlines()
    assert Subscription.objects.filter(subscriber=s).count() == 1  # its subscriptions stay
    assert subscriber_for_token(out.splitlines()[-1]) == s
    assert subscriber_for_token(old_token) is None


def test_run_again_it_keeps_the_webhook_secret_and_prints_it_as_the_api_says(db_queue):
    command_output("createsubscriber", "hooked", "--subscribe", "db", "--webhook", "https://example.com/hook")
    secret = Subscriber.objects.get(name="hooked").webhook_secret

    out = command_output(
        "createsubscriber", "hooked", "--subscribe", "db", "--webhook", "https://example.com/hook2"
    )

    assert Subscriber.objects.get(name="hooked").webhook_secret == secret
    assert f"webhook secret: {secret}" in out.splitlines()
    # Without --webhook it says nothing of it.
    out = command_output("createsubscriber", "hooked", "--subscribe", "db")
    assert secret not in out


def test_rotatewebhooksecret_prints_a_new_secret_once_and_keeps_the_old_for_the_grace(db_queue, settings):
    settings.MQ_WEBHOOK_SECRET_GRACE_SECS = 3600
    command_output("createsubscriber", "hooked", "--subscribe", "db", "--webhook", "https://example.com/hook")
    old = Subscriber.objects.get(name="hooked").webhook_secret

    out = command_output("rotatewebhooksecret", "hooked").splitlines()

    s = Subscriber.objects.get(name="hooked")
    assert out[-1] == s.webhook_secret != old and s.webhook_secret.startswith("whsec_")
    assert "also signs posts until" in out[0] and "(3600 s)" in out[0]
    assert s.webhook_secrets(timezone.now()) == [s.webhook_secret, old]
    assert s.webhook_secrets(timezone.now() + timedelta(seconds=3601)) == [s.webhook_secret]

    command_output("rotatewebhooksecret", "hooked", "--grace-secs", "0")
    s.refresh_from_db()
    assert s.webhook_secrets(timezone.now()) == [s.webhook_secret] and s.previous_webhook_secret == ""
    with pytest.raises(CommandError, match="no subscriber named 'nobody'"):
        command_output("rotatewebhooksecret", "nobody")


def test_it_refuses_a_malformed_webhook_url(db):
    with pytest.raises(CommandError, match="webhook_url"):
        command_output("createsubscriber", "app", "--webhook", "not a url")
    assert not Subscriber.objects.exists()


def database_url():
    """The test database, as a DATABASE_URL for a manage.py run in a child process."""
    return servers.test_database_url()


def manage(*args, **kw):
    env = {**os.environ, "DATABASE_URL": database_url()}
    return [sys.executable, "manage.py", *args], {"cwd": settings.BASE_DIR, "env": env, **kw}


def test_it_prints_a_working_token_alone_on_the_last_line_of_a_real_run(transactional_db, make_queue):
    db = make_queue("db")

    argv, kw = manage(
        "createsubscriber", "cli-app", "--subscribe", "db", "--webhook", "https://example.com/h"
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, **kw)

    assert done.returncode == 0, done.stderr
    last = done.stdout.splitlines()[-1]
    assert done.stdout.endswith(last + "\n") and last == last.strip() and " " not in last
    # The bearer token authenticates as the new subscriber, who then pulls from the ledger.
    request = APIRequestFactory().get("/api/deliveries", HTTP_AUTHORIZATION=f"Bearer {last}")
    _user, subscriber = BearerTokenAuthentication().authenticate(request)
    assert subscriber.name == "cli-app"
    subscribing.subscribe(subscriber, db)
    sent = publish_event(db, "create", {"hello": "cli"})
    leased = ledger.lease_deliveries(subscriber, limit=10)
    assert [(d["message_id"], d["payload"]) for d in leased] == [(sent["id"], {"hello": "cli"})]
    assert ledger.ack_deliveries(subscriber, [leased[0]["id"]]) == (1, [])


# --- publish ------------------------------------------------------------------------------------


@pytest.fixture
def subscribed_pair(logger, peer, db_queue):
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue, "create")
    return logger, peer


def test_it_publishes_as_an_operator_and_prints_the_rest_answer(subscribed_pair):
    out = command_output("publish", "DB", "create", '{"a": [1, 2], "b": "é"}')

    answer = json.loads(out)
    assert set(answer) == PUBLISHED_FIELDS
    m = Message.objects.get()
    assert answer["id"] == m.pk and answer["seq"] == m.seq == 1
    assert (answer["queue"], answer["event"]) == ("db", "create")
    assert answer["deliveries"] == 2 == Delivery.objects.filter(message=m, status=Status.PENDING).count()
    assert parse_time(answer["created_at"]) == m.created_at
    assert m.publisher is None
    assert json.loads(m.payload_json) == {"a": [1, 2], "b": "é"}
    assert len(out.splitlines()) == 1


def test_it_fans_out_only_to_matching_subscriptions(subscribed_pair):
    answer = json.loads(command_output("publish", "db", "delete", "1"))

    assert answer["deliveries"] == 1
    assert list(Delivery.objects.values_list("subscriber__name", flat=True)) == ["logger"]


def test_it_reads_the_payload_from_stdin_when_absent(subscribed_pair):
    answer = json.loads(command_output("publish", "db", "create", stdin='[1, "two", null]\n'))
    null = json.loads(command_output("publish", "db", "create", stdin="null"))

    assert (answer["seq"], null["seq"]) == (1, 2)
    payloads = [json.loads(p) for p in Message.objects.order_by("seq").values_list("payload_json", flat=True)]
    assert payloads == [[1, "two", None], None]


def test_it_keeps_an_idempotency_key(subscribed_pair):
    first = json.loads(command_output("publish", "db", "create", "{}", "--key", "k1"))
    again = json.loads(command_output("publish", "db", "create", "{}", "--key", "k1"))

    assert again == first
    assert Message.objects.count() == 1 and Delivery.objects.count() == 2


@pytest.mark.parametrize(
    "args, stdin, error",
    [
        (("db", "create", "{not json"), None, "not JSON"),
        (("db", "create"), "", "not JSON"),
        (("db", "create", "NaN"), None, "not JSON"),
        (("nope", "create", "{}"), None, "no queue named 'nope'"),
        (("db", "Bad Event", "{}"), None, "is not valid"),
    ],
)
def test_it_refuses_bad_input_and_publishes_nothing(db_queue, args, stdin, error):
    with pytest.raises(CommandError, match=error):
        command_output("publish", *args, stdin=stdin)
    assert not Message.objects.exists()


# --- listen -------------------------------------------------------------------------------------


def test_it_catches_up_oldest_first_and_acks_each(logger, db_queue):
    subscribing.subscribe(logger, db_queue)
    sent = [
        publish_event(db_queue, event, {"n": i})
        for i, event in enumerate(["create", "delete", "create", "x"])
    ]

    got = listen("logger", "db", "--count", "3")

    assert [d["seq"] for d in got] == [1, 2, 3]
    assert [d["message_id"] for d in got] == [s["id"] for s in sent[:3]]
    assert [d["payload"] for d in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert all(set(d) == DELIVERY_FIELDS and d["attempt"] == 1 for d in got)
    assert parse_time(got[0]["published_at"]) < parse_time(got[0]["ack_deadline"])
    statuses = dict(Delivery.objects.values_list("seq", "status"))
    assert statuses == {1: Status.ACKED, 2: Status.ACKED, 3: Status.ACKED, 4: Status.PENDING}


def test_it_leaves_deliveries_in_flight_with_no_ack(logger, db_queue):
    subscribing.subscribe(logger, db_queue)
    for i in range(3):
        publish_event(db_queue, "create", i)

    got = listen("logger", "db", "--count", "2", "--no-ack")

    assert [d["seq"] for d in got] == [1, 2]
    rows = Delivery.objects.order_by("seq").values_list("status", "attempt", "ack_deadline")
    assert [(s, a) for s, a, _ in rows] == [(Status.INFLIGHT, 1), (Status.INFLIGHT, 1), (Status.PENDING, 0)]
    assert all(deadline is not None for _, _, deadline in rows[:2])


def test_it_walks_an_ordered_queue_by_acking(logger, make_queue):
    audit = make_queue("audit", ordered=True)
    logger.subscribe_queues.add(audit)  # without the right it is owed nothing
    subscribing.subscribe(logger, audit)
    for i in range(3):
        publish_event(audit, "create", i)

    # An ordered subscription hands out its head only: the third comes only if the acks work.
    got = listen("logger", "audit", "--count", "3")

    assert [d["payload"] for d in got] == [0, 1, 2]
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


def test_it_subscribes_first_and_waits_for_what_comes(logger, db_queue, monkeypatch):
    waits = []

    def publish_while_waiting(subscriber_id, since, timeout):
        waits.append(timeout)
        if len(waits) == 2:
            publish_event(db_queue, "delete", "not this event")
            publish_event(db_queue, "create", "this one")
        return False

    monkeypatch.setattr(wakeups, "wait", publish_while_waiting)

    got = listen("logger", "db", "CREATE", "--count", "1")

    assert [(d["event"], d["payload"]) for d in got] == [("create", "this one")]
    sub = Subscription.objects.get(subscriber=logger)
    assert (sub.queue, sub.event.name) == (db_queue, "create")
    assert len(waits) >= 2 and all(0 < t <= 0.2 for t in waits)
    assert Delivery.objects.get().status == Status.ACKED


def test_it_reuses_a_subscription_to_every_event(logger, db_queue):
    subscribing.subscribe(logger, db_queue)
    publish_event(db_queue, "delete", 1)
    publish_event(db_queue, "create", 2)

    got = listen("logger", "db", "create", "--count", "1")

    assert [d["payload"] for d in got] == [2]
    assert Subscription.objects.filter(subscriber=logger).count() == 1  # no second copy of each message
    assert dict(Delivery.objects.values_list("seq", "status")) == {1: Status.PENDING, 2: Status.ACKED}


@pytest.mark.django_db(transaction=True)
def test_it_reuses_a_subscription_to_every_event_for_an_event_never_published(logger, db_queue):
    subscribing.subscribe(logger, db_queue)

    def publish_later():
        time.sleep(0.5)  # listen is waiting by then, the event still unknown to the queue
        try:
            publish_event(db_queue, "brandnew", 1)
        finally:
            connection.close()

    publisher = threading.Thread(target=publish_later)
    publisher.start()
    got = listen("logger", "db", "brandnew", "--count", "1")
    publisher.join()

    assert [d["payload"] for d in got] == [1]
    assert Subscription.objects.filter(subscriber=logger).count() == 1  # no second copy of each message
    assert Delivery.objects.filter(subscriber=logger).count() == 1


def test_it_never_shows_another_subscribers_deliveries(logger, peer, db_queue):
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    publish_event(db_queue, "create", 1)

    got = listen("logger", "db", "--count", "1")

    mine = Delivery.objects.get(subscriber=logger)
    assert [d["id"] for d in got] == [mine.pk]
    assert mine.status == Status.ACKED
    assert Delivery.objects.get(subscriber=peer).status == Status.PENDING


@pytest.mark.parametrize(
    "args, error",
    [
        (("nobody", "db"), "no subscriber named 'nobody'"),
        (("logger", "nope"), "no queue named 'nope'"),
        (("logger", "db", "Bad Event"), "is not valid"),
        (("outsider", "db"), "outsider may not subscribe to db"),
        (("logger", "db", "--count", "0"), "at least 1"),
    ],
)
def test_it_refuses_what_it_cannot_listen_to(logger, outsider, db_queue, args, error):
    with pytest.raises(CommandError, match=error):
        command_output("listen", *args)
    assert not Subscription.objects.exists()


def test_it_listens_live_across_processes_and_stops_cleanly_on_sigterm(
    transactional_db, make_queue, make_subscriber
):
    db = make_queue("db")
    logger = make_subscriber("logger", publish=(), subscribe=("db",))
    argv, kw = manage("listen", "logger", "db", "create")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    lines = threadqueue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while not Subscription.objects.filter(subscriber=logger, event__name="create").exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "listen did not subscribe"
            time.sleep(0.05)
        publish_event(db, "delete", "skipped")
        sent = publish_event(db, "create", {"live": True})

        got = json.loads(lines.get(timeout=30))

        assert (got["message_id"], got["payload"]) == (sent["id"], {"live": True})
        while Delivery.objects.get(pk=got["id"]).status != Status.ACKED:
            assert time.monotonic() < deadline, "the printed delivery was not acked"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- queuestats ---------------------------------------------------------------------------------


@pytest.fixture
def busy(logger, peer, make_queue, make_subscriber):
    """db: logger on every event, peer on create; fs: an event subscribed to, nothing published;
    net: no event at all."""
    db = Queue.objects.get(name="db")
    fs, _net = make_queue("fs"), make_queue("net")
    subscribing.subscribe(logger, db)
    subscribing.subscribe(peer, db, "create")
    subscribing.subscribe(make_subscriber("watcher"), fs, "change")
    for event in ("create", "create", "delete"):
        publish_event(db, event)
    leased = ledger.lease_deliveries(logger, limit=2)  # seq 1, 2 in flight
    ledger.ack_deliveries(logger, [leased[0]["id"]])  # seq 1 acked
    ledger.kill_deliveries(Delivery.objects.filter(subscriber=peer, seq=2))
    return db


def expected_stats():
    """The same numbers, counted one by one, not by the service's aggregate."""
    rows = []
    for e in Event.objects.order_by("queue__name", "name"):
        ds = Delivery.objects.filter(event=e)
        rows.append(
            {
                "queue": e.queue.name,
                "event": e.name,
                "published": Message.objects.filter(event=e).count(),
                **{s: ds.filter(status=s).count() for s in ("pending", "inflight", "acked", "dead")},
                "connected": 0,
            }
        )
    rows.append({"queue": "net", "event": None, **dict.fromkeys(STATS_FIELDS[2:], 0)})
    return sorted(rows, key=lambda r: (r["queue"], r["event"] or ""))


def test_it_counts_per_queue_and_event_as_the_database_says(busy):
    stats = queue_stats()

    assert stats == expected_stats()
    by_key = {(r["queue"], r["event"]): r for r in stats}
    assert by_key["db", "create"] == {
        "queue": "db", "event": "create", "published": 2,
        "pending": 1, "inflight": 1, "acked": 1, "dead": 1, "connected": 0,
    }  # fmt: skip
    assert by_key["db", "delete"]["pending"] == 1
    assert by_key["db", "delete"]["inflight"] == 0
    assert by_key["fs", "change"] == {"queue": "fs", "event": "change", **dict.fromkeys(STATS_FIELDS[2:], 0)}


def test_it_counts_from_the_kept_counts_without_reading_the_big_tables(busy):
    """Exact (the test above) and in proportion to queues and events: neither the delivery
    table nor the message table is read, however many rows they hold."""
    with CaptureQueriesContext(connection) as ctx:
        queue_stats()

    sql = [q["sql"] for q in ctx.captured_queries]
    assert not [q for q in sql if "delivery_delivery" in q or "queues_message" in q]
    assert len(sql) <= 5


def test_it_prints_the_stats_as_json(busy):
    out = command_output("queuestats", "--json")

    data = json.loads(out)
    assert list(data) == ["queues"]
    assert all(list(row) == STATS_FIELDS for row in data["queues"])
    assert data["queues"] == expected_stats()


def test_it_prints_the_stats_as_a_table(busy):
    lines = command_output("queuestats").splitlines()

    assert lines[0].split() == STATS_FIELDS
    rows = [line.split() for line in lines[1:]]
    expected = [
        [r["queue"], r["event"] or "-", *(str(r[f]) for f in STATS_FIELDS[2:])] for r in expected_stats()
    ]
    assert rows == expected


def test_it_says_when_there_are_no_queues(db):
    assert command_output("queuestats").strip() == "no queues"
    assert json.loads(command_output("queuestats", "--json")) == {"queues": []}


# --- redeliver ----------------------------------------------------------------------------------


@pytest.fixture
def settled(logger, peer, make_queue):
    """A queue with one attempt: logger's seq 1 acked, 2 dead, 3 in flight, 4 pending;
    peer's 1-4 all dead."""
    q = make_queue("jobs", max_attempts=1)
    logger.subscribe_queues.add(q)  # without the right they are owed nothing
    peer.subscribe_queues.add(q)
    subscribing.subscribe(logger, q)
    subscribing.subscribe(peer, q)
    for i in range(4):
        publish_event(q, "run", i)
    leased = ledger.lease_deliveries(logger, limit=3)
    ledger.ack_deliveries(logger, [leased[0]["id"]])
    ledger.nack_delivery(logger, leased[1]["id"])  # its last attempt: dead
    ledger.kill_deliveries(Delivery.objects.filter(subscriber=peer))
    return q


def states(subscriber):
    return dict(Delivery.objects.filter(subscriber=subscriber).values_list("seq", "status"))


def test_it_redelivers_only_dead_ones_with_dead(settled, logger, peer):
    out = command_output("redeliver", "--dead", "--subscriber", "logger")

    assert json.loads(out) == {"redelivered": 1}
    assert states(logger) == {1: Status.ACKED, 2: Status.PENDING, 3: Status.INFLIGHT, 4: Status.PENDING}
    assert Delivery.objects.get(subscriber=logger, seq=2).attempt == 0
    assert set(states(peer).values()) == {Status.DEAD}


def test_it_redelivers_everything_not_acked_by_default(settled, logger, peer):
    out = command_output("redeliver", "--queue", "JOBS")

    assert json.loads(out) == {"redelivered": 7}
    assert states(logger) == {1: Status.ACKED, 2: Status.PENDING, 3: Status.PENDING, 4: Status.PENDING}
    assert set(states(peer).values()) == {Status.PENDING}
    assert not Delivery.objects.filter(status=Status.PENDING).exclude(attempt=0).exists()


def test_it_redelivers_nothing_of_another_queue(settled, db_queue):
    assert json.loads(command_output("redeliver", "--queue", "db")) == {"redelivered": 0}
    assert Delivery.objects.filter(status=Status.DEAD).count() == 5


@pytest.mark.parametrize(
    "args, error",
    [
        (("--queue", "nope"), "no queue named 'nope'"),
        (("--subscriber", "nobody"), "no subscriber named 'nobody'"),
    ],
)
def test_it_refuses_unknown_names(settled, args, error):
    with pytest.raises(CommandError, match=error):
        command_output("redeliver", *args)
    assert Delivery.objects.filter(status=Status.DEAD).count() == 5


# --- bootstrap ----------------------------------------------------------------------------------


def test_it_makes_the_first_operator_once_and_prints_the_password_only_then(db, var_dir):
    first = command_output("bootstrap").splitlines()
    again = command_output("bootstrap").splitlines()

    admin = get_user_model().objects.get()
    assert admin.username == "admin" and admin.is_superuser and admin.is_staff
    path = var_dir / "operator_password"
    password = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert admin.check_password(password) and len(password) >= 16
    assert first[0].startswith(f"operator login: admin / {password} ")
    # Start-up logs are kept and shared: later starts say where it is, never what it is.
    assert again[0] == f"operator login: admin, password in {path}"
    assert password not in "\n".join(again)
    for url in (
        "http://127.0.0.1:8123/admin/",
        "http://127.0.0.1:8123/api/docs/",
        "http://127.0.0.1:8123/healthz",
    ):
        assert any(line.endswith(url) for line in first)
    assert first[1:] == again[1:]


def test_it_leaves_an_existing_operator_alone(operator, var_dir):
    out = command_output("bootstrap")

    assert list(get_user_model().objects.values_list("username", flat=True)) == ["op"]
    assert not (var_dir / "operator_password").exists()
    assert "/ " not in out.splitlines()[0]
    assert "http://127.0.0.1:8123/admin/" in out


def test_it_does_not_repeat_a_password_changed_since(db, var_dir):
    command_output("bootstrap")
    admin = get_user_model().objects.get()
    admin.set_password("changed-by-the-operator")
    admin.save()

    out = command_output("bootstrap")

    assert (var_dir / "operator_password").read_text().strip() not in out
    assert get_user_model().objects.count() == 1
