"""/metrics' latency histograms and process_* against real servers: two Daphne processes share
one PROMETHEUS_MULTIPROC_DIR, as `make run`'s do, and whichever answers a scrape adds up the
publishes and acks of both (REST on one, websocket on the other), and shows each one's
process_* figures; a process that stops leaves its counts and takes its figures with it. The
webhook worker's acks (it serves no HTTP) are counted on the web process's scrape. And
every metric the operations manual's alert rules and Grafana dashboard name is on a real scrape
(docs/operations/; tests/mqsite/test_prometheus_rules.py checks the rules themselves)."""

import json
import re
import signal
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import yaml
from django.utils import timezone
from websockets.sync.client import connect as ws_connect

from analytics import load
from delivery import health, ledger, subscribing
from delivery.models import Delivery, WebhookHealth
from queues.models import Queue
from subscribers.models import Heartbeat, ServerProcess
from subscribers.provisioning import create_subscriber
from tests.dashboard.test_metrics import parse_metrics, value
from tests.support.receivers import Receiver
from tests.support.run_folders import write_run
from tests.support.servers import E2E_REDIS, eventually, start_as_make_run, start_daphne

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


# --- what the operations manual's alert rules and dashboard name ---------------------------------

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations"
NAMED = re.compile(r"\b(?:mq|process)_[a-z0-9_]+\b")


def names_in_rules_and_dashboard():
    rules = yaml.safe_load((OPERATIONS / "prometheus-rules.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((OPERATIONS / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [dashboard["templating"]["list"][0]["definition"]]
    return {name for expr in exprs for name in NAMED.findall(expr)}


def test_every_metric_the_alert_rules_and_the_dashboard_name_is_on_a_real_scrape(tmp_path):
    # Given a world where every family has something to say: a backlog, a dead letter, a
    # failing and disabled webhook, a worker's beat, a sweep, an open socket, an ack
    queue = Queue.objects.create(name="db")
    owner, token = create_subscriber("owner", publish=["db"], subscribe=["db"])
    hook, _ = create_subscriber("hook", subscribe=["db"], webhook_url="https://hooks.example.com/hook")
    subscribing.subscribe(owner, queue)
    subscribing.subscribe(hook, queue)
    now = timezone.now()
    WebhookHealth.objects.create(subscriber=hook, failures=60, first_failure_at=now, disabled_since=now)
    ServerProcess.objects.create(name="webhooks@host", kind="worker", last_beat=now + timedelta(minutes=5))
    Heartbeat.objects.create(name=health.SWEEP, at=now)
    # ... and an analytics run loaded, with its recent windows
    out = str(tmp_path / "analytics")
    latency = {"latency_p50_ms": 20.0, "latency_p95_ms": 90.0, "latency_p99_ms": 150.0}
    event = {"queue": "db", "event": "e", "messages": 3, "deliveries": 6, "dead": 1, **latency}
    load.load_run(
        out,
        write_run(
            out,
            events=[event],
            subscribers=[{"subscriber": "owner", **latency}],
            event_windows=[{"window": w, "since": now, **event} for w in ("1h", "24h")],
            subscriber_windows=[
                {"window": w, "since": now, "subscriber": "owner", **latency} for w in ("1h", "24h")
            ],
        ),
    )
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(folder), "MQ_METRICS_TOKEN": TOKEN, "MQ_METRICS_MAX_AGE_SECS": "0"}
    server = start_daphne(env)
    try:
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.http, headers=auth, timeout=10) as api:
            batch = {"messages": [{"event": "e", "payload": i} for i in range(3)]}
            assert api.post("/api/queues/db/messages", json=batch).status_code == 201
            pulled = api.get("/api/deliveries", params={"limit": 1}).json()["deliveries"]
            assert api.post("/api/deliveries/ack", json={"ids": [pulled[0]["id"]]}).json()["acked"] == 1
        ledger.kill_deliveries(Delivery.objects.filter(pk=Delivery.objects.filter(subscriber=hook)[0].pk))
        with ws_connect(f"{server.ws}?token={token}"):
            # When it is scraped
            scraped = {name for name, _ in scrape(server)}
    finally:
        server.stop()

    # Then every metric the rules and the dashboard name is there
    named = names_in_rules_and_dashboard()
    assert {"mq_delivery_latency_seconds_bucket", "process_cpu_seconds_total", "mq_webhook_disabled"} <= named
    assert named - scraped == set()


def test_a_webhook_worker_s_acks_are_counted_on_the_web_process_s_scrape(tmp_path, settings):
    # Given a webhook subscriber, and the webhook worker as make run starts it, beside a web
    # process, both on one folder
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver(default=(200, 0))
    queue = Queue.objects.create(name="db")
    hooked, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(hooked, queue)
    _, token = create_subscriber("app", publish=["db"])
    folder = tmp_path / "metrics"
    folder.mkdir()
    env = {
        "REDIS_URL": "",
        "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
        "MQ_METRICS_TOKEN": TOKEN,
    }
    worker = start_as_make_run("worker", env)
    web = start_daphne(env)
    try:
        # When a message is published, and posted by the worker with success
        r = httpx.post(
            f"{web.http}/api/queues/db/messages",
            json={"event": "create", "payload": {}},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 201

        # Then the web process's scrape counts the worker's ack, and shows the worker's figures
        acks = lambda: value(scrape(web), "mq_delivery_latency_seconds_count", queue="db")  # noqa: E731
        assert eventually(lambda: acks() == 1, timeout=30), worker.output()[-3000:]
        roles = pids_of(scrape(web), "process_resident_memory_bytes")
        assert roles == {str(web.proc.pid): "web", str(worker.proc.pid): "webhooks"}
    finally:
        worker.stop(signal.SIGKILL)
        web.stop()
        receiver.close()
