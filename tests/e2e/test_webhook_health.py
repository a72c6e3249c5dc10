"""A webhook that keeps failing, end to end: a real Daphne, a real Celery worker with beat
sweeping every second, a real receiver that answers 500. The worker disables the webhook after
the failures the settings ask for (small here), tells of it on mq.system, then posts nothing
however many sweeps pass while its deliveries stay pending with no attempt spent;
`manage.py webhook enable` gets everything owed posted, in order on an ordered queue."""

import io
import json
import signal
import time

import pytest
from django.core.management import call_command

from delivery import subscribing
from delivery.models import Delivery, Status, WebhookHealth
from queues.lookup import system_queue
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.http import publish_over_http
from tests.support.servers import start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def services(receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    redis = start_redis()
    env = {
        "REDIS_URL": redis.url,
        "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
        "MQ_WEBHOOK_DISABLE_FAILURES": "3",
        "MQ_WEBHOOK_DISABLE_AFTER_SECS": "0",
        "MQ_BACKOFF_BASE_SECS": "0.1",
        "MQ_BACKOFF_MAX_SECS": "0.2",
    }
    queue = Queue.objects.create(name="db", ordered=True, max_attempts=100)
    monitor, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(monitor, queue)
    watcher, _ = create_subscriber("watcher", subscribe=["mq.system"])
    subscribing.subscribe(watcher, system_queue(), "webhook.disabled")
    _, app_token = create_subscriber("app", publish=["db"])
    web, worker = start_daphne(env), start_worker(env)
    yield {"web": web, "worker": worker, "app": app_token, "monitor": monitor}
    worker.stop(signal.SIGTERM)
    web.stop(signal.SIGTERM)
    redis.stop(signal.SIGKILL)


def wait_for(check, secs):
    deadline = time.monotonic() + secs
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    return check()


def test_a_failing_webhook_is_disabled_by_the_worker_and_enabled_again_delivers_in_order(services, receiver):
    receiver.default = (500, 0)
    publish_over_http(services["web"], services["app"], 4)
    disabled = WebhookHealth.objects.filter(disabled_since__isnull=False)
    assert wait_for(disabled.exists, 30), services["worker"].output()[-3000:]
    assert disabled.get().disabled_after == 3
    # Told on mq.system, to the watcher's subscription
    told = Delivery.objects.filter(queue__name="mq.system")
    assert wait_for(told.exists, 10)
    payload = json.loads(told.select_related("message").get().message.payload_json)
    assert (
        payload["subscriber"] == "monitor"
        and payload["failures"] == 3
        and "HTTP 500" in payload["last_error"]
    )
    # Disabled: once its last post is settled (the job fails it after counting it), three
    # sweeps later nothing more is posted, nothing spent
    in_flight = Delivery.objects.filter(queue__name="db", status=Status.INFLIGHT)
    assert wait_for(lambda: not in_flight.exists(), 10)
    posts = len(receiver.requests)
    owed = sorted(Delivery.objects.filter(queue__name="db").values_list("id", "status", "attempt"))
    time.sleep(3)
    assert len(receiver.requests) == posts
    assert sorted(Delivery.objects.filter(queue__name="db").values_list("id", "status", "attempt")) == owed
    assert {status for _, status, _ in owed} == {Status.PENDING}
    # Enabled again: everything owed, in seq order
    receiver.default = (200, 0)
    call_command("webhook", "enable", "monitor", stdout=io.StringIO())
    acked = Delivery.objects.filter(queue__name="db", status=Status.ACKED)
    assert wait_for(lambda: acked.count() == 4, 20), services["worker"].output()[-3000:]
    posted = [json.loads(body)["payload"]["n"] for *_, body in receiver.requests[posts:]]
    assert posted == [0, 1, 2, 3]
