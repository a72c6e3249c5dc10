"""Celery delivery end to end: a real worker (with beat) on a private Redis, a real Daphne in
the services mode, a real receiver; retries on the backoff schedule through the real beat
sweeper; workers killed with SIGKILL and Redis restarted empty."""

import json
import signal
import time

import pytest

from delivery import liveness, subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.models import ServerProcess
from subscribers.provisioning import create_subscriber
from tests.support.http import publish_over_http
from tests.support.servers import start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def backoff_base_secs():
    return "0.2"  # short, so that the fault tests' retries come soon; a test may parametrize it


@pytest.fixture
def celery_services(receiver, settings, backoff_base_secs):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    redis = start_redis()
    env = {
        "REDIS_URL": redis.url,
        "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
        "MQ_BACKOFF_BASE_SECS": backoff_base_secs,
    }
    queue = Queue.objects.create(name="db", ack_timeout=2)
    monitor, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(monitor, queue)
    _, token = create_subscriber("app", publish=["db"])
    web = start_daphne(env)
    worker = start_worker(env)
    state = {"redis": redis, "web": web, "worker": worker, "env": env, "token": token}
    yield state
    for name in ("worker", "web", "redis"):
        state[name].stop(signal.SIGKILL if name == "redis" else signal.SIGTERM)


def wait_all_acked(n, timeout=40):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Delivery.objects.filter(status=Status.ACKED).count() == n:
            return True
        time.sleep(0.2)
    return False


def received_payloads(receiver):
    return sorted(json.loads(body)["payload"]["n"] for *_, body in receiver.requests)


def test_a_worker_posts_published_messages_to_the_webhook(celery_services, receiver):
    publish_over_http(celery_services["web"], celery_services["token"], 5)
    assert wait_all_acked(5), celery_services["worker"].output()[-3000:]
    assert set(received_payloads(receiver)) == set(range(5))


@pytest.mark.parametrize("backoff_base_secs", ["1.0"])  # the contract's default: 1 s, 2 s, 4 s ...
def test_failed_posts_are_retried_on_the_backoff_schedule_by_the_beat_sweeper(celery_services, receiver):
    receiver.script = [(500, 0), (503, 0), (200, 0)]
    # beat is sweeping (its first sweep may come seconds after the worker is up)
    deadline = time.monotonic() + 30
    while "Sending due task sweep" not in celery_services["worker"].output() and time.monotonic() < deadline:
        time.sleep(0.1)
    publish_over_http(celery_services["web"], celery_services["token"], 1)
    assert wait_all_acked(1, timeout=30), celery_services["worker"].output()[-3000:]
    times = [t for t, *_ in receiver.requests]
    assert len(times) == 3
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(f"retry gaps: {gaps[0]:.3f} s, {gaps[1]:.3f} s")
    # 1 s, then doubled: each retry goes when the ledger says, not when a sweep happens by
    for gap, expected in zip(gaps, (1.0, 2.0), strict=True):
        assert 0.8 * expected <= gap <= 2 * expected + 1, gaps
    assert Delivery.objects.get().attempt == 3
    # One job per subscriber at a time, none for work not yet due: the failures did not set
    # off jobs that find nothing to post (the wake-up's job, then one per retry).
    time.sleep(0.5)  # the log catches up
    jobs = celery_services["worker"].output().count("Task delivery.tasks.deliver_webhooks[")
    assert jobs <= 2 * (len(times) + 1), celery_services["worker"].output()[-3000:]  # received, succeeded


def test_a_worker_killed_mid_post_loses_nothing(celery_services, receiver):
    receiver.script = [(200, 4.0)]  # the first post hangs while we kill the worker
    publish_over_http(celery_services["web"], celery_services["token"], 1)
    deadline = time.monotonic() + 20
    while not receiver.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.requests, celery_services["worker"].output()[-3000:]
    celery_services["worker"].stop(signal.SIGKILL)
    celery_services["worker"] = start_worker(celery_services["env"])
    publish_over_http(celery_services["web"], celery_services["token"], 2, start=1)
    assert wait_all_acked(3), celery_services["worker"].output()[-3000:]
    assert set(received_payloads(receiver)) == {0, 1, 2}
    assert received_payloads(receiver).count(0) >= 2  # the killed post was tried again


