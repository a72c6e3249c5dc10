"""Pausing a subscription end to end, as services would use it: a real Daphne, a real Celery
worker with beat sweeping every second, a real webhook receiver. While paused, nothing is
posted however many sweeps pass; the resume over REST gets everything owed posted at once (its
wake-up enqueues the job), in order on an ordered queue. The same over a websocket: a socket
open through the pause is sent nothing, and the resume sends it the line from its head."""

import json
import signal
import time

import pytest

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.http import post, publish_over_http, request
from tests.support.personas import subscribed_owner
from tests.support.servers import eventually, start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def services(receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    redis = start_redis()
    env = {"REDIS_URL": redis.url, "MQ_WEBHOOK_ALLOW_PRIVATE": "true"}
    queue = Queue.objects.create(name="db", ordered=True)
    monitor, monitor_token = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscription, _ = subscribing.subscribe(monitor, queue)
    _, app_token = create_subscriber("app", publish=["db"])
    web, worker = start_daphne(env), start_worker(env)
    yield {"web": web, "worker": worker, "monitor": monitor_token, "app": app_token, "id": subscription.pk}
    worker.stop(signal.SIGTERM)
    web.stop(signal.SIGTERM)
    redis.stop(signal.SIGKILL)


def acked():
    return Delivery.objects.filter(status=Status.ACKED).count()


def test_a_paused_webhook_subscription_gets_nothing_then_everything_in_order_on_resume(services, receiver):
    web, sub_id = services["web"], services["id"]
    publish_over_http(web, services["app"], 1)  # the worker is up and posting
    deadline = time.monotonic() + 30
    while acked() < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert acked() == 1, services["worker"].output()[-3000:]
    status, answer = post(web, services["monitor"], f"/api/subscriptions/{sub_id}/pause", None)
    assert status == 200 and answer["paused"] is True
    published = publish_over_http(web, services["app"], 5, start=1)
    assert [m["deliveries"] for m in published] == [1] * 5  # still owed
    time.sleep(3)  # three sweeps, and the publish's own wake-up
    assert len(receiver.requests) == 1
    assert set(Delivery.objects.exclude(status=Status.ACKED).values_list("status", flat=True)) == {
        Status.PENDING
    }
    _, listed = request(web, services["monitor"], "GET", "/api/subscriptions")
    assert [s["paused"] for s in listed["subscriptions"]] == [True]
    resumed_at = time.monotonic()
    status, answer = post(web, services["monitor"], f"/api/subscriptions/{sub_id}/resume", None)
    assert status == 200 and answer["paused"] is False
    while acked() < 6 and time.monotonic() < resumed_at + 20:
        time.sleep(0.05)
    assert acked() == 6, services["worker"].output()[-3000:]
    print(f"all owed posted {time.monotonic() - resumed_at:.2f} s after the resume")
    assert [json.loads(body)["payload"]["n"] for *_, body in receiver.requests] == list(range(6))


def test_a_socket_is_sent_nothing_while_paused_and_the_line_from_its_head_on_resume(server):
    from websockets.sync.client import connect

    from tests.e2e.test_websocket import receive

    _, _, token, subscription = subscribed_owner(ordered=True)
    with connect(f"{server.ws}?token={token}") as ws:
        publish_over_http(server, token, 1)
        (first,) = receive(ws, 1, ack=False)
        status, _ = post(server, token, f"/api/subscriptions/{subscription.pk}/pause", None)
        assert status == 200
        ws.send(json.dumps({"type": "ack", "ids": [first["id"]]}))  # in flight: it finishes
        publish_over_http(server, token, 3, start=1)
        assert receive(ws, 1, timeout=2.5) == []  # past a recheck (2 s): nothing
        post(server, token, f"/api/subscriptions/{subscription.pk}/resume", None)
        assert [f["payload"]["n"] for f in receive(ws, 3, timeout=5)] == [1, 2, 3]
        assert eventually(lambda: Delivery.objects.filter(status=Status.ACKED).count() == 4)
