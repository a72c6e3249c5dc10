"""/healthz sees the processes that do the work, against real ones: where workers should run
(MQ_HEALTH_WORKERS, the default), a web process with no live worker, or whose sweep has stopped,
answers 503 saying so; with a worker and its beat running, 200 with the counts and the sweep's
age; a worker killed is noticed within seconds."""

import signal

import httpx
import pytest
from django.db import connection

from tests.support.servers import eventually, start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)


def health(web):
    r = httpx.get(f"{web.http}/healthz", timeout=5)
    return r.status_code, r.json()


@pytest.fixture
def env():
    """The mode of the database under test: services (a Redis of its own) or embedded."""
    if connection.vendor == "postgresql":
        redis = start_redis()
        yield {"REDIS_URL": redis.url, "MQ_HEALTH_WORKERS": "true"}
        redis.stop(signal.SIGKILL)
    else:
        yield {"REDIS_URL": "", "MQ_HEALTH_WORKERS": "true"}


def test_no_worker_then_a_worker_then_a_killed_worker(env):
    web = start_daphne(env)
    worker = None
    try:
        status, body = health(web)
        assert status == 503 and body["status"] == "unavailable"
        assert body["checks"]["web"]["alive"] >= 1 and body["checks"]["worker"] == {"alive": 0}
        assert "no worker is alive" in body["problems"]
        assert body["checks"]["database"] == body["checks"]["broker"] == "ok"

        worker = start_worker(env)  # with beat: the sweep every second
        assert eventually(lambda: health(web)[0] == 200, timeout=60, step=0.5), worker.output()[-2000:]
        _, body = health(web)
        assert body["checks"]["worker"]["alive"] >= 1
        assert 0 <= body["checks"]["sweep"]["last_run_s"] < 5

        worker.stop(signal.SIGKILL)  # no clean stop: its row stays, its beats stop
        assert eventually(lambda: health(web)[0] == 503, timeout=10, step=0.2)
        status, body = health(web)
        assert body["checks"]["worker"] == {"alive": 0} and "no worker is alive" in body["problems"]
    finally:
        if worker is not None:
            worker.stop(signal.SIGKILL)
        web.stop()


def test_a_web_process_alone_on_purpose_is_healthy(env):
    web = start_daphne({**env, "MQ_HEALTH_WORKERS": "false"})
    try:
        status, body = health(web)
        assert status == 200 and body["checks"]["worker"] == {"alive": 0}
        assert body["checks"]["sweep"]["last_run_s"] is None
    finally:
        web.stop()
