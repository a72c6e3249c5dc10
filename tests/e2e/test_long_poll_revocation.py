"""A long poll whose token is revoked while it waits (issue 26, S8): a real Daphne, a poll
started with the old token, the token rotated (or its subscriber deactivated or deleted) by
this process, then a message published. The poll answers 401 and leases nothing; what was
published waits for the new token.

Two modes. Services: the server hears the change over Redis (its own check of kept rows set to
30 s, so only the announcement can end the poll in time), and the publish follows the change
at once. Embedded: no Redis, the change is made by another process (this one), so the server
learns it only when its kept row ages out (MQ_REVOCATION_CHECK_SECS, 0.5 s): the publish waits
that long, the bound the contract gives."""

import io
import threading
import time

import httpx
import pytest
from django.core.management import call_command
from django.db import connection

from delivery.models import Delivery, Status
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber
from tests.support.http import publish_over_http
from tests.support.personas import subscribed_owner
from tests.support.servers import E2E_REDIS, eventually, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_SECS = 20  # the poll's own wait: far longer than a revocation may take to end it
WITHIN = 3.0  # generous: the change's announcement is heard in milliseconds (timings printed)
EMBEDDED_AGE_SECS = 0.5  # the server's MQ_REVOCATION_CHECK_SECS in the embedded mode
timings = []


@pytest.fixture(scope="module", autouse=True)
def _print_long_poll_timings():
    yield
    for what, took in timings:
        print(f"long-poll revocation: {what}: {took * 1000:.0f} ms")


@pytest.fixture(scope="module", params=["services", "embedded"])
def server_per_mode(request, django_db_setup, django_db_blocker):
    if request.param == "services":
        env = {"REDIS_URL": E2E_REDIS, "MQ_REVOCATION_CHECK_SECS": "30"}
    else:
        env = {"REDIS_URL": "", "MQ_REVOCATION_CHECK_SECS": str(EMBEDDED_AGE_SECS)}
    with django_db_blocker.unblock():
        started = start_daphne(env)
    started.mode = request.param
    yield started
    started.stop()


@pytest.fixture
def owner_and_publisher(server_per_mode, request):
    if server_per_mode.mode == "services":
        request.getfixturevalue("announcing")  # this process's changes go over Redis, as a server's
    _, owner, token, _ = subscribed_owner()
    _, publisher = create_subscriber("publisher", publish=["db"])
    return owner, token, publisher


def start_poll(server_per_mode, token):
    """A long poll in a thread; its answer (and when it came) lands in the returned dict."""
    answer = {}

    def poll():
        with httpx.Client(base_url=server_per_mode.http, headers={"Authorization": f"Bearer {token}"}) as c:
            answer["response"] = c.get(f"/api/deliveries?wait={WAIT_SECS}", timeout=WAIT_SECS + 10)
            answer["at"] = time.monotonic()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    answer["thread"] = thread
    return answer


def waiting(server_per_mode, owner):
    """Whether the poll is waiting in the server: in the services mode its slot is in Redis;
    without Redis nothing outside shows it, so give it a generous moment."""
    if server_per_mode.mode == "embedded":
        time.sleep(1.0)
        return True
    import redis

    client = redis.Redis.from_url(E2E_REDIS)
    try:
        return eventually(lambda: client.zcard(f"mq:longpolls:{owner.pk}") == 1)
    finally:
        client.close()


def revoke(server_per_mode, owner, change):
    """Make the change in this process; the new token, if any."""
    new_token = None
    if change == "rotate":
        out = io.StringIO()
        args = ["owner", "--publish", "db", "--subscribe", "db"]
        call_command("createsubscriber", *args, stdout=out, stderr=io.StringIO())
        new_token = out.getvalue().split()[-1]
    elif change == "deactivate":
        owner.is_active = False
        owner.save()
    else:
        owner.delete()
    if server_per_mode.mode == "embedded":
        time.sleep(EMBEDDED_AGE_SECS + 0.5)  # no announcement reaches the server: its rows age out
    return new_token


@pytest.mark.parametrize("change", ["rotate", "deactivate", "delete"])
def test_it_ends_a_waiting_long_poll_of_a_revoked_token_with_401_and_leases_nothing(
    server_per_mode, owner_and_publisher, change
):
    owner, token, publisher = owner_and_publisher
    answer = start_poll(server_per_mode, token)
    assert waiting(server_per_mode, owner)
    started = time.monotonic()
    new_token = revoke(server_per_mode, owner, change)
    publish_over_http(server_per_mode, publisher, 1, start=1)

    answer["thread"].join(timeout=WAIT_SECS + 15)
    response = answer["response"]
    assert response.status_code == 401, response.text
    assert "revoked" in response.json()["detail"]
    took = answer["at"] - started
    timings.append((f"{server_per_mode.mode} ({connection.vendor}), {change}: change to 401", took))
    assert took < WITHIN + (EMBEDDED_AGE_SECS + 0.5 if server_per_mode.mode == "embedded" else 0)

    # Nothing was leased to the poll: what was published waits for the new token.
    assert Delivery.objects.filter(status=Status.INFLIGHT).count() == 0
    if change == "rotate":
        [(status, attempt)] = Delivery.objects.values_list("status", "attempt")
        assert (status, attempt) == (Status.PENDING, 0)
        with httpx.Client(
            base_url=server_per_mode.http, headers={"Authorization": f"Bearer {new_token}"}
        ) as c:
            pulled = c.get("/api/deliveries", timeout=10)
        assert pulled.status_code == 200
        assert [d["payload"] for d in pulled.json()["deliveries"]] == [{"n": 1}]
        old = httpx.get(
            f"{server_per_mode.http}/api/deliveries", headers={"Authorization": f"Bearer {token}"}
        )
        assert old.status_code == 401
    elif change == "deactivate":
        assert not Delivery.objects.exists()  # an inactive subscriber is owed nothing
        assert Subscriber.objects.filter(pk=owner.pk, is_active=False).exists()
    else:
        assert not Subscriber.objects.filter(pk=owner.pk).exists()
