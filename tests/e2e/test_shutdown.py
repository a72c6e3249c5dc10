"""Graceful shutdown with real processes: SIGTERM on Daphne and on a Celery worker finishes or
hands back what they hold, and a restart resumes it."""

import json
import signal
import threading
import time
from functools import partial

import httpx
import pytest
from websockets.sync.client import connect

from delivery import subscribing
from delivery.models import Delivery, DeliveryAttempt, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.personas import subscribed_owner
from tests.support.publish import publish
from tests.support.receivers import Receiver
from tests.support.servers import eventually, start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)


eventually = partial(eventually, timeout=10)


def sorted_statuses():
    return sorted(Delivery.objects.values_list("status", flat=True))


@pytest.fixture
def queue_and_token():
    queue, _, token, _ = subscribed_owner()  # ack timeout 30 s: far longer than the test waits
    return queue, token


def test_a_stopped_daphne_hands_back_what_its_sockets_held_and_a_restart_delivers_it_again(queue_and_token):
    queue, token = queue_and_token
    publish(queue, 5)
    web = start_daphne()
    try:
        # A kept-alive HTTP connection: with one open, Daphne's own cancel of the applications
        # fails (daphne 4.2), and only the server's shutdown hook releases the sockets.
        keep_alive = httpx.Client(base_url=web.http)
        assert keep_alive.get("/healthz").status_code == 200
        with connect(f"{web.ws}?token={token}", close_timeout=0.5) as ws:
            held = [json.loads(ws.recv(timeout=5)) for _ in range(5)]
            assert sorted_statuses() == [Status.INFLIGHT] * 5
            started = time.monotonic()
            web.proc.send_signal(signal.SIGTERM)
            web.proc.wait(timeout=20)
        assert time.monotonic() - started < 10 and web.proc.returncode == 0
        # back to pending at once, not after the 30 s ack deadline
        assert sorted_statuses() == [Status.PENDING] * 5
        assert set(Delivery.objects.values_list("lease_holder", flat=True)) == {""}
        keep_alive.close()
    finally:
        web.stop()
    web = start_daphne(port=web.port)
    try:
        with connect(f"{web.ws}?token={token}") as ws:
            again = [json.loads(ws.recv(timeout=5)) for _ in range(5)]
            assert [f["id"] for f in again] == [f["id"] for f in held]
            ws.send(json.dumps({"type": "ack", "ids": [f["id"] for f in again]}))
            assert eventually(lambda: sorted_statuses() == [Status.ACKED] * 5)
    finally:
        web.stop()


def test_a_long_poll_answers_and_does_not_hold_up_a_stopping_daphne(queue_and_token):
    _, token = queue_and_token
    web = start_daphne()
    try:
        with httpx.Client(base_url=web.http, headers={"Authorization": f"Bearer {token}"}) as client:
            answers = []
            poll = threading.Thread(
                target=lambda: answers.append(client.get("/api/deliveries?wait=30", timeout=40))
            )
            poll.start()
            time.sleep(1)  # it is waiting now
            started = time.monotonic()
            web.proc.send_signal(signal.SIGTERM)
            web.proc.wait(timeout=40)
            poll.join(timeout=40)
        assert time.monotonic() - started < 10, "the long poll held the server up"
        assert web.proc.returncode == 0
        assert answers and answers[0].status_code == 200 and answers[0].json() == {"deliveries": []}
    finally:
        web.stop()


def test_a_worker_told_to_stop_mid_post_finishes_its_batch_and_a_restart_posts_the_rest(settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver(script=[(200, 3.0)])  # the first post takes 3 s: SIGTERM comes during it
    redis = start_redis()
    env = {"REDIS_URL": redis.url, "MQ_WEBHOOK_ALLOW_PRIVATE": "true"}
    queue = Queue.objects.create(name="db")
    monitor, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(monitor, queue)
    worker = start_worker(env)
    try:
        publish(queue, 60)  # three jobs' batches (20 each)
        assert eventually(lambda: receiver.requests, timeout=30), worker.output()[-3000:]
        started = time.monotonic()
        worker.stop(signal.SIGTERM, timeout=30)
        assert worker.proc.returncode is not None and time.monotonic() - started < 20
        # The batch under way was posted and acked, and no more was leased (the job did not go
        # on through the backlog); nothing stays leased to the stopped worker.
        assert Delivery.objects.filter(status=Status.ACKED).count() >= 1
        assert Delivery.objects.filter(status=Status.PENDING).count() >= 20
        assert Delivery.objects.filter(status=Status.INFLIGHT).count() == 0
        worker = start_worker(env)
        assert eventually(lambda: sorted_statuses() == [Status.ACKED] * 60, timeout=40), worker.output()[
            -3000:
        ]
        got = sorted(json.loads(body)["payload"]["n"] for *_, body in receiver.requests)
        assert got == list(range(60)), "each posted once: none lost, none repeated"
        assert set(DeliveryAttempt.objects.values_list("number", flat=True)) == {1}
    finally:
        worker.stop(signal.SIGKILL)
        redis.stop(signal.SIGKILL)
        receiver.close()
