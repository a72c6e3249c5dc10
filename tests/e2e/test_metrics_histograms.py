"""/metrics' latency histograms and process_* against real servers: two Daphne processes share
one PROMETHEUS_MULTIPROC_DIR, as `make run`'s do, and whichever answers a scrape adds up the
publishes and acks of both (REST on one, websocket on the other), and shows each one's
process_* figures; a process that stops leaves its counts and takes its figures with it."""

import json

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from delivery import subscribing
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.dashboard.test_metrics import parse_metrics, value
from tests.support.servers import E2E_REDIS, eventually, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)
TOKEN = "scrape-token"


def scrape(server):
    r = httpx.get(f"{server.http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200
    return parse_metrics(r.text)


def pids_of(samples, name):
    return {dict(labels)["pid"]: dict(labels)["role"] for n, labels in samples if n == name}


def frames_until(ws, kind, count):
    """The frames up to the `count`-th of type `kind` (others in between kept too)."""
    got = []
    while sum(f["type"] == kind for f in got) < count:
        got.append(json.loads(ws.recv(timeout=10)))
    return got


def test_every_process_publishes_and_acks_add_up_on_any_scrape(tmp_path):
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    subscribing.subscribe(owner, queue)
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = {"REDIS_URL": E2E_REDIS, "PROMETHEUS_MULTIPROC_DIR": str(folder), "MQ_METRICS_TOKEN": TOKEN}
    rest, sockets = start_daphne(env), start_daphne(env)
    try:
        # Before any traffic: each transport's series at zero, and both processes' figures
        fresh = scrape(rest)
        assert value(fresh, "mq_publish_duration_seconds_count", transport="rest") == 0
        assert value(fresh, "mq_publish_duration_seconds_count", transport="websocket") == 0
        assert pids_of(fresh, "process_resident_memory_bytes") == {
            str(rest.proc.pid): "web",
            str(sockets.proc.pid): "web",
        }

        # When three publishes go over REST to one process (one of them a batch of two) ...
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=rest.http, headers=auth, timeout=10) as api:
            for body in ({"event": "e", "payload": 1}, {"event": "e", "payload": 2}):
                assert api.post("/api/queues/db/messages", json=body).status_code == 201
            batch = {"messages": [{"event": "e", "payload": 3}, {"event": "e", "payload": 4}]}
            assert api.post("/api/queues/db/messages", json=batch).status_code == 201
            # ... two of the four are pulled and acked there ...
            pulled = api.get("/api/deliveries", params={"limit": 2}).json()["deliveries"]
            acked = api.post("/api/deliveries/ack", json={"ids": [d["id"] for d in pulled]}).json()
            assert acked["acked"] == 2
        # ... and on the other, a socket publishes one and acks the three it is handed
        with ws_connect(f"{sockets.ws}?token={token}") as ws:
            ws.send(json.dumps({"type": "publish", "queue": "db", "event": "e", "payload": 5}))
            ws.send(json.dumps({"type": "subscribe", "queue": "db"}))
            messages = [f for f in frames_until(ws, "message", 3) if f["type"] == "message"]
            ws.send(json.dumps({"type": "ack", "ids": [m["id"] for m in messages]}))
            # (an ack frame has no answer: its write is seen when it is counted)
            acks = lambda: value(scrape(rest), "mq_delivery_latency_seconds_count", queue="db")  # noqa: E731
            assert eventually(lambda: acks() == 5, timeout=10), acks()

        # Then either process's scrape counts all of it, by transport and by queue
        for server in (rest, sockets):
            samples = scrape(server)
            assert value(samples, "mq_publish_duration_seconds_count", transport="rest") == 3
            assert value(samples, "mq_publish_duration_seconds_count", transport="websocket") == 1
            assert value(samples, "mq_delivery_latency_seconds_count", queue="db") == 5
            latency_sum = value(samples, "mq_delivery_latency_seconds_sum", queue="db")
            assert 0 < latency_sum < 5 * 30  # seconds, not milliseconds
            assert value(samples, "mq_delivery_latency_seconds_bucket", queue="db", le="+Inf") == 5
            assert 0 < value(samples, "mq_publish_duration_seconds_sum", transport="rest") < 3 * 10
            assert len(pids_of(samples, "process_cpu_seconds_total")) == 2

        # When the socket's process stops: its counts stay, its process_* go
        sockets.stop()
        samples = scrape(rest)
        assert value(samples, "mq_delivery_latency_seconds_count", queue="db") == 5
        assert value(samples, "mq_publish_duration_seconds_count", transport="websocket") == 1
        assert pids_of(samples, "process_open_fds") == {str(rest.proc.pid): "web"}
    finally:
        rest.stop()
        sockets.stop()