def test_a_restarted_redis_loses_nothing(celery_services, receiver):
    receiver.default = (200, 0.5)  # slow, so that jobs are still queued when Redis goes
    publish_over_http(celery_services["web"], celery_services["token"], 4)
    time.sleep(0.3)
    redis = celery_services["redis"]
    redis.stop(signal.SIGKILL)  # its queued jobs are gone with it
    publish_over_http(
        celery_services["web"], celery_services["token"], 2, start=4
    )  # committed while Redis is down: the wake-ups are lost
    celery_services["redis"] = start_redis(redis.port)
    assert wait_all_acked(6, timeout=60), celery_services["worker"].output()[-3000:]
    assert set(received_payloads(receiver)) == set(range(6))


# "Within about a second" (issue 28): a killed webhook worker's ordered line is posted to again
# by another worker about WORKER_DEAD_AFTER_SECS after the kill (1.0-1.5 s here; 4-5 s before,
# when a worker was taken for dead after 3 s and its job's claim lived 3 s).
TAKEOVER_SECS = 2.0


@pytest.fixture
def two_workers(celery_services):
    """The fixture's worker and a second one, both beating, on the queue `db` made ordered with
    the default ack timeout (30 s: only the liveness rule can hand a killed worker's head back
    in time); and every process has beaten long enough to judge the others."""
    Queue.objects.filter(name="db").update(ordered=True, ack_timeout=30)
    second = start_worker(celery_services["env"])
    try:
        deadline = time.monotonic() + 60
        while ServerProcess.objects.filter(kind="worker").count() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ServerProcess.objects.filter(kind="worker").count() == 2, second.output()[-3000:]
        time.sleep(liveness.DEAD_AFTER_SECS + 2 * liveness.BEAT_SECS)
        yield [celery_services["worker"], second]
    finally:
        second.stop(signal.SIGKILL)


def arrivals(receiver):
    """(monotonic time, payload n, webhook-id) of each post, in the order they came."""
    posts = list(receiver.requests)
    return [(t, json.loads(body)["payload"]["n"], headers["webhook-id"]) for t, _, headers, body in posts]


def pid_of_holder(holder):
    """The pid of the process named in a lease holder (liveness.name: host-pid-random/...)."""
    return int(holder.split("/")[0].rsplit("-", 2)[1])


def test_a_killed_workers_ordered_line_is_taken_over_by_another_within_about_a_second(
    celery_services, two_workers, receiver
):
    receiver.script = [(200, 30.0)]  # the first post hangs: its worker is killed holding the head
    publish_over_http(celery_services["web"], celery_services["token"], 2)
    deadline = time.monotonic() + 20
    while not receiver.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    holder = Delivery.objects.get(status=Status.INFLIGHT).lease_holder
    (doomed,) = [w for w in two_workers if w.proc.pid == pid_of_holder(holder)]
    doomed.stop(signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 15
    while len(receiver.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(receiver.requests) >= 2, celery_services["worker"].output()[-3000:]
    took = receiver.requests[1][0] - killed
    print(f"the head was posted again {took:.2f} s after its worker was killed")
    assert wait_all_acked(2)
    posts = arrivals(receiver)
    assert [n for _, n, _ in posts] == [0, 0, 1]  # the head again (the same delivery), then the next
    assert posts[0][2] == posts[1][2]
    assert took < TAKEOVER_SECS


def test_a_worker_busy_with_a_slow_post_keeps_its_ordered_line(celery_services, two_workers, receiver):
    """A post that lasts three times as long as a worker may go without a beat, and as its
    job's claim lives, is not taken for a dead worker's: nobody posts its line meanwhile."""
    slow = 3 * liveness.WORKER_DEAD_AFTER_SECS
    receiver.script = [(200, slow)]
    publish_over_http(celery_services["web"], celery_services["token"], 3)
    assert wait_all_acked(3), celery_services["worker"].output()[-3000:]
    posts = arrivals(receiver)
    assert [n for _, n, _ in posts] == [0, 1, 2]  # each once, in order
    assert posts[1][0] - posts[0][0] >= slow
    assert ServerProcess.objects.filter(kind="worker").count() == 2  # neither was taken for dead
