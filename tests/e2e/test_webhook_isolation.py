"""Slow webhooks against the workers as `make run` starts them (mqsite/supervisord.conf), with a
real Daphne, real HTTP endpoints that drip bytes, and Redis or the filesystem as the broker: a
healthy subscriber's posts go out promptly beside a dripping one, sweeps go on while every
webhook thread is held, and a killed worker's claim lapses within seconds."""

import signal
import tempfile
import time

import pytest
import redis

from delivery import ledger, subscribing
from delivery.models import Delivery, DeliveryAttempt, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.http import publish_over_http
from tests.support.receivers import Dripper, Receiver
from tests.support.servers import eventually, run_command, start_as_make_run, start_daphne, start_redis

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cluster(settings):
    """Start processes with `cluster.start(...)`; all are killed at the end."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True

    class Cluster:
        procs = []
        env = {"MQ_WEBHOOK_ALLOW_PRIVATE": "true", "MQ_BACKOFF_BASE_SECS": "0.2"}

        def services(self):
            self.redis = start_redis()
            self.procs.append(self.redis)
            self.env["REDIS_URL"] = self.redis.url

        def embedded(self):
            self.env["REDIS_URL"] = ""  # no Redis: the filesystem broker, in a folder of its own
            self.env["MQ_CELERY_DIR"] = tempfile.mkdtemp(prefix="celery-")

        def web(self):
            self.daphne = start_daphne(self.env)
            self.procs.append(self.daphne)

        def worker(self, program):
            """A worker as `make run` starts it; the maintenance worker with beat beside it,
            which sends its sweeps (a program of its own, as in `make run`)."""
            if program == "maintenance":
                self.procs.append(start_as_make_run("beat", self.env))
            proc = start_as_make_run(program, self.env)
            self.procs.append(proc)
            return proc

    c = Cluster()
    yield c
    for proc in reversed(c.procs):
        proc.stop(signal.SIGKILL)


def ready(*workers):
    assert eventually(lambda: all(" ready." in w.output() for w in workers), 60, 0.1), [
        w.output()[-2000:] for w in workers
    ]


def running_jobs(worker):
    """Webhook jobs the worker took and has not finished (its log at level info)."""
    log = worker.output()
    return log.count("deliver_webhooks[") - 2 * log.count("succeeded in")


def hook_subscriber(queue, name, url):
    subscriber, _ = create_subscriber(name, subscribe=["db"], webhook_url=url)
    subscribing.subscribe(subscriber, queue)
    return subscriber


def test_a_healthy_subscriber_is_posted_to_promptly_beside_a_dripping_one(cluster):
    cluster.services()
    cluster.env["MQ_WEBHOOK_TIMEOUT_SECS"] = "4"  # the contract's 10 s, shortened for the test
    dripper, healthy = Dripper(interval=1.0, lasting=30.0), Receiver()
    try:
        queue = Queue.objects.create(name="db")
        slow = hook_subscriber(queue, "slow", dripper.url)
        hook_subscriber(queue, "fast", healthy.url)
        _, token = create_subscriber("app", publish=["db"])
        cluster.web()
        ready(cluster.worker("worker"), cluster.worker("maintenance"))
        publish_over_http(cluster.daphne, token)
        assert eventually(lambda: dripper.open == 1 and len(healthy.requests) == 1, 10)
        latencies, answered = [], []
        for _ in range(5):  # each while the slow subscriber's post is under way
            before, sent = len(healthy.requests), time.monotonic()
            publish_over_http(cluster.daphne, token)
            answered.append(time.monotonic() - sent)
            assert eventually(lambda b=before: len(healthy.requests) > b, 5)
            latencies.append(healthy.requests[-1][0] - sent)
            assert dripper.open == 1
        # The dripping post fails at the deadline: its thread is free again.
        assert eventually(lambda: DeliveryAttempt.objects.filter(delivery__subscriber=slow).exists(), 6)
    finally:
        dripper.close()
        healthy.close()
    print(f"healthy subscriber beside a dripping one: publish to post {[round(x, 3) for x in latencies]} s")
    print(f"  (of which the publish request itself: {[round(x, 3) for x in answered]} s)")
    assert max(latencies) < 1.5  # the dripping post ran for 4 s meanwhile
    attempt = DeliveryAttempt.objects.filter(delivery__subscriber=slow).earliest("at")
    print(f"the dripping post failed after {attempt.duration_ms} ms: {attempt.error}")
    assert not attempt.ok and 4000 <= attempt.duration_ms < 4500 and "within 4 s" in attempt.error


@pytest.mark.parametrize("mode", ["services", "embedded"])
def test_sweeps_go_on_while_every_webhook_thread_is_held_by_a_dripping_endpoint(cluster, mode):
    getattr(cluster, mode)()
    run = run_command("worker")
    threads = int(run[run.index("-c") + 1])
    dripper = Dripper(interval=1.0, lasting=30.0)  # past the 10 s deadline: every post takes 10 s
    try:
        queue = Queue.objects.create(name="db", ack_timeout=1)
        for i in range(threads):
            hook_subscriber(queue, f"slow{i}", dripper.url)
        puller, _ = create_subscriber("puller", subscribe=["db"])
        subscribing.subscribe(puller, queue)
        _, token = create_subscriber("app", publish=["db"])
        cluster.web()
        ready(cluster.worker("worker"), cluster.worker("maintenance"))
        publish_over_http(cluster.daphne, token)
        assert eventually(lambda: dripper.open == threads, 15), dripper.open
        held_since = time.monotonic()
        # A lease whose ack deadline passes in 1 s: only a sweep gives it back.
        [leased] = ledger.lease_deliveries(puller, limit=1, holder="test:puller")
        leased_at = time.monotonic()
        assert eventually(lambda: Delivery.objects.get(pk=leased["id"]).status == Status.PENDING, 8)
        swept = time.monotonic() - leased_at
        busy = dripper.open
    finally:
        dripper.close()
    print(f"{mode}: the expired lease was swept back {swept:.3f} s after it was taken (deadline 1 s),")
    print(f"  while {busy} of {threads} webhook threads were held by dripping posts")
    assert busy == threads and time.monotonic() - held_since < 10  # still all held when swept
    assert swept < 3.0


def test_a_killed_workers_claim_lapses_within_seconds_and_another_job_takes_the_subscriber(cluster):
    cluster.services()
    dripper = Dripper(interval=1.0, lasting=30.0)
    try:
        queue = Queue.objects.create(name="db", ack_timeout=1)
        slow = hook_subscriber(queue, "slow", dripper.url)
        _, token = create_subscriber("app", publish=["db"])
        cluster.web()
        workers = [cluster.worker("worker"), cluster.worker("worker")]
        ready(*workers, cluster.worker("maintenance"))
        publish_over_http(cluster.daphne, token)
        assert eventually(lambda: dripper.open == 1, 10)
        claims = redis.Redis.from_url(cluster.redis.url)
        key = f":1:webhook-job:{slow.pk}"
        time.sleep(4)  # longer than the claim lives: renewed while the job runs
        assert b"running:" in (claims.get(key) or b"")
        [posting] = [w for w in workers if running_jobs(w)]
        posting.stop(signal.SIGKILL)
        killed = time.monotonic()
        # One read each time: the claim may lapse between two (it did, and None is not a claim).
        assert eventually(lambda: b"running:" not in (claims.get(key) or b""), 10)
        lapsed = time.monotonic() - killed
        assert eventually(lambda: dripper.connections[-1] > killed, 10)
        retaken = dripper.connections[-1] - killed
    finally:
        dripper.close()
    print(f"killed worker's claim lapsed {lapsed:.3f} s after the kill; the subscriber was posted")
    print(f"  to again by the other worker {retaken:.3f} s after the kill")
    assert lapsed <= 3.5 and retaken <= 5.0
