"""This server as one of the compared systems: its two modes (services: PostgreSQL and Redis,
`MQ_WEB_PROCESSES` Daphne processes on one socket as `make run` starts them; embedded: SQLite
and one Daphne process), its three transports for the workloads' publishers and consumers
(REST, WS, WS batch), the provisioning of a run's queues and subscribers, and `Ours`, which
gives the workloads what every system gives them (prepare, publisher, stored, unacked;
systems.py). Its clients on the wire (OursPublisherRest, OursConsumerWs, ...) are in systems.py
beside the peers'.

W7's queues are ordered (ORDERED_RUNS), and W7 has a fourth consumer, a webhook: a queue
`w7-webhook` whose one subscriber posts to the bench's receiver (webhook_rate.Receiver), served
by the Celery workers `make run` starts (harness.celery_workers), started for it alone.
"""

import json
import os
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import systems
from harness import ROOT
from workloads import W2_SUBSCRIBERS

SERVICES_REDIS = "redis://127.0.0.1:6379/12"
PG_DB = "mqsite_cmp_services"
GROWTH_DB = "mqsite_cmp_growth"
TRANSPORTS = ("rest", "ws", "ws-batch")
MODES = ("services", "embedded")
# W1a publishes one message a frame, so over WS batch it would be WS's W1a again: not run. W7's
# consumer holds one delivery at a time (an ordered queue), so batch frames would carry one each.
SAME_OVER_BATCH = {"ws-batch": {"W1a", "W7"}}
# Runs whose queues are ordered (W7), and W7's webhook queue (its consumer is not a transport).
ORDERED_RUNS = ("w7",)
WEBHOOK_QUEUE = "w7-webhook"
# The Celery programs of mqsite/supervisord.conf that W7's webhook needs: the posts, the
# sweeper and beat, which sends the sweeps (the analytics worker would only take CPU).
WEBHOOK_PROGRAMS = ("worker", "maintenance", "beat")


class Ours:
    """One mode of this server behind one Daphne process, one publishing transport."""

    def __init__(self, mode, transport, port, db_url, tokens, suffix=""):
        self.mode, self.transport, self.port, self.db_url = mode, transport, port, db_url
        self.tokens, self.suffix = tokens, suffix
        self.name = f"ours-{mode}-{transport}"

    def queue(self, run):
        return f"{run}-{self.transport}{self.suffix}"

    async def prepare(self, run, n, consumer="ws", ordered=False):
        # `ordered`: W7's queues are made ordered when provisioned (ORDERED_RUNS).
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

    async def last_ack(self, run):
        """The latest ack time of the run's deliveries, as epoch seconds (the database's clock,
        which is the machine's), or None."""
        if self.db_url.startswith("sqlite"):
            at = self._query(
                "SELECT max(d.acked_at) FROM delivery_delivery d JOIN queues_queue q "
                "ON q.id = d.queue_id WHERE q.name = %s",
                [self.queue(run)],
            )
            # Django keeps an aware datetime in SQLite as UTC text without the offset.
            return datetime.fromisoformat(at).replace(tzinfo=UTC).timestamp() if at else None
        at = self._query(
            "SELECT extract(epoch FROM max(d.acked_at)) FROM delivery_delivery d JOIN queues_queue q "
            "ON q.id = d.queue_id WHERE q.name = %s",
            [self.queue(run)],
        )
        return None if at is None else float(at)

    async def dead(self, run):
        return self._query(
            "SELECT count(*) FROM delivery_delivery d JOIN queues_queue q ON q.id = d.queue_id "
            "WHERE q.name = %s AND d.status = 'dead'",
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


class OursWebhook(Ours):
    """W7's webhook consumer: the queue WEBHOOK_QUEUE, whatever the publishing transport."""

    def __init__(self, mode, port, db_url, tokens):
        super().__init__(mode, "rest", port, db_url, tokens)
        self.name = f"ours-{mode}-webhook"

    def queue(self, run):
        return WEBHOOK_QUEUE


def provision(env, runs, suffix="", idle=0, webhook_url=None):
    """Queues `<run>-<transport><suffix>` with their subscribers (ordered for ORDERED_RUNS), a
    publisher, idle subscribers, and with `webhook_url` WEBHOOK_QUEUE (ordered) with one
    subscriber posting there."""
    queues = [f"{r}-{t}{suffix}" for r in runs for t in TRANSPORTS]
    spec = {
        "queues": queues,
        "ordered": [q for q in queues if q.split("-")[0] in ORDERED_RUNS],
        "subscribers": [{"name": f"pub{suffix}", "publish": ["*"]}]
        + [
            {"name": f"{q}-{k}", "subscribe": [q]}
            for q in queues
            for k in range(n_subscribers(q.split("-")[0]))
        ],
    }
    if webhook_url:
        spec["ordered"].append(WEBHOOK_QUEUE)
        spec["subscribers"].append(
            {"name": f"{WEBHOOK_QUEUE}-0", "subscribe": [WEBHOOK_QUEUE], "webhook": webhook_url}
        )
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


def server_env(mode, db_url, workdir=None):
    """The environment of the server, its commands and (W7) its Celery workers. W7's webhook
    posts to the bench on loopback, which the SSRF rule refuses unless allowed. The embedded
    mode's Celery broker is a folder, by default the tree's var/celery, which another embedded
    worker on this tree would share: `workdir` gets one of its own."""
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "MQ_THROTTLE_RATE": "1000000/s",
        "DEBUG": "false",
        "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
    }
    if mode == "services":
        env["REDIS_URL"] = SERVICES_REDIS
    else:
        env.pop("REDIS_URL", None)
        if workdir is not None:
            env["MQ_CELERY_DIR"] = str(Path(workdir) / "celery-embedded")
    return env


def web_processes(mode, asked=None):
    """Daphne processes for `mode`, as `make run` starts them: MQ_WEB_PROCESSES (default the
    CPU count) in the services mode, always one in the embedded mode (SQLite)."""
    if mode == "embedded":
        return 1
    return asked or int(os.environ.get("MQ_WEB_PROCESSES") or os.cpu_count() or 1)
