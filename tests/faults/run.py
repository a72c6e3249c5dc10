"""One fault run, bounded in time: set up queues and subscribers, start the cluster and the
clients, let the nemesis loose while the publishers publish, heal, drain, then check.

The database must be set up already (Django configured, migrated, empty): pytest-django's
test database in tests/e2e/test_faults.py, a fresh one in `python -m tests.faults`.
"""

import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.db import OperationalError, connection
from django.db.models import Count
from django.test import override_settings

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber

from .checker import check_history
from .cluster import Cluster
from .history import History
from .nemesis import EMBEDDED_FAULTS, SERVICES_FAULTS, Nemesis
from .workload import Workload

log = logging.getLogger(__name__)

# Short leases: a delivery held by a killed process comes back after this, and the run tests
# that it does come back, not the default 30 s of patience.
ACK_TIMEOUT_SECS = 5
# High enough that nothing dies of the faults: a dead delivery would count as lost.
MAX_ATTEMPTS = 1000


@dataclass
class Config:
    messages: int = 3000
    minutes: float = 1.5  # the whole run, drain included
    services: bool = True
    postgres: object = None  # a cluster.PrivatePostgres the nemesis may crash, or None
    daphnes: int = 2
    workers: int = 2
    ordered_share: float = 0.05
    nemesis_interval_secs: tuple = (3, 8)
    drain_share: float = 0.3  # of the run kept for draining after the last publish
    min_drain_secs: float = 20
    faults: tuple | None = None  # None: every fault the mode has; () for a run without faults
    seed: int = 0
    history_path: str | None = None
    extra_env: dict = field(default_factory=dict)


def setup_topology(history, hook_url):
    """Two queues (one ordered), a publisher, and four subscribers: `sock` (websocket, two
    connections sharing), `sock2` (websocket, one event only), `pull` (REST) and `hook`
    (webhook). Returns (tokens, webhook secrets) by subscriber name."""
    fifo = Queue.objects.create(
        name="fifo", ordered=True, max_attempts=MAX_ATTEMPTS, ack_timeout=ACK_TIMEOUT_SECS
    )
    bulk = Queue.objects.create(name="bulk", max_attempts=MAX_ATTEMPTS, ack_timeout=ACK_TIMEOUT_SECS)
    tokens, secrets = {}, {}
    _, tokens["pub"] = create_subscriber("pub", publish=["*"])
    with override_settings(MQ_WEBHOOK_ALLOW_PRIVATE=True):
        for name, routes, url in (
            ("sock", [(fifo, None), (bulk, None)], ""),
            ("sock2", [(bulk, "create")], ""),
            ("pull", [(fifo, None), (bulk, None)], ""),
            ("hook", [(fifo, None), (bulk, None)], hook_url),
        ):
            subscriber, tokens[name] = create_subscriber(name, subscribe=["*"], webhook_url=url)
            secrets[name] = subscriber.webhook_secret
            for queue, event in routes:
                subscribing.subscribe(subscriber, queue, event)
                history.subscription(name, queue.name, event, queue.ordered)
    return tokens, secrets


def database_state():
    """Deliveries by status. Retried: a pooled connection may have died with a crashed server."""
    for attempt in range(5):
        try:
            rows = Delivery.objects.order_by().values("status").annotate(n=Count("id"))
            state = {s: 0 for s in Status.values}
            state.update({r["status"]: r["n"] for r in rows})
            return state
        except OperationalError:
            if attempt == 4:
                raise
            connection.close()
            if hasattr(connection, "close_pool"):
                connection.close_pool()
            time.sleep(1)
        finally:
            connection.close()


