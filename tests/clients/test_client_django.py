"""mqclient.django (clients/python/mqclient/django) in a Django project of its own
(tests/support/mqshop, on a SQLite file of the test's), beside a real Daphne on the test
database: a message is published if and only if the transaction that wrote it commits, once
each, in order, through relays SIGKILLed mid-batch; and the webhook view runs a delivery's
handler once however often the server posts it, and refuses what the server did not sign."""

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import urllib.request
import uuid

import psycopg
import pytest
from django.db import connection
from mqclient import Client

from delivery import subscribing, webhooks
from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.models import Subscription
from subscribers.provisioning import create_subscriber
from tests.support.servers import ROOT, eventually, free_port, start_daphne, start_redis, start_worker

SHOP = ROOT / "tests" / "support" / "mqshop"
# The project's interpreter: the suite's own, or MQ_TEST_DJANGO_PYTHON, a virtualenv's with
# another Django (4.2 LTS: `pip install "Django<5" "./clients/python[django]" opentelemetry-sdk
# psycopg[binary]`), to run these tests against it.
PYTHON = os.environ.get("MQ_TEST_DJANGO_PYTHON", sys.executable)

# The project's behaviour does not depend on the server's database: the SQLite pass runs these
# (the project's own database is SQLite in both).
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="the Django project, whatever the server's database: the SQLite pass of make test runs it",
    ),
]


