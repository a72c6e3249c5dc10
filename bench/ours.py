"""This server as one of the compared systems: its two modes (services: PostgreSQL and Redis,
`MQ_WEB_PROCESSES` Daphne processes on one socket as `make run` starts them; embedded: SQLite
and one Daphne process), its three transports for the workloads' publishers and consumers
(REST, WS, WS batch), the provisioning of a run's queues and subscribers, and `Ours`, which
gives the workloads what every system gives them (prepare, publisher, stored, unacked;
systems.py). Its clients on the wire (OursPublisherRest, OursConsumerWs, ...) are in systems.py
beside the peers'.
"""

import json
import os
import sqlite3
import subprocess
import sys

import psycopg
import systems
from harness import ROOT
from workloads import W2_SUBSCRIBERS

SERVICES_REDIS = "redis://127.0.0.1:6379/12"
PG_DB = "mqsite_cmp_services"
GROWTH_DB = "mqsite_cmp_growth"
TRANSPORTS = ("rest", "ws", "ws-batch")
MODES = ("services", "embedded")
# W1a publishes one message a frame, so over WS batch it would be WS's W1a again: not run.
SAME_OVER_BATCH = {"ws-batch": {"W1a"}}


class Ours:
    """One mode of this server behind one Daphne process, one publishing transport."""

    def __init__(self, mode, transport, port, db_url, tokens, suffix=""):
        self.mode, self.transport, self.port, self.db_url = mode, transport, port, db_url
        self.tokens, self.suffix = tokens, suffix
        self.name = f"ours-{mode}-{transport}"

    def queue(self, run):
        return f"{run}-{self.transport}{self.suffix}"

    async def prepare(self, run, n, consumer="ws"):
        q = self.queue(run)
        if self.transport == "ws-batch" and consumer == "ws":
            consumer = "ws-batch"  # W2's, W3's and W6's subscribers subscribe with batch: true
        return {
            "system": f"ours-{consumer}",
            "port": self.port,
            "queue": q,
            "tokens": [self.tokens[f"{q}-{k}"] for k in range(n)],
        }

    async def publisher(self, run, transport=None):
        transport = transport or self.transport
        token = self.tokens[f"pub{self.suffix}"]
        if transport == "rest":
            return systems.OursPublisherRest(self.port, token, self.queue(run))
        if transport == "ws-batch":
            return await systems.OursPublisherWsBatch(self.port, token, self.queue(run)).connect()
        return await systems.OursPublisherWs(self.port, token, self.queue(run)).connect()

    async def backlog_publisher(self, run):
        return await self.publisher(run, "rest")  # filling W4's backlog is not measured

    def _query(self, sql, params):
        if self.db_url.startswith("sqlite"):
            with sqlite3.connect(self.db_url.removeprefix("sqlite:///")) as conn:
                return conn.execute(sql.replace("%s", "?"), params).fetchone()[0]
        with psycopg.connect(self.db_url) as conn:
            return conn.execute(sql, params).fetchone()[0]

    async def stored(self, run, n):
        return self._query(
            "SELECT count(*) FROM queues_message m JOIN queues_queue q ON q.id = m.queue_id "
            "WHERE q.name = %s",
            [self.queue(run)],
        )

    async def unacked(self, run, n):
        return self._query(
            "SELECT count(*) FROM delivery_delivery d JOIN queues_queue q ON q.id = d.queue_id "
            "WHERE q.name = %s AND d.status <> 'acked'",
            [self.queue(run)],
        )

    async def deliveries(self, run):
        return self._query(
            "SELECT count(*) FROM delivery_delivery d JOIN queues_queue q ON q.id = d.queue_id "
            "WHERE q.name = %s",
            [self.queue(run)],
        )


def n_subscribers(workload):
    return W2_SUBSCRIBERS if workload == "w2" else 1


def provision(env, runs, suffix="", idle=0):
    """Queues `<run>-<transport><suffix>` with their subscribers, a publisher, idle subscribers."""
    queues = [f"{r}-{t}{suffix}" for r in runs for t in TRANSPORTS]
    spec = {
        "queues": queues,
        "subscribers": [{"name": f"pub{suffix}", "publish": ["*"]}]
        + [
            {"name": f"{q}-{k}", "subscribe": [q]}
            for q in queues
            for k in range(n_subscribers(q.split("-")[0]))
        ],
    }
    if idle:
        spec["idle"] = {"queue": f"idle{suffix}", "count": idle, "prefix": f"idle{suffix}"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "django_setup.py")],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"provisioning failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_env(mode, db_url):
    env = {**os.environ, "DATABASE_URL": db_url, "MQ_THROTTLE_RATE": "1000000/s", "DEBUG": "false"}
    if mode == "services":
        env["REDIS_URL"] = SERVICES_REDIS
    else:
        env.pop("REDIS_URL", None)
    return env


def web_processes(mode, asked=None):
    """Daphne processes for `mode`, as `make run` starts them: MQ_WEB_PROCESSES (default the
    CPU count) in the services mode, always one in the embedded mode (SQLite)."""
    if mode == "embedded":
        return 1
    return asked or int(os.environ.get("MQ_WEB_PROCESSES") or os.cpu_count() or 1)
