"""examples/shop, the Django project the docs walk through, works as its README says: its checks
and migrations run, an order made through its API is an outbox row in the order's transaction,
which `manage.py mqrelay --once` publishes to a real server, once; and the server's post of it
to the shop's webhook URL ships the order once, however often it is posted."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from django.db import connection

from queues.models import Message
from tests.support.servers import ROOT

SHOP = ROOT / "examples" / "shop"

# The example's database is its own SQLite file whatever the server's: the SQLite pass runs it.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite pass of make test runs it"),
]


def run(env, *args, check=True):
    return subprocess.run(
        [sys.executable, *args], cwd=SHOP, env=env, capture_output=True, text=True, check=check, timeout=60
    )


def test_an_order_made_through_the_example_api_is_published_once_and_shipped_once(tmp_path, server, logger):
    db = tmp_path / "shop.sqlite3"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "clients" / "python"),
        "SHOP_DB": str(db),
        "MQ_URL": server.http,
        "MQ_TOKEN": logger.token,
        "MQ_WEBHOOK_SECRET": "whsec_" + "c2VjcmV0LW9mLXRoZS1zaG9w",
    }
    for name in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    assert "no issues" in run(env, "manage.py", "check").stdout
    run(env, "manage.py", "migrate", "--noinput", "-v0")

    # The API, as a browser or curl would call it; the commit's own relay thread is off, so the
    # row waits for the relay below (what a process that died right after its commit leaves).
    script = textwrap.dedent(
        """
        import json, django
        django.setup()
        from django.conf import settings
        from django.test import Client
        settings.MQ["RELAY_ON_COMMIT"] = False
        api = Client(SERVER_NAME="localhost")
        made = api.post("/orders/", {"item": "tea", "quantity": 2}, content_type="application/json")
        bad = api.post("/orders/", {"item": "", "quantity": 0}, content_type="application/json")
        junk = api.post("/orders/", "{not json", content_type="application/json")
        print(json.dumps([made.status_code, made.json(), bad.status_code, junk.status_code]))
        """
    )
    made, answer, bad, junk = json.loads(
        run({**env, "DJANGO_SETTINGS_MODULE": "shopsite.settings"}, "-c", script).stdout
    )
    assert (made, bad, junk) == (201, 400, 400)
    with sqlite3.connect(db) as rows:
        outbox = rows.execute("SELECT queue, event, status, payload FROM mqclient_outboxmessage").fetchall()
    assert [row[:3] for row in outbox] == [("db", "create", "waiting")]
    payload = json.loads(outbox[0][3])
    assert (payload["model"], payload["pk"], payload["fields"]["item"]) == (
        "orders.order",
        answer["id"],
        "tea",
    )

    run(env, "manage.py", "mqrelay", "--once")
    run(env, "manage.py", "mqrelay", "--once")  # nothing left: publishes nothing again
    message = Message.objects.get()
    assert (message.queue.name, message.event.name, json.loads(message.payload_json)) == (
        "db",
        "create",
        payload,
    )
    assert message.publisher == logger
    with sqlite3.connect(db) as rows:
        assert rows.execute("SELECT status FROM mqclient_outboxmessage").fetchall() == [("sent",)]

    # The message as the server posts it to mq/webhook/ (docs/webhooks.md), signed with the
    # shop's secret, twice (the answer to the first was lost), then unsigned.
    frame = {
        "type": "message",
        "id": 41,
        "message_id": message.id,
        "queue": "db",
        "event": "create",
        "seq": message.seq,
        "payload": payload,
        "attempt": 1,
        "published_at": message.created_at.isoformat(),
        "deliver_at": None,
        "expires_at": None,
        "group": None,
    }
    hook = textwrap.dedent(
        """
        import json, sys, time, django
        django.setup()
        from datetime import UTC, datetime
        from django.conf import settings
        from django.test import Client
        from standardwebhooks import Webhook
        from orders.models import Shipment
        body, now = sys.argv[1], int(time.time())
        signed = Webhook(settings.MQ["WEBHOOK_SECRET"]).sign("41", datetime.fromtimestamp(now, UTC), body)
        headers = {"webhook-id": "41", "webhook-timestamp": str(now), "webhook-signature": signed}
        api = Client(SERVER_NAME="localhost")
        post = lambda h: api.post("/mq/webhook/", body, content_type="application/json", headers=h)
        answers = [post(headers), post(headers), post({})]
        shipped = list(Shipment.objects.values_list("order_id", "delivery_id"))
        print(json.dumps([[a.status_code for a in answers], shipped]))
        """
    )
    statuses, shipments = json.loads(
        run({**env, "DJANGO_SETTINGS_MODULE": "shopsite.settings"}, "-c", hook, json.dumps(frame)).stdout
    )
    assert statuses == [200, 200, 401]
    assert shipments == [[answer["id"], 41]]
