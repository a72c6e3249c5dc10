"""Logs an on-call engineer can use, from real processes as `make run` starts them: with
MQ_LOG_FORMAT=json every line is one JSON object with time, level, logger and message; a line
logged while serving a request carries the request's id, the one its X-Request-ID answer names
(the caller's own when safe); a webhook job's lines name its subscriber, and a failed post's
its delivery and message; and no token appears in any line, even one a caller sent in the URL."""

import json
import signal

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from delivery import subscribing
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.receivers import Receiver
from tests.support.servers import eventually, start_as_make_run, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)

JSON_LOGS = {"MQ_LOG_FORMAT": "json", "LOG_LEVEL": "INFO"}
A_FORGED_TOKEN = "mq_ThisIsNotAnIssuedTokenButLooksLikeOne0123456"


def json_lines(text):
    """Every line of a log, parsed: each must be one JSON object with the four fields."""
    lines = []
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)  # fails the test on a line that is not JSON
        assert {"time", "level", "logger", "message"} <= set(record), record
        lines.append(record)
    return lines


@pytest.fixture
def web():
    server = start_daphne(JSON_LOGS, daphne_args=["-v", "0"])  # as supervisord.conf starts it
    yield server
    server.stop()


def test_a_request_s_lines_carry_the_id_its_answer_names(web):
    Queue.objects.create(name="db")
    _, token = create_subscriber("app", publish=["db"])
    mine = httpx.post(
        f"{web.http}/api/queues/db/messages",
        json={"event": "create", "payload": {"n": 1}},
        headers={"Authorization": f"Bearer {token}", "X-Request-ID": "checkout-42.retry:1"},
    )
    assert mine.status_code == 201 and mine.headers["X-Request-ID"] == "checkout-42.retry:1"
    unsafe = httpx.get(f"{web.http}/api/deliveries", headers={"X-Request-ID": "a b<script>" + "x" * 200})
    made = unsafe.headers["X-Request-ID"]
    assert unsafe.status_code == 401 and len(made) == 32 and int(made, 16) >= 0  # a new one
    assert len({made, httpx.get(f"{web.http}/healthz").headers["X-Request-ID"]}) == 2

    def logged():
        lines = json_lines(open(web.log.name).read())
        return [r for r in lines if r["logger"] == "mqsite.access"]

    assert eventually(lambda: len(logged()) >= 3)
    by_id = {r["request_id"]: r["message"] for r in logged()}
    assert by_id["checkout-42.retry:1"].startswith("POST /api/queues/db/messages 201")
    assert by_id[made].startswith("GET /api/deliveries 401")


def test_no_token_appears_in_any_line(web):
    Queue.objects.create(name="db")
    _, token = create_subscriber("app", publish=["db"], subscribe=["db"])
    httpx.get(f"{web.http}/api/deliveries?token={A_FORGED_TOKEN}")
    httpx.get(f"{web.http}/api/deliveries", headers={"Authorization": f"Bearer {A_FORGED_TOKEN}"})
    httpx.get(f"{web.http}/api/nowhere/{token}", headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(ConnectionClosed):  # closed with 4401
        with connect(f"{web.ws}?token={A_FORGED_TOKEN}", open_timeout=5) as ws:
            ws.recv(timeout=5)
    with connect(f"{web.ws}?token={token}", open_timeout=5) as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "db", "token": token}))
        ws.recv(timeout=5)
    web.stop(signal.SIGTERM)
    text = open(web.log.name).read()
    json_lines(text)
    assert "mq_" in text  # the lines are there, blanked where they held a token
    assert A_FORGED_TOKEN not in text and token not in text


def test_a_webhook_job_s_lines_name_its_subscriber_delivery_and_message(settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver(default=(500, 0))
    queue = Queue.objects.create(name="db")
    hooked, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(hooked, queue)
    _, token = create_subscriber("app", publish=["db"])
    env = {**JSON_LOGS, "REDIS_URL": "", "MQ_WEBHOOK_ALLOW_PRIVATE": "true"}
    worker = start_as_make_run("worker", env)
    web = start_daphne(env, daphne_args=["-v", "0"])
    try:
        r = httpx.post(
            f"{web.http}/api/queues/db/messages",
            json={"event": "create", "payload": {}},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 201
        message_id = r.json()["id"]

        def failed_line():
            for record in json_lines(worker.output()):
                if record["message"].startswith("webhook of") and "failed" in record["message"]:
                    return record
            return None

        assert eventually(failed_line, timeout=30), worker.output()[-3000:]
        line = failed_line()
        assert line["subscriber"] == hooked.pk and line["message_id"] == message_id
        assert line["delivery_id"] and line["task_id"]
    finally:
        worker.stop(signal.SIGKILL)
        web.stop()