def run(config):
    """Run once; returns the result (a dict, `ok` saying whether the guarantees held)."""
    started = time.monotonic()
    end = started + config.minutes * 60
    publish_end = started + config.minutes * 60 * (1 - config.drain_share)
    history = History(config.history_path)
    cluster = Cluster(config.services, config.daphnes, config.workers, config.extra_env, config.postgres)
    rate = config.messages / max(publish_end - started - 10, 1)  # the first seconds start things
    workload = Workload(
        history,
        cluster,
        {},
        {},
        messages=config.messages,
        rate=rate,
        ordered_share=config.ordered_share,
        seed=config.seed,
    )
    faults = config.faults
    if faults is None:
        faults = SERVICES_FAULTS if config.services else EMBEDDED_FAULTS
        if config.postgres is not None:
            faults = (*faults, "restart_postgres")
    nemesis = Nemesis(cluster, workload, history, faults, config.nemesis_interval_secs, config.seed)
    phases = {}
    try:
        hook_url = workload.start_receiver()
        tokens, secrets = setup_topology(history, hook_url)
        workload.tokens.update(tokens)
        workload.secrets.update(secrets)
        connection.close()  # the harness holds no connection across a database restart
        cluster.start()
        phases["started_s"] = round(time.monotonic() - started, 1)
        workload.start()
        nemesis.start()
        # Publish for the window; the nemesis gets at least one round of every fault, even if
        # that outlasts the publishing (it then hits the deliveries still under way) or, on a
        # slow machine, the planned run (up to its length again): a fault never tried is a
        # guarantee never tested. A publisher slowed by the faults goes on past publish_end,
        # up to the end: the run is to publish every message it set out to, and the drain
        # below still gets its time.
        round_deadline = end + config.minutes * 60
        while (time.monotonic() < end and not workload.publishing_done()) or (
            not nemesis.round_done.is_set() and time.monotonic() < round_deadline
        ):
            time.sleep(0.5)
        nemesis.stop()
        phases["healed_s"] = round(time.monotonic() - started, 1)
        workload.stop_publishing()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not workload.publishing_done():
            time.sleep(0.2)  # a publisher in its retries gets its answer now that all is up
        phases["published_s"] = round(time.monotonic() - started, 1)
        drained = drain(history, max(end, time.monotonic() + config.min_drain_secs))
        phases["drained_s"] = round(time.monotonic() - started, 1)
    finally:
        workload.stop()
        nemesis.halt.set()
        history.close()
        cluster.stop()
    report = check_history(history)
    state = database_state()
    totals = report.as_dict()["totals"]
    problems = list(workload.errors) + nemesis.errors
    if workload.receiver is not None and workload.receiver.bad_signatures:
        problems.append(f"{workload.receiver.bad_signatures} webhook posts with a bad signature")
    if state[Status.DEAD]:
        problems.append(f"{state[Status.DEAD]} dead deliveries")
    if not drained:
        problems.append("not drained in time: deliveries still pending or in flight at the end")
    return {
        "ok": report.ok and not problems,
        "mode": "services" if config.services else "embedded",
        "database": connection.vendor,
        "postgres_restarts": nemesis.done.get("restart_postgres", 0),
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "messages": len({p.tag for p in history.published}),
        "target_messages": config.messages,
        "deliveries": totals["expected"],
        "received": totals["received"],
        "lost": totals["lost"],
        "unexpected": totals["unexpected"],
        "duplicated": totals["duplicated"],
        "inconsistent_duplicates": totals["inconsistent"],
        "out_of_order": totals["out_of_order"],
        "unconfirmed": totals["unconfirmed"],
        "faults": dict(nemesis.done),
        "client_behaviour": dict(workload.counts),
        "publish_retries": dict(workload.retries),
        "database_state": state,
        "problems": problems,
        "server_errors": dict(cluster.server_errors.most_common(20)),
        "unplanned_exits": nemesis.exits,
        "stuck_processes": cluster.stuck,
        "seconds": {**phases, "total": round(time.monotonic() - started, 1)},
        "report": report,
        "notes": [f"{t - started:7.1f} s  {text}" for t, text in history.notes],
    }


def drain(history, end):
    """Wait until every confirmed message reached every subscription it was for and the
    database holds nothing pending or in flight, or until `end`. Returns whether it did."""
    while True:
        report = check_history(history)
        if report.total("lost") == 0:
            state = database_state()
            if state[Status.PENDING] == 0 and state[Status.INFLIGHT] == 0:
                return True
        if time.monotonic() > end:
            return False
        time.sleep(1)


def summary(result):
    lines = [
        f"{result['mode']} mode on {result['database']}, {result['machine']['nproc']} CPUs: "
        f"{result['messages']} messages, {result['deliveries']} deliveries owed, "
        f"{result['received']} received",
        f"lost {result['lost']}, unexpected {result['unexpected']}, duplicated {result['duplicated']} "
        f"(inconsistent {result['inconsistent_duplicates']}), out of order {result['out_of_order']}, "
        f"unconfirmed {result['unconfirmed']}",
        f"faults: {result['faults']}",
        f"clients: {result['client_behaviour']}, publish retries: {result['publish_retries']}",
        f"database at the end: {result['database_state']}",
        f"seconds: {result['seconds']}",
        result["report"].table(),
    ]
    if result["unplanned_exits"]:
        lines.append(f"exited by themselves (restarted): {', '.join(result['unplanned_exits'])}")
    for line, n in result["server_errors"].items():
        lines.append(f"server log, traceback ({n}x): {line}")
    if result["problems"]:
        lines.append("problems: " + "; ".join(result["problems"]))
    lines.append("OK" if result["ok"] else "FAILED")
    return "\n".join(lines)


def workdir():
    path = Path(__file__).resolve().parent.parent.parent / "var" / "faults"
    path.mkdir(parents=True, exist_ok=True)
    return path
