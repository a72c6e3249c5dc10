"""The REST rate per subscriber (MQ_THROTTLE_RATE, "N/Ks": N requests in K seconds) against a
real server: a runaway loop is refused with 429 within seconds, while another subscriber's
normal traffic, at the same time, all passes. And the default is a limit a loop meets, above
what a prompt consumer needs."""

import os
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from subscribers.provisioning import create_subscriber
from subscribers.throttling import ClientRateThrottle
from tests.support.servers import start_daphne

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def throttled_server(db_queue):
    # A rate this machine's loop surely passes (the default's 300 a second it may not reach).
    web = start_daphne({"MQ_THROTTLE_RATE": "300/10s"})
    yield web
    web.stop()


def test_the_rate_stops_a_runaway_loop_and_lets_a_normal_client_through(throttled_server):
    _, runaway_token = create_subscriber("runaway", publish=["db"])
    _, normal_token = create_subscriber("normal", publish=["db"])

    # The runaway: a loop that retries at once, on a few connections (threads of one client).
    stop, results, started = threading.Event(), [], time.monotonic()

    def loop():
        with httpx.Client(
            base_url=throttled_server.http, headers={"Authorization": f"Bearer {runaway_token}"}
        ) as c:
            while not stop.is_set() and time.monotonic() - started < 90:
                r = c.get("/api/queues")
                results.append(r)
                if r.status_code == 429:
                    stop.set()

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = next((r for r in results if r.status_code == 429), None)
    passed = sum(r.status_code == 200 for r in results)
    assert {r.status_code for r in results} <= {200, 429}
    assert refused is not None, f"{passed} requests in a loop and never a 429"
    # Two windows of 300 at most (the loop may start late in one).
    assert passed <= 600
    assert 0 < int(refused.headers["Retry-After"]) <= 10
    assert "throttled" in refused.json()["detail"].lower()

    # A service at a normal pace (at most 20 a second), during the runaway's refusal, passes.
    with httpx.Client(
        base_url=throttled_server.http, headers={"Authorization": f"Bearer {normal_token}"}
    ) as normal:
        codes = []
        for _ in range(40):
            codes.append(normal.get("/api/queues").status_code)
            time.sleep(0.05)
    assert codes == [200] * 40
    print(f"runaway: {passed} requests passed in {time.monotonic() - started:.1f} s before its first 429")


def test_the_default_rate_is_a_limit_a_loop_meets_and_a_prompt_consumer_never_does(settings):
    """The default, counted as the server counts (one window, the cache): a loop is refused
    within one window, and a consumer of an ordered queue pulling and acking each message at
    100 messages a second (200 requests) is not."""
    assert "MQ_THROTTLE_RATE" not in os.environ  # so the setting is its default
    requests, window_secs = ClientRateThrottle().parse_rate(settings.MQ_THROTTLE_RATE)
    assert requests / window_secs >= 200
    throttle = ClientRateThrottle()
    request = SimpleNamespace(
        user=SimpleNamespace(pk=f"default-rate-{time.monotonic()}", is_authenticated=True)
    )
    passed = 0
    while passed < 1_000_000 and throttle.allow_request(request, None):
        passed += 1
    # A window that began just before the loop lets at most two windows' worth through.
    assert 0 < passed <= 2 * requests