class Shop:
    """The project: its environment, its database (a SQLite file, or `pg_name` on the machine's
    PostgreSQL), and ways to run it."""

    def __init__(self, tmp_path, url, token, secret="whsec_" + "c2VjcmV0LW9mLXRoZS1zaG9w", pg_name=None):
        self.db = tmp_path / "shop.sqlite3"
        self.pg_name = pg_name
        self.secret = secret
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "clients" / "python"), str(SHOP)]),
            "DJANGO_SETTINGS_MODULE": "mqshop.settings",
            "SHOP_DB": str(self.db),
            "MQ_URL": url,
            "MQ_TOKEN": token,
            "MQ_WEBHOOK_SECRET": secret,
            **({"SHOP_PG": pg_name} if pg_name else {}),
        }
        self.env.pop("DATABASE_URL", None)
        self.env.pop("PYTEST_CURRENT_TEST", None)
        self.manage("migrate", "-v0")

    def manage(self, *args, **env):
        return subprocess.run(
            [PYTHON, "manage.py", *args],
            cwd=SHOP,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )

    def python(self, code, **env):
        """Run `code` in the project (django set up): its stdout."""
        script = "import django\ndjango.setup()\n" + textwrap.dedent(code)
        done = subprocess.run(
            [PYTHON, "-c", script],
            cwd=SHOP,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def rows(self, sql, *params):
        if self.pg_name:
            with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={self.pg_name}") as db:
                return db.execute(sql.replace("?", "%s"), params).fetchall()
        with sqlite3.connect(self.db) as db:
            return db.execute(sql, params).fetchall()

    def waiting(self):
        return self.rows("SELECT id, key FROM mqclient_outboxmessage WHERE status = 'waiting' ORDER BY id")


@pytest.fixture
def shop(tmp_path, server, logger):
    return Shop(tmp_path, server.http, logger.token)


@contextlib.contextmanager
def postgres_database():
    """A database of the project's own on the machine's PostgreSQL, dropped after."""
    name = f"mqshop_{uuid.uuid4().hex[:12]}"
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgresql"])
def any_shop(request, tmp_path, server, logger):
    """The project on SQLite (a file lock orders its relays) and on PostgreSQL (a row lock)."""
    if request.param == "sqlite":
        yield Shop(tmp_path, server.http, logger.token)
        return
    with postgres_database() as name:
        yield Shop(tmp_path, server.http, logger.token, pg_name=name)


def published():
    """(event, payload, key) of the db queue's messages on the server, in seq order."""
    return [
        (m.event.name, json.loads(m.payload_json), m.key)
        for m in Message.objects.filter(queue__name="db").select_related("event").order_by("seq")
    ]


# Orders made in a loop: every third transaction rolls back, after writing its order (a model
# event) and a publish() of its own.
MAKE_ORDERS = """
    import sys
    from django.db import transaction
    import mqclient.django
    from shop.models import Order

    for i in range({count}):
        try:
            with transaction.atomic():
                Order.objects.create(item=f"item-{{i}}")
                mqclient.django.publish("db", "paid", {{"i": i}})
                if i % 3 == 2:
                    raise RuntimeError("rolled back")
        except RuntimeError:
            pass
"""


def committed(count, pks=None):
    """What MAKE_ORDERS(count) publishes, in order; `pks`: each item's order pk (i + 1 if not
    named)."""
    out = []
    for i in range(count):
        if i % 3 != 2:
            item = f"item-{i}"
            pk = pks[item] if pks else i + 1
            out.append(("create", {"model": "shop.order", "pk": pk, "fields": {"item": item, "quantity": 1}}))
            out.append(("paid", {"i": i}))
    return out


def test_it_publishes_what_commits_once_right_after_the_commit_and_nothing_rolled_back(shop):
    # when the project commits and rolls back orders, then updates and deletes one, inside a
    # span of OpenTelemetry
    out = shop.python(
        MAKE_ORDERS.format(count=3)
        + """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    trace.set_tracer_provider(TracerProvider())
    with trace.get_tracer("shop").start_as_current_span("checkout") as span:
        order = Order.objects.get(pk=1)
        order.quantity = 2
        order.save()
        print(format(span.get_span_context().trace_id, "032x"))
    Order.objects.get(pk=2).delete()
    # and exits at once: its relay thread sends after each commit, and the exit waits for it
    # (no mqrelay runs in this test)
    """
    )
    trace_id = out.split()[-1]
    # then the server has each committed message once, in order, and none of the rolled-back one
    messages = published()
    assert [(event, payload) for event, payload, _ in messages] == committed(3) + [
        ("update", {"model": "shop.order", "pk": 1, "fields": {"item": "item-0", "quantity": 2}}),
        ("delete", {"model": "shop.order", "pk": 2, "fields": {"item": "item-1", "quantity": 1}}),
    ]
    keys = [key for _, _, key in messages]
    assert len(set(keys)) == len(keys) and all(key.startswith("outbox-") for key in keys)
    # the update carries the trace it was made in
    update = Message.objects.get(queue__name="db", event__name="update")
    assert json.loads(update.headers_json)["traceparent"].split("-")[1] == trace_id
    # and the outbox marks each row sent with the server's message id
    rows = shop.rows("SELECT status, message_id FROM mqclient_outboxmessage ORDER BY id")
    ids = list(Message.objects.filter(queue__name="db").order_by("seq").values_list("id", flat=True))
    assert rows == [("sent", message_id) for message_id in ids]


def test_it_publishes_each_committed_row_once_through_relays_killed_mid_batch(any_shop):
    shop = any_shop
    # given 30 orders written with no relay thread (as by processes that died after commit)
    count = 30
    shop.python(MAKE_ORDERS.format(count=count), SHOP_RELAY_ON_COMMIT="0")
    assert len(shop.waiting()) == 2 * 20
    assert published() == []
    # when relays (batches of 4) are SIGKILLed the moment the server has confirmed a batch,
    # before they mark it sent
    rng = random.Random(31)
    killed_between = 0
    for _ in range(3):
        relay = subprocess.Popen(
            [PYTHON, "manage.py", "mqrelay"],
            cwd=SHOP,
            env={**shop.env, "SHOP_RELAY_BATCH": "4", "SHOP_LOG_LEVEL": "DEBUG", "SHOP_RELAY_ON_COMMIT": "0"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        batches = rng.randint(1, 2)
        for line in relay.stderr:
            if "marking them sent" in line:
                batches -= 1
                if batches == 0:
                    relay.send_signal(signal.SIGKILL)
                    break
        relay.wait(10)
        relay.stderr.close()
        # a row the server has but the outbox still holds: the window the key makes harmless
        waiting_keys = {f"outbox-{uuid.UUID(str(key))}" for _, key in shop.waiting()}
        killed_between += Message.objects.filter(key__in=waiting_keys).exists()
    # and two relays then finish the rest at once
    env = {**shop.env, "SHOP_RELAY_BATCH": "4", "SHOP_RELAY_ON_COMMIT": "0"}
    relays = [
        subprocess.Popen(
            [PYTHON, "manage.py", "mqrelay"], cwd=SHOP, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        # each says it is running (its SIGTERM handler set) before it looks at the outbox
        assert all("relaying the outbox" in relay.stdout.readline() for relay in relays)
        assert eventually(lambda: not shop.waiting(), timeout=30)
    finally:
        for relay in relays:
            relay.send_signal(signal.SIGTERM)
        for relay in relays:
            assert relay.wait(10) == 0
            relay.stdout.close()
    # then the server has every committed message once, in the order written
    messages = published()
    assert [(event, payload) for event, payload, _ in messages] == committed(
        count, dict(shop.rows("SELECT item, id FROM shop_order"))
    )
    assert len({key for _, _, key in messages}) == len(messages)
    # and at least one kill fell between the server's answer and the marking (else this test
    # proved nothing about that window)
    assert killed_between >= 1


def test_it_keeps_rows_while_the_server_is_away_and_refuses_a_bad_one_alone(shop):
    # given three rows, the middle one with an event name the server refuses
    shop.python(
        """
    import mqclient.django

    for event in ("paid", "not a name!", "shipped"):
        mqclient.django.publish("db", event, {"event": event})
    """,
        SHOP_RELAY_ON_COMMIT="0",
    )
    # when the relay cannot reach the server: it fails (for cron), says so at WARNING, and the
    # rows wait with the error
    away = subprocess.run(
        [PYTHON, "manage.py", "mqrelay", "--once"],
        cwd=SHOP,
        env={**shop.env, "MQ_URL": f"http://127.0.0.1:{free_port()}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert away.returncode == 1 and "not sent, will retry" in away.stderr
    rows = shop.rows("SELECT status, attempts, last_error FROM mqclient_outboxmessage ORDER BY id")
    assert [(status, attempts) for status, attempts, _ in rows] == [("waiting", 1)] * 3
    assert all("connection_error" in error for _, _, error in rows)
    assert published() == []
    # then, with the server back, the good rows are sent in order and the bad one is refused alone
    assert shop.manage("mqrelay", "--once").stdout.strip() == "sent 2, refused 1"
    assert [(event, payload) for event, payload, _ in published()] == [
        ("paid", {"event": "paid"}),
        ("shipped", {"event": "shipped"}),
    ]
    rows = shop.rows("SELECT event, status, last_error FROM mqclient_outboxmessage ORDER BY id")
    assert [(event, status) for event, status, _ in rows] == [
        ("paid", "sent"),
        ("not a name!", "refused"),
        ("shipped", "sent"),
    ]
    assert rows[1][2].startswith("400 ")
    # and sent rows past their retention are deleted (the refused one is kept)
    shop.manage("mqrelay", "--once", SHOP_RETENTION_SECS="0")
    assert shop.rows("SELECT event FROM mqclient_outboxmessage") == [("not a name!",)]


@contextlib.contextmanager
def served(shop, port):
    """The project served over HTTP on `port` (Django's runserver), its webhook view at
    shop.url."""
    site = subprocess.Popen(
        [PYTHON, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=SHOP,
        env=shop.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up():
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=1)  # noqa: S310
            return True
        except OSError:
            return False

    try:
        assert eventually(up, timeout=20)
        shop.url = f"http://127.0.0.1:{port}/mq/webhook/"
        yield shop
    finally:
        site.terminate()
        site.wait(10)


@pytest.fixture
def shop_site(shop, settings):
    """The project served, for the server's webhook posts, which the test makes with the
    server's own code (delivery/webhooks.post) to loopback."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    with served(shop, free_port()) as site:
        yield site


def frame(delivery_id, payload):
    """The body the server posts (docs/webhooks.md: the websocket's message frame)."""
    return {
        "type": "message",
        "id": delivery_id,
        "message_id": delivery_id + 1000,
        "queue": "db",
        "event": "create",
        "seq": 1,
        "payload": payload,
        "attempt": 1,
        "published_at": "2026-11-28T12:00:00Z",
        "deliver_at": None,
        "expires_at": None,
        "group": None,
    }


def test_it_runs_a_webhook_handler_once_however_often_the_delivery_is_posted(shop_site):
    shop = shop_site
    shipments = "SELECT order_pk, delivery_id FROM shop_shipment ORDER BY id"
    # when the server posts a delivery, and posts it again (its answer was lost)
    first = webhooks.post(shop.url, shop.secret, frame(41, {"model": "shop.order", "pk": 7}))
    again = webhooks.post(shop.url, shop.secret, frame(41, {"model": "shop.order", "pk": 7}))
    # then both are acked and the handler ran once
    assert (first.ok, first.status, again.ok, again.status) == (True, 200, True, 200)
    assert shop.rows(shipments) == [(7, 41)]
    # a post signed with another secret is refused, and runs nothing
    forged = webhooks.post(shop.url, "whsec_" + "b3RoZXItc2VjcmV0", frame(42, {"pk": 8}))
    assert (forged.ok, forged.status) == (False, 401)
    # a handler that raises: 500, its transaction rolled back (no delivery recorded), so the
    # server's retry runs it again
    failing = webhooks.post(shop.url, shop.secret, frame(43, {"pk": 9, "fail": True}))
    assert (failing.ok, failing.status) == (False, 500)
    assert shop.rows(shipments) == [(7, 41)]
    assert shop.rows("SELECT id FROM mqclient_receiveddelivery ORDER BY id") == [(41,)]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_slow_handler_whose_answer_was_lost_runs_once_when_the_retry_comes_while_it_runs(
    database, tmp_path, server, logger, settings
):
    """The server stops waiting for a slow handler (its answer is lost), and posts again while
    that handler is still running: the second post waits for the first's transaction, finds the
    delivery recorded and is acked without running the handler a second time."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    with contextlib.ExitStack() as stack:
        pg_name = stack.enter_context(postgres_database()) if database == "postgresql" else None
        shop = stack.enter_context(
            served(Shop(tmp_path, server.http, logger.token, pg_name=pg_name), free_port())
        )
        slow = frame(51, {"model": "shop.order", "pk": 3, "sleep": 2})
        settings.MQ_WEBHOOK_TIMEOUT_SECS = 0.5
        lost = webhooks.post(shop.url, shop.secret, slow)
        settings.MQ_WEBHOOK_TIMEOUT_SECS = 10
        retried = webhooks.post(shop.url, shop.secret, slow)
        assert (lost.ok, retried.ok, retried.status) == (False, True, 200)
        assert shop.rows("SELECT order_pk, delivery_id FROM shop_shipment") == [(3, 51)]


def test_a_project_routing_the_webhook_view_without_its_secret_is_stopped_at_start_up(tmp_path):
    """Django's system checks (manage.py check, runserver, migrate): a missing or malformed
    secret is an error before any post is refused; the view refuses with a 500 (so the server
    retries) if the checks were skipped."""
    shop = Shop(tmp_path, "http://127.0.0.1:9", "no-token")

    def check(**env):
        done = subprocess.run(
            [PYTHON, "manage.py", "check"], cwd=SHOP, env={**shop.env, **env}, capture_output=True, text=True
        )
        return done.returncode, done.stderr

    assert check() == (0, "")
    code, err = check(MQ_WEBHOOK_SECRET="")
    assert code == 1 and "mqclient.E001" in err and "WEBHOOK_SECRET" in err
    code, err = check(MQ_WEBHOOK_SECRET="not-base64!")
    assert code == 1 and "mqclient.E002" in err
    code, err = check(MQ_URL="127.0.0.1:8000")
    assert code == 1 and "mqclient.E003" in err
    out = shop.python(
        """
    from django.test import Client
    answer = Client().post("/mq/webhook/", "{}", content_type="application/json")
    print(answer.status_code, answer.json()["code"])
    """,
        MQ_WEBHOOK_SECRET="",
    )
    assert out.split() == ["500", "not_configured"]


def test_it_runs_the_handlers_over_the_websocket_with_mqlisten(shop, logger):
    listener = subprocess.Popen(
        [PYTHON, "manage.py", "mqlisten"], cwd=SHOP, env=shop.env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert "mqlisten: 1 subscription(s)" in listener.stdout.readline()
        # given its subscription made (by listen's subscribe frame)
        assert eventually(lambda: Subscription.objects.filter(subscriber=logger).exists(), timeout=10)
        # when an order is published
        with Client(shop.env["MQ_URL"], logger.token) as mq:
            sent = mq.publish("db", "create", {"model": "shop.order", "pk": 12})
        # then the handler ran once for its delivery, and the delivery is recorded and acked
        delivery = Delivery.objects.get(message_id=sent["id"])
        assert eventually(
            lambda: shop.rows("SELECT order_pk, delivery_id FROM shop_shipment") == [(12, delivery.id)]
        )
        assert eventually(lambda: Delivery.objects.get(id=delivery.id).status == Status.ACKED)
        assert shop.rows("SELECT id FROM mqclient_receiveddelivery") == [(delivery.id,)]
    finally:
        listener.send_signal(signal.SIGTERM)
        assert listener.wait(15) == 0
        listener.stdout.close()


def test_its_test_kit_captures_the_outbox_and_delivers_to_handlers_and_the_view(tmp_path):
    """mqclient.django.testing and the admin, in the project's own process (no server: nothing
    is sent)."""
    shop = Shop(tmp_path, "http://127.0.0.1:9", "no-token")
    out = shop.python(
        """
    from django.contrib.auth.models import User
    from django.db import transaction
    from django.test import Client
    import mqclient.django
    from mqclient.django.testing import captured, deliver
    from shop.models import Order, Shipment
    from shop.mq_handlers import ship

    # captured(): what committed, and not what rolled back
    with captured() as sent:
        Order.objects.create(item="kit")
        try:
            with transaction.atomic():
                mqclient.django.publish("db", "paid", {"x": 1}, headers={"tenant": "acme"})
                raise RuntimeError
        except RuntimeError:
            pass
        mqclient.django.publish("db", "paid", {"x": 2}, headers={"tenant": "acme"}, group="g")
    print([(m["event"], m["headers"], m["group"]) for m in sent.messages])
    # deliver(): to the view, signed (twice: the handler runs once), and to a handler
    view = mqclient.django.webhook_view
    five = {"id": 5, "queue": "db", "event": "create", "payload": {"pk": 5}}
    first, again = deliver(view, five), deliver(view, five)
    forged = deliver(view, {"queue": "db", "event": "create"}, secret="whsec_b3RoZXI=")
    deliver(ship, {"queue": "db", "event": "create", "payload": {"pk": 6}})
    print(first.status_code, again.status_code, forged.status_code)
    print(sorted(Shipment.objects.values_list("order_pk", flat=True)))
    # signed, but not a message frame: 400; an hour old (a replay): 401

    def signed_post(body, age_secs=0):
        import datetime, time
        from django.conf import settings
        from standardwebhooks import Webhook

        at = int(time.time()) - age_secs
        signature = Webhook(settings.MQ["WEBHOOK_SECRET"]).sign(
            "77", datetime.datetime.fromtimestamp(at, datetime.UTC), body
        )
        headers = {"webhook-id": "77", "webhook-timestamp": str(at), "webhook-signature": signature}
        return Client().post("/mq/webhook/", body, content_type="application/json", headers=headers)

    frame = '{"id": 77, "queue": "db", "event": "create", "payload": {"pk": 77}}'
    answers = signed_post("not json"), signed_post('{"id": 77}'), signed_post(frame, age_secs=3600)
    print(*(answer.status_code for answer in answers))
    # the admin: the outbox for staff, read only; nobody else
    User.objects.create_superuser("boss", password="pw")
    User.objects.create_user("clerk", password="pw")
    staff, clerk = Client(), Client()
    staff.login(username="boss", password="pw")
    clerk.login(username="clerk", password="pw")
    page = staff.get("/admin/mqclient/outboxmessage/")
    row = staff.get("/admin/mqclient/outboxmessage/1/change/")
    print(page.status_code, b"waiting" in page.content, row.status_code, b"Save" in row.content)
    print(clerk.get("/admin/mqclient/outboxmessage/").status_code)
    print(staff.post("/admin/mqclient/outboxmessage/1/change/", {"queue": "x"}).status_code)
    """
    )
    assert out.splitlines() == [
        "[('create', {}, None), ('paid', {'tenant': 'acme'}, 'g')]",
        "200 200 401",
        "[5, 6]",
        "400 400 401",
        "200 True 200 False",
        "302",
        "403",
    ]
    # nothing was sent: the rows wait for a relay
    assert [status for (status,) in shop.rows("SELECT status FROM mqclient_outboxmessage")] == ["waiting"] * 2


def test_an_order_saved_in_the_project_reaches_its_own_webhook_handler_through_the_server(tmp_path, settings):
    """The whole loop a user builds: a model event relayed to a real server, whose real worker
    posts it to the project's webhook view, whose handler runs once."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    redis = start_redis()
    env = {"REDIS_URL": redis.url, "MQ_WEBHOOK_ALLOW_PRIVATE": "true"}
    port = free_port()
    db = Queue.objects.create(name="db")
    hook, _ = create_subscriber(
        "shop-hook", subscribe=["db"], webhook_url=f"http://127.0.0.1:{port}/mq/webhook/"
    )
    subscribing.subscribe(hook, db, "create")
    _, token = create_subscriber("shop", publish=["db"])
    web, worker = start_daphne(env), start_worker(env)
    try:
        shop = Shop(tmp_path, web.http, token, secret=hook.webhook_secret)
        with served(shop, port):
            shop.python('from shop.models import Order\nOrder.objects.create(item="tea")')
            # the handler ran, once, for the delivery the worker posted, which is acked
            assert eventually(lambda: shop.rows("SELECT order_pk FROM shop_shipment") == [(1,)], timeout=30)
            delivery = Delivery.objects.get(subscription__subscriber=hook)
            assert eventually(lambda: Delivery.objects.get(id=delivery.id).status == Status.ACKED, timeout=10)
            assert shop.rows("SELECT delivery_id FROM shop_shipment") == [(delivery.id,)]
    finally:
        worker.stop()
        web.stop()
        redis.stop(signal.SIGKILL)
