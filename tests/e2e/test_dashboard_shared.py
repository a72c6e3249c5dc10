"""Open dashboards over real Daphne processes sharing one Redis: one snapshot a second for the
whole deployment, whatever the number of dashboards and processes (dashboard.shared).

What operators rely on: each open dashboard gets its snapshot every second, and a third or a
tenth open dashboard adds no computation of the overview (which would slow the publishers)."""

import json
import threading
import time

import pytest
from django.conf import settings
from django.test import Client
from websockets.sync.client import connect

from delivery.publishing import prepare, publish
from queues.models import Queue
from tests.support.servers import start_daphne, start_redis

RUN_SECS = 5.0


def staff_cookie(django_user_model):
    user = django_user_model.objects.create_user(
        "op", password="op-password-1", is_staff=True, is_superuser=True
    )
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def watch(server, cookie, seen, errors):
    """Read snapshots from one dashboard for RUN_SECS: (arrival time, snapshot's "at")."""
    try:
        with connect(
            f"ws://127.0.0.1:{server.port}/ws/dashboard/",
            additional_headers={"Cookie": cookie, "Origin": server.http},
            open_timeout=10,
        ) as ws:
            deadline = time.monotonic() + RUN_SECS
            while time.monotonic() < deadline:
                frame = json.loads(ws.recv(timeout=5))
                assert frame["type"] == "snapshot"
                seen.append((time.monotonic(), frame["at"], frame["totals"]["published"]))
    except Exception as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.django_db(transaction=True)
def test_three_dashboards_on_two_processes_share_one_snapshot_a_second(django_user_model):
    queue = Queue.objects.create(name="db")
    publish(queue, [prepare("create", {"n": i}) for i in range(3)])
    cookie = staff_cookie(django_user_model)
    redis = start_redis()
    env = {"REDIS_URL": redis.url}
    servers = [start_daphne(env), start_daphne(env)]
    try:
        seen = [[], [], []]
        errors = []
        threads = [
            threading.Thread(target=watch, args=(server, cookie, seen[i], errors))
            for i, server in enumerate([servers[0], servers[0], servers[1]])
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for frames in seen:
            # One a second each: at least 4 in 5 s (the first arrives once the socket opens).
            assert len(frames) >= RUN_SECS - 1, frames
            assert all(published == 3 for _, _, published in frames)
        # Besides each dashboard's first snapshot (computed fresh when it opens), the ticks of
        # all three share the deployment's snapshot: about one computation a second in all,
        # not one per dashboard.
        later = [at for frames in seen for _, at, _ in frames[1:]]
        assert len(set(later)) <= RUN_SECS / 0.9 + 2, sorted(set(later))
        assert len(later) >= 2 * len(set(later))
        # One process's snapshot served by the other.
        on_first = {at for frames in seen[:2] for _, at, _ in frames[1:]}
        on_second = {at for _, at, _ in seen[2][1:]}
        assert on_first & on_second
    finally:
        for server in servers:
            server.stop()
        redis.stop()
