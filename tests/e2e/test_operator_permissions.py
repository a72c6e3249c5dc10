"""Operators hold Django's model permissions, as in the admin (issue 26, S10): a staff login
alone opens no operator route. Against a real Daphne, a staff user without permissions is
refused (403) by every operator route and sees nothing of what they guard (payloads,
subscriber names); given the matching permission, the same user is served.

The routes and what each needs: publishing as an operator (queues.add_message), the queue list
(queues.view_queue), a receipt (queues.view_message; its subscriptions list also
delivery.view_delivery), the connections (subscribers.view_connection), the analytics (view on
the run and statistics; trends also on the trend tables) and the dashboard's message feed
(queues.view_message)."""

import contextlib
import json
import time

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.models import Permission
from django.test import Client
from websockets.sync.client import connect

from delivery import publishing, subscribing
from queues.models import Message, Queue
from subscribers.models import Connection
from subscribers.provisioning import create_subscriber
from tests.support.servers import eventually, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)
SECRET = "payload-only-message-viewers-see"


@pytest.fixture(scope="module")
def shared_server(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        started = start_daphne({"REDIS_URL": ""})
    yield started
    started.stop()


@pytest.fixture
def staff_session(django_user_model):
    queue = Queue.objects.create(name="db")
    logger, token = create_subscriber("logger", publish=["db"], subscribe=["db"])
    subscribing.subscribe(logger, queue)
    [(message, _)] = publishing.publish(queue, [publishing.prepare("create", {"secret": SECRET})])
    staff = django_user_model.objects.create_user("staff", password="staff-password-1", is_staff=True)
    client = Client()
    client.force_login(staff)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
    # The server is shared by the module's tests and has no Redis to be told that "db" is a new
    # row now: what it kept of the last test's "db" lapses after MQ_REVOCATION_CHECK_SECS (the
    # bound of a change no announcement told of), which a fast run had not yet waited out.
    time.sleep(settings.MQ_REVOCATION_CHECK_SECS + 0.1)
    return staff, message["id"], token, cookie


@contextlib.contextmanager
def staff_browser(shared_server, cookie):
    """The staff user's browser: its session, and the CSRF token a page of the admin gives it
    (an unsafe call with a session needs one: its 403 must not be mistaken for the refusal)."""
    with httpx.Client(
        base_url=shared_server.http, cookies={settings.SESSION_COOKIE_NAME: cookie}, timeout=10
    ) as c:
        c.get("/admin/", follow_redirects=True)
        c.headers["X-CSRFToken"] = c.cookies[settings.CSRF_COOKIE_NAME]
        yield c


def grant(user, *perms):
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))


def first_snapshot(shared_server, cookie):
    with connect(
        f"{shared_server.ws}dashboard/",
        additional_headers={
            "Cookie": f"{settings.SESSION_COOKIE_NAME}={cookie}",
            "Origin": shared_server.http,
        },
        open_timeout=10,
    ) as ws:
        text = ws.recv(timeout=10)
    frame = json.loads(text)
    assert frame["type"] == "snapshot"
    return frame, text


def publish_as_operator(c):
    return c.post("/api/queues/db/messages", json={"event": "create", "payload": {"by": "operator"}})


ROUTES = {
    "publish": publish_as_operator,
    "queues": lambda c: c.get("/api/queues"),
    "connections": lambda c: c.get("/api/connections"),
    "analytics": lambda c: c.get("/api/analytics"),
    "analytics trends": lambda c: c.get("/api/analytics?trends=hour"),
}


def test_it_refuses_a_staff_user_without_model_permissions_every_operator_route(shared_server, staff_session):
    staff, message_id, token, cookie = staff_session
    with connect(f"{shared_server.ws}?token={token}", close_timeout=1):  # a connection to list
        assert eventually(lambda: Connection.objects.count() == 1)
        with staff_browser(shared_server, cookie) as c:
            answers = {name: call(c) for name, call in ROUTES.items()}
            answers["receipt"] = c.get(f"/api/messages/{message_id}")
    for name, answer in answers.items():
        assert answer.status_code == 403, (name, answer.text)
        assert "permission" in answer.json()["detail"]  # refused for its permission, not its CSRF
        assert "logger" not in answer.text and SECRET not in answer.text and '"db"' not in answer.text
    assert Message.objects.count() == 1  # the refused publish left nothing

    frame, text = first_snapshot(shared_server, cookie)  # the overview, without any message
    assert frame["feed"] == [] and frame["feed_status"] == {}
    assert SECRET not in text


def test_it_serves_each_operator_route_to_a_staff_user_with_its_permission(shared_server, staff_session):
    staff, message_id, token, cookie = staff_session
    grant(staff, "queues.add_message", "queues.view_queue", "subscribers.view_connection")
    grant(staff, "analytics.view_analyticsrun", "analytics.view_eventstats", "analytics.view_subscriberstats")
    with connect(f"{shared_server.ws}?token={token}", close_timeout=1):
        assert eventually(lambda: Connection.objects.count() == 1)
        with staff_browser(shared_server, cookie) as c:
            assert publish_as_operator(c).status_code == 201
            assert [q["name"] for q in c.get("/api/queues").json()["queues"]] == ["db"]
            assert [x["subscriber"] for x in c.get("/api/connections").json()["connections"]] == ["logger"]
            assert c.get("/api/analytics").status_code == 200
            assert c.get("/api/analytics?trends=hour").status_code == 403  # the trends need their own
            grant(staff, "analytics.view_eventtrend", "analytics.view_subscribertrend")
            assert c.get("/api/analytics?trends=hour").status_code == 200

            assert c.get(f"/api/messages/{message_id}").status_code == 403
            grant(staff, "queues.view_message")
            receipt = c.get(f"/api/messages/{message_id}")
            assert receipt.status_code == 200
            assert sum(receipt.json()["deliveries"].values()) == 1
            assert "subscriptions" not in receipt.json() and "logger" not in receipt.text
            grant(staff, "delivery.view_delivery")
            receipt = c.get(f"/api/messages/{message_id}").json()
            assert [s["subscriber"] for s in receipt["subscriptions"]] == ["logger"]
    assert Message.objects.count() == 2

    frame, text = first_snapshot(shared_server, cookie)
    assert SECRET in text and any(m["id"] == message_id for m in frame["feed"])
