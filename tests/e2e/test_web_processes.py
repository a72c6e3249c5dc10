"""Several web processes (issue 15, item 3): in the services mode `make run` starts
MQ_WEB_PROCESSES Daphne processes on one port, and each keeps the subscribers and queues its
requests look up. Every process takes requests, and a change made in one process holds in every
other from its next request on: a rotated token is refused at once, a deleted queue is gone.

The servers check their sockets' tokens only every 30 s here, and keep rows for as long
(MQ_REVOCATION_CHECK_SECS), so what makes another process refuse a token in time is the
announcement over Redis; the last test takes the announcement away and leaves the age at its
default, the safety net."""

import http.client
import json
import re
import time
from urllib.parse import urlencode

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber
from tests.support.servers import E2E_REDIS as REDIS
from tests.support.servers import eventually, start_daphne, start_daphnes

pytestmark = pytest.mark.django_db(transaction=True)
CHECK_RARELY = {"REDIS_URL": REDIS, "MQ_REVOCATION_CHECK_SECS": "30"}


@pytest.fixture
def owner_unsubscribed():
    Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    return owner, token


@pytest.fixture
def two_servers():
    """Two processes on ports of their own, so that a test can choose which one it asks."""
    started = [start_daphne(CHECK_RARELY), start_daphne(CHECK_RARELY)]
    yield started
    for s in started:
        s.stop()


def call_on(server, method, path, token=None, body=None, headers=None, conn=None):
    """(status, parsed body) of one request, on a new connection unless `conn` is given."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        sent = dict(headers or {})
        if token:
            sent["Authorization"] = f"Bearer {token}"
        if body is not None:
            sent.setdefault("Content-Type", "application/json")
            body = body if isinstance(body, str) else json.dumps(body)
        conn.request(method, path, body, sent)
        response = conn.getresponse()
        return response.status, response.read(), response
    finally:
        if own:
            conn.close()


def publish_status(server, token, i=0):
    return call_on(server, "POST", "/api/queues/db/messages", token, {"event": "create", "payload": i})[0]


def test_several_processes_on_one_port_each_take_requests(owner_unsubscribed):
    if connection.vendor != "postgresql":
        pytest.skip(
            "several web processes are the services mode's (PostgreSQL and Redis): "
            "the PostgreSQL pass of make test runs it"
        )
    _, token = owner_unsubscribed
    servers = start_daphnes(2, {"REDIS_URL": REDIS})
    try:
        sent = 0
        # Each publish on a new connection: the kernel hands each to one of the processes.
        while sent < 200 and not all(servers.requests_served()):
            assert publish_status(servers, token, sent) == 201
            sent += 1
        served = servers.requests_served()
        assert all(n > 0 for n in served), served
        assert Message.objects.count() == sent
        # Both are alive and beat as processes of their own (delivery.liveness).
        assert all(p.poll() is None for p in servers.procs)
    finally:
        servers.stop()


def test_a_token_rotated_through_one_process_is_refused_at_once_by_the_other(two_servers, owner_unsubscribed):
    owner, token = owner_unsubscribed
    first, second = two_servers
    for server in two_servers:  # each has looked the token up, and keeps it
        assert publish_status(server, token) == 201
    old_hash = owner.token_hash

    # An operator rotates the token in the first process's admin.
    admin = AdminSession(first)
    status = admin.post(
        "/admin/subscribers/subscriber/", {"action": "issue_new_token", "_selected_action": owner.pk}
    )
    assert status == 302
    owner.refresh_from_db()
    assert owner.token_hash != old_hash

    # The next request to either process with the old token is refused.
    assert publish_status(second, token) == 401
    assert publish_status(first, token) == 401


def test_a_deactivated_subscriber_and_a_deleted_queue_hold_at_once_in_every_process(
    two_servers, owner_unsubscribed, announcing
):
    owner, token = owner_unsubscribed
    other, other_token = create_subscriber("other", publish=["db"], subscribe=["db"])
    for server in two_servers:
        assert publish_status(server, token) == 201
        assert publish_status(server, other_token) == 201

    owner.is_active = False
    owner.save()
    assert [publish_status(s, token) for s in two_servers] == [401, 401]
    assert [publish_status(s, other_token) for s in two_servers] == [201, 201]

    Queue.objects.get(name="db").delete()
    assert [publish_status(s, other_token) for s in two_servers] == [404, 404]
    Queue.objects.create(name="db")  # a new queue of that name is found, not the old one
    other.publish_queues.add(Queue.objects.get(name="db"))
    assert [publish_status(s, other_token) for s in two_servers] == [201, 201]


def test_without_the_announcement_a_rotated_token_is_refused_within_the_check_interval(owner_unsubscribed):
    """The change announced to nobody (this process has no Redis): the rows a process keeps
    go by their age (MQ_REVOCATION_CHECK_SECS, 0.5 s by default)."""
    owner, token = owner_unsubscribed
    server = start_daphne({"REDIS_URL": REDIS})
    try:
        assert publish_status(server, token) == 201
        started = time.monotonic()
        owner.issue_token()
        owner.save()
        assert eventually(lambda: publish_status(server, token) == 401, timeout=2)
        assert time.monotonic() - started < 2
    finally:
        server.stop()


class AdminSession:
    """A staff user logged in to one server's admin over HTTP, as a browser would."""

    def __init__(self, server):
        get_user_model().objects.create_superuser("op", password="op-password-1")
        self.server, self.cookies = server, {}
        self.post("/admin/login/", {"username": "op", "password": "op-password-1", "next": "/admin/"})
        assert "sessionid" in self.cookies

    def _cookie_header(self):
        return {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}

    def _keep(self, response):
        for name, value in response.getheaders():
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                self.cookies[key] = rest.split(";", 1)[0]

    def post(self, path, fields):
        status, page, response = call_on(self.server, "GET", path, headers=self._cookie_header())
        self._keep(response)
        csrf = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1).decode()
        headers = {
            **self._cookie_header(),
            "Content-Type": "application/x-www-form-urlencoded",
            "Referer": self.server.http + path,
        }
        body = urlencode({**fields, "csrfmiddlewaretoken": csrf})
        status, _, response = call_on(self.server, "POST", path, body=body, headers=headers)
        self._keep(response)
        return status
