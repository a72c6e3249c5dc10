"""Lease extension end to end: a real Daphne, a real Celery worker whose beat sweeps overdue leases
every second, real websocket and HTTP clients. A worker slower than its queue's ack timeout
keeps its delivery by extending the lease: no other connection, socket or pull, is handed it,
and its ack counts its one attempt. Each test also runs without the extension, which must
then see the delivery handed out again (so that the test can fail)."""

import json
import signal
import time

import pytest
from websockets.sync.client import connect

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.http import request
from tests.support.servers import eventually, frames_within, start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)
extending = pytest.mark.parametrize("extending", [True, False], ids=["extending", "not-extending"])


@pytest.fixture
def web_and_worker():
    """Daphne and a worker with beat (the sweeper) on a private Redis, and a subscriber of a
    queue whose ack timeout is 1 s."""
    redis = start_redis()
    env = {"REDIS_URL": redis.url}
    queue = Queue.objects.create(name="jobs", ack_timeout=1)
    worker_sub, token = create_subscriber("transcoder", publish=["jobs"], subscribe=["jobs"])
    subscribing.subscribe(worker_sub, queue)
    web, worker = start_daphne(env), start_worker(env)
    try:
        # the sweeper runs before the test's clock starts
        assert eventually(lambda: "delivery.tasks.sweep" in worker.output(), timeout=30), worker.output()
        yield web, token
    finally:
        worker.stop()
        web.stop()
        redis.stop(signal.SIGKILL)


def publish_job(web, token):
    status, _ = request(
        web, token, "POST", "/api/queues/jobs/messages", {"event": "encode", "payload": {"video": 7}}
    )
    assert status == 201


@extending
def test_a_socket_that_extends_keeps_its_delivery_from_another_connection(web_and_worker, extending):
    web, token = web_and_worker
    with connect(f"{web.ws}?token={token}") as a:
        publish_job(web, token)
        first = json.loads(a.recv(timeout=10))
        assert first["type"] == "message" and first["attempt"] == 1
        if extending:
            a.send(json.dumps({"type": "extend", "ids": [first["id"]], "seconds": 30}))
        # Past the 1 s deadline and the 1 s backoff of an expired lease, the sweeper running;
        # then a second connection of the same subscriber, and both wait past the 2 s recheck.
        time.sleep(2.5)
        with connect(f"{web.ws}?token={token}") as b:
            seen = frames_within(b, 2.5) + frames_within(a, 0.1)
            if not extending:
                again = ("message", first["id"], 2)
                deadline = time.monotonic() + 10  # a loaded machine's sweeper and recheck run late
                while again not in [(f["type"], f["id"], f["attempt"]) for f in seen]:
                    assert time.monotonic() < deadline, seen
                    seen += frames_within(b, 0.5) + frames_within(a, 0.1)
                return
            assert seen == []  # nothing handed out again, and no error frame for the extend
            a.send(json.dumps({"type": "ack", "ids": [first["id"]]}))
            assert frames_within(a, 0.5) == []  # no unknown_ids: it was still A's to ack
    assert eventually(lambda: Delivery.objects.get(pk=first["id"]).status == Status.ACKED)
    assert Delivery.objects.get(pk=first["id"]).attempt == 1


@extending
def test_a_slow_pull_worker_that_extends_past_the_ack_timeout_gets_no_redelivery(web_and_worker, extending):
    web, token = web_and_worker
    publish_job(web, token)
    _, pulled = request(web, token, "GET", "/api/deliveries?limit=1")
    (job,) = pulled["deliveries"]
    assert job["attempt"] == 1
    # It works for 4 s, four times its ack timeout, saying so every half second, while another
    # worker of the same service pulls.
    others = []
    started = time.monotonic()
    while time.monotonic() - started < 4:
        if extending:
            status, answer = request(
                web, token, "POST", "/api/deliveries/extend", {"ids": [job["id"]], "seconds": 2}
            )
            assert status == 200 and answer == {"extended": 1, "unknown": []}
        others += request(web, token, "GET", "/api/deliveries?limit=10")[1]["deliveries"]
        time.sleep(0.5)
    _, acked = request(web, token, "POST", "/api/deliveries/ack", {"ids": [job["id"]]})
    row = Delivery.objects.get(pk=job["id"])
    if extending:
        assert others == []
        assert acked == {"acked": 1, "unknown": []}
        assert row.status == Status.ACKED and row.attempt == 1
    else:
        assert [(d["id"], d["attempt"]) for d in others][:1] == [(job["id"], 2)]
