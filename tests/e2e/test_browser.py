"""The dashboard in a real browser: headless Chromium (Debian's, driven by Playwright) against a
real Daphne server. An operator logs in through the admin's login page, opens the dashboard,
a service publishes over REST, and the counter and the feed change without a reload. A
screenshot is kept in var/artifacts/dashboard.png.
"""

import json
import random
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from dashboard.demo import DemoTraffic, seed_if_fresh
from delivery import ledger, subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.chromium import ARGS, CHROMIUM
from tests.support.servers import ROOT

ARTIFACTS = ROOT / "var" / "artifacts"

pytestmark = pytest.mark.django_db(transaction=True)

# No skip: `make test` installs Chromium, so a missing one is a broken setup, and a skipped
# browser test would hide whatever the dashboard broke.
if not Path(CHROMIUM).exists():
    raise RuntimeError(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")


@pytest.fixture
def page(server, monkeypatch):
    # Playwright's sync API runs an event loop in this thread, which Django takes for an async
    # context; the test's own database calls are plain sync calls all the same. Set after the
    # server started, so that it does not inherit this.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(15_000)
        # What the Content-Security-Policy blocked: Chromium reports each on the console.
        page.csp_violations = []
        page.on(
            "console",
            lambda m: page.csp_violations.append(m.text) if "Content Security Policy" in m.text else None,
        )
        yield page
        browser.close()


def publish_message(server, token, queue, event, payload, headers=None):
    body = {"event": event, "payload": payload, **({"headers": headers} if headers else {})}
    req = urllib.request.Request(
        f"{server.http}/api/queues/{queue}/messages",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201
        return json.loads(r.read())


def test_an_operator_watches_messages_arrive_live(server, page, django_user_model):
    seed_if_fresh()  # the demo's queues and subscribers, as a fresh `make run` has them
    Queue.objects.create(name="orders", ordered=True)
    service, token = create_subscriber("shop", publish=["db", "orders"], subscribe=["orders"])
    subscribing.subscribe(service, Queue.objects.get(name="orders"))
    django_user_model.objects.create_user(
        "ops", password="a-long-password-1", is_staff=True, is_superuser=True
    )

    # Not logged in: the dashboard sends the browser to the admin's login page.
    page.goto(f"{server.http}/")
    assert "/admin/login/" in page.url
    page.fill("#id_username", "ops")
    page.fill("#id_password", "a-long-password-1")
    page.click("input[type=submit]")
    page.wait_for_url(f"{server.http}/")
    page.wait_for_selector("#conn.live")
    page.wait_for_selector('#queues tr[data-queue="db"][data-event="create"]')
    assert page.inner_text("#t-published") == "0"
    page.evaluate("window.__same_page = true")  # gone if the page reloads

    answer = publish_message(server, token, "db", "create", {"table": "users", "id": 7, "name": "Ann"})

    # expect() rather than wait_for_function(): that evals its string in the page, which the
    # Content-Security-Policy (rightly) forbids.
    expect(page.locator("#t-published")).to_have_text("1")
    row = '#queues tr[data-queue="db"][data-event="create"]'
    expect(page.locator(f"{row} td.published")).to_have_text("1")
    item = page.wait_for_selector(f'#feed li[data-id="{answer["id"]}"]')
    assert "Ann" in item.inner_text() and "db/create" in item.inner_text()
    # Two subscriptions (dashboard and monitor want db/create, the logger all of db) are owed it.
    assert answer["deliveries"] == 3
    assert page.evaluate("window.__same_page") is True

    # A dead letter appears, and its button puts it back through the ledger.
    dead = Delivery.objects.filter(message_id=answer["id"], subscriber__name="monitor")
    ledger.kill_deliveries(dead, reason="monitor: could not reach the pager")
    button = page.wait_for_selector(f'#dead tr[data-delivery="{dead.get().pk}"] button.redeliver')
    button.click()
    page.wait_for_selector("#toast.show")
    deadline = time.monotonic() + 5
    while dead.get().status != Status.PENDING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dead.get().status == Status.PENDING
    assert page.evaluate("window.__same_page") is True

    # A message with headers shows them in the feed, beside its payload.
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    traced = publish_message(server, token, "db", "create", {"id": 8}, headers={"traceparent": traceparent})
    shown = page.wait_for_selector(f'#feed li[data-id="{traced["id"]}"] .headers')
    assert shown.inner_text() == f"traceparent={traceparent}"
    assert page.query_selector(f'#feed li[data-id="{answer["id"]}"] .headers') is None

    # Some traffic for the picture: the demo's publishers and subscribers for a few seconds.
    traffic = DemoTraffic(rate=12, poison_every=6, rng=random.Random(5))
    started = last = time.monotonic()
    while time.monotonic() - started < 8:
        now = time.monotonic()
        traffic.publish_due(now - last)
        last = now
        traffic.consume(now)
        time.sleep(0.2)
    for n in range(3):
        publish_message(server, token, "orders", "paid", {"order": 5000 + n, "total": 42.5})
    # And a webhook that kept failing, as an operator would find it.
    first_order = Delivery.objects.filter(subscriber=service).order_by("seq")[:1].values("id")
    ledger.kill_deliveries(
        Delivery.objects.filter(id__in=first_order), reason="webhook answered 503; dead after 10 attempts"
    )
    time.sleep(2.5)  # two more snapshots
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert int(page.inner_text("#t-acked").replace(",", "")) > 0
    assert page.csp_violations == []  # all of it ran under the Content-Security-Policy


def test_the_admin_and_the_api_docs_work_under_the_content_security_policy(server, page, django_user_model):
    Queue.objects.create(name="orders", ordered=True)
    service, token = create_subscriber("shop", publish=["orders"], subscribe=["orders"])
    subscribing.subscribe(service, Queue.objects.get(name="orders"))
    publish_message(server, token, "orders", "paid", {"order": 1})
    publish_message(server, token, "orders", "paid", {"order": 2})
    [head] = ledger.lease_deliveries(service, limit=1, holder="test")
    head = ledger.fail_delivery(head["id"], "test", "503 from the shop")  # retried later: it holds the line
    django_user_model.objects.create_user(
        "ops", password="a-long-password-1", is_staff=True, is_superuser=True
    )
    page.goto(f"{server.http}/admin/login/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "a-long-password-1")
    page.click("input[type=submit]")
    page.wait_for_url(f"{server.http}/admin/")

    # The admin's own scripts run: the subscriber page's queue pickers (SelectFilter2.js).
    page.goto(f"{server.http}/admin/subscribers/subscriber/{service.pk}/change/")
    page.wait_for_selector("#id_publish_queues_filter")

    # Head of line: "Skip" asks first (confirm.js, no inline onclick); dismissed, nothing is done.
    page.goto(f"{server.http}/admin/tools/head-of-line/")
    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("button[value=skip]")
    page.wait_for_timeout(500)
    assert asked and asked[0].startswith(f"Skip delivery {head.pk}?")
    assert Delivery.objects.get(pk=head.pk).status != Status.DEAD

    # The API docs: Swagger UI (drf-spectacular-sidecar's files) draws the schema.
    page.goto(f"{server.http}/api/docs/")
    page.wait_for_selector(".swagger-ui .info .title")
    page.wait_for_selector(".opblock-tag")
    assert page.csp_violations == []
