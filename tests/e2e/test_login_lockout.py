"""The admin's login is locked out after repeated failures (django-axes; mqsite/settings.py):
per client address and per username, before the password hasher runs, against a real Daphne.
This test stands as a trusted proxy (MQ_TRUSTED_PROXIES) so that it can speak for many
clients, each named by X-Forwarded-For."""

import statistics
import threading
import time

import httpx
import pytest
from axes.models import AccessAttempt
from django.db import connection

from tests.support.servers import start_daphne

LIMIT = 5  # MQ_LOGIN_FAILURE_LIMIT's default


def attempt(web, username, password, address):
    """One login through the admin's form, as the browser at `address`: (answer, seconds)."""
    with httpx.Client(base_url=web.http, headers={"X-Forwarded-For": address}, timeout=30) as client:
        client.get("/admin/login/")
        started = time.monotonic()
        answer = client.post(
            "/admin/login/",
            data={
                "username": username,
                "password": password,
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
                "next": "/admin/",
            },
        )
        return answer, time.monotonic() - started


@pytest.fixture
def second_operator(django_user_model):
    return django_user_model.objects.create_user("op2", password="op2-password-1", is_staff=True)


@pytest.mark.django_db(transaction=True)
def test_a_login_flood_is_locked_out_before_the_password_hasher(
    operator, second_operator, logger, db_queue, capsys
):
    web = start_daphne({"MQ_TRUSTED_PROXIES": "127.0.0.1"})
    try:
        # Given one address that fails LIMIT times (each a different username): the last
        # failure locks it out
        failing = [attempt(web, f"nobody{i}", "wrong", "10.0.0.1") for i in range(LIMIT)]
        assert all(r.status_code == 200 and "correct username" in r.text for r, _ in failing[:-1])
        assert failing[-1][0].status_code == 429
        # then that address is refused, the right password too, with words that say why
        locked, _ = attempt(web, "op", "op-password-1", "10.0.0.1")
        assert locked.status_code == 429
        assert "Too many failed logins" in locked.text and "15 minutes" in locked.text

        # Given one username that fails LIMIT times, each from another address
        statuses = [attempt(web, "op", "wrong", f"10.0.1.{i}")[0].status_code for i in range(LIMIT)]
        assert statuses == [200] * (LIMIT - 1) + [429]
        # then it is refused from a fresh address, the right password too
        assert attempt(web, "op", "op-password-1", "10.0.2.1")[0].status_code == 429
        # while another operator, from another address, logs in
        r, _ = attempt(web, "op2", "op2-password-1", "10.0.3.1")
        assert r.status_code == 302 and r.headers["location"] == "/admin/"
        assert AccessAttempt.objects.filter(username="op").exists()

        # A flood from the locked address beside a publisher: attempts refused at once, and
        # the publisher's latency measured while it goes on
        def publish_times(n):
            times = []
            with httpx.Client(base_url=web.http, timeout=30) as client:
                for _ in range(n):
                    started = time.monotonic()
                    r = client.post(
                        "/api/queues/db/messages",
                        json={"event": "create", "payload": 1},
                        headers={"Authorization": f"Bearer {logger.token}"},
                    )
                    assert r.status_code == 201
                    times.append(time.monotonic() - started)
            return times

        quiet = publish_times(20)
        flood, stop = [], threading.Event()

        def flooder():
            while not stop.is_set():
                flood.append(attempt(web, "op", "guess", "10.0.0.1"))

        threads = [threading.Thread(target=flooder) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            busy = publish_times(20)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert flood and all(r.status_code == 429 for r, _ in flood)
        refused = statistics.median(took for _, took in flood)
        hashed = statistics.median(took for _, took in failing[:-1])
        alone, during = statistics.median(quiet) * 1000, statistics.median(busy) * 1000
        with capsys.disabled():
            print(
                f"\n[{connection.vendor}] a failed login (hashed) {hashed * 1000:.0f} ms, a locked-out one "
                f"{refused * 1000:.0f} ms ({len(flood)} in the flood); a publish "
                f"{alone:.1f} ms alone, {during:.1f} ms during the flood"
            )
        assert refused < hashed  # the hasher did not run (generous: it is many times less)
        assert statistics.median(busy) < 1  # generous; a publish is milliseconds
    finally:
        web.stop()
