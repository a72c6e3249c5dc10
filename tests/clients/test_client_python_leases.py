"""The Python client keeps leases: extend() over REST, and listen() extending the lease of a
handler slower than its queue's ack timeout, against a real Daphne and a real Celery worker whose
beat sweeps overdue leases every second. The capped run (max_extension_secs=0) must see the
delivery handed out again, so that the extending run can fail."""

import logging
import signal
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from mqclient import Client

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.servers import eventually, start_daphne, start_redis, start_worker

# As test_client_python: the client does not depend on the server's database.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="the client, whatever the server's database: the SQLite pass of make test runs it",
    ),
]


def test_extend_moves_the_deadline_of_pulled_deliveries_and_names_the_unknown(server, logger):
    with Client(server.http, logger.token) as mq:
        mq.subscribe("db", "create")
        mq.publish("db", "create", {"n": 1})
        (job,) = mq.pull("db", limit=1)
        assert mq.extend([job], 600) == {"extended": 1, "unknown": []}
        deadline = Delivery.objects.get(pk=job.id).ack_deadline
        assert deadline > datetime.now(UTC) + timedelta(seconds=590)
        mq.ack(job)
        assert mq.extend(job.id, 60) == {"extended": 0, "unknown": [job.id]}  # acked: not in flight


@pytest.fixture
def web_and_sweeper():
    """Daphne and a worker with beat (the sweeper) on a private Redis; a subscriber of `jobs`,
    whose ack timeout is 1 s."""
    redis = start_redis()
    env = {"REDIS_URL": redis.url}
    queue = Queue.objects.create(name="jobs", ack_timeout=1)
    sub, token = create_subscriber("transcoder", publish=["jobs"], subscribe=["jobs"])
    subscribing.subscribe(sub, queue, "encode")
    web, worker = start_daphne(env), start_worker(env)
    try:
        assert eventually(lambda: "delivery.tasks.sweep" in worker.output(), timeout=30), worker.output()
        yield web, token
    finally:
        worker.stop()
        web.stop()
        redis.stop(signal.SIGKILL)


@pytest.mark.parametrize("capped", [False, True], ids=["extending", "capped"])
def test_listen_keeps_the_lease_of_a_handler_slower_than_the_ack_timeout(web_and_sweeper, capped, caplog):
    web, token = web_and_sweeper
    caplog.set_level(logging.WARNING, logger="mqclient")
    calls, others = [], []

    def handler(delivery):
        calls.append((delivery.id, delivery.attempt))
        if len(calls) == 1:
            time.sleep(4)  # four times the ack timeout

    with Client(web.http, token) as mq, Client(web.http, token) as other:
        limit = {"max_extension_secs": 0} if capped else {}
        thread = threading.Thread(
            target=mq.listen, args=(handler, [("jobs", "encode")]), kwargs={"extend_secs": 2, **limit}
        )
        thread.start()
        try:
            job = mq.publish("jobs", "encode", {"video": 7})
            assert eventually(lambda: calls)  # leased to the socket, its handler at work
            # another worker of the same service pulls while the handler works
            started = time.monotonic()
            while time.monotonic() - started < 3.5 and not others:
                others += other.pull("jobs", limit=10)
                time.sleep(0.3)
        finally:
            mq.stop()
            thread.join(20)
    row = Delivery.objects.get(message_id=job["id"])
    if capped:
        assert [(d.id, d.attempt) for d in others] == [(row.id, 2)]
        assert "no longer extended" in caplog.text
        return
    assert others == []
    assert calls == [(row.id, 1)]
    assert row.attempt == 1
    # acked when the handler returned (the stop waited for it), its one attempt counted
    assert eventually(lambda: Delivery.objects.get(pk=row.id).status == Status.ACKED)
    assert "no longer extended" not in caplog.text
