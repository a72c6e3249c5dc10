"""This server side by side with RabbitMQ, NATS JetStream, Redis Streams and a bare PostgreSQL
table (the ceiling of our design). Run with `make bench` (full sizes) or `make bench-quick`.

Workloads (a 200-byte JSON payload; each run bounded by --limit seconds):

  W1a  publish one at a time, each waiting for its confirm (201 for us)        20,000 messages
  W1a-8  W1a from 8 clients at once, each one at a time (ours over REST only)  20,000 messages
  W1b  publish in batches of 100, each batch confirmed                         20,000 messages
  W2   fan-out: 1 publisher, 10 subscribers each acking every message           5,000 messages
  W3   500 messages/s for 10 s to one live subscriber: publish-to-receive latency
  W4   catch-up: 50,000 messages waiting for a subscriber that connects, received and acked
  W5   W1b and W4 again with 10 million delivery rows already in the database
  W6   W3 again with 10,000 idle subscribers connected (ours only)

Us: the real server in the services mode (PostgreSQL + Redis; MQ_WEB_PROCESSES Daphne processes
on one port, as `make run` starts them) and the embedded mode (SQLite, one Daphne process),
over REST and over the websocket. Every run checks that every message
was confirmed, stored, received by every subscriber and acked in the store. Prints one table
with ratios to RabbitMQ and to the PostgreSQL ceiling, the targets, and writes
bench/results/compare-<UTC time>.json.
"""

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import growth
import psycopg
import redis
import systems
from harness import (
    PAYLOAD_BYTES,
    RESULTS,
    ROOT,
    fresh_database,
    git,
    machine,
    manage,
    message,
    server_process,
    update_readme,
)

SERVICES_REDIS = "redis://127.0.0.1:6379/12"
PG_DB = "mqsite_cmp_services"
GROWTH_DB = "mqsite_cmp_growth"
TRANSPORTS = ("rest", "ws", "ws-batch")
OURS_WORKLOADS = ("W1a", "W1a-8", "W1b", "W2", "W3", "W4")
MODES = ("services", "embedded")
PEERS = ("rabbitmq", "nats", "redis", "pg-ceiling")
W2_SUBSCRIBERS = 10
W3_RATE = 500
WARMUP = 50
W1A_CLIENTS = 8  # W1a-8: what several REST clients of one server get together
# W1a publishes one message a frame, so over WS batch it would be WS's W1a again: not run.
SAME_OVER_BATCH = {"ws-batch": {"W1a"}}

# Full sizes; --scale multiplies them.
SIZES = {
    "W1a": 20_000,
    "W1a-8": 20_000,
    "W1b": 20_000,
    "W2": 5_000,
    "W3": 10,  # seconds at W3_RATE
    "W4": 50_000,
    "W5": 10_000_000,  # delivery rows already there
    "W6": 10_000,  # idle subscribers
}


def payload(i, phase, sent=0.0):
    return message(i, phase=phase, sent=sent)["payload"]


def pct(values, p):
    s = sorted(values)
    return s[max(math.ceil(p / 100 * len(s)) - 1, 0)] if s else None


def ms(x):
    return None if x is None else round(x * 1000, 2)


async def wait_unacked_zero(system, run, n, limit=30.0):
    """What the store still counts as not acked, polled until 0 (acks may be written after
    the client sent them) or `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        left = await system.unacked(run, n)
        if left == 0 or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.5)


# --- the workloads ---------------------------------------------------------------------------------


async def w1(system, run, total, batch, limit, clients=1):
    """`clients` publishers at once, each sending its next batch once the last is confirmed."""
    await system.prepare(run, 1)
    pubs = [await system.publisher(run) for _ in range(clients)]
    latencies, errors = [], []
    ok = i = 0
    started = time.perf_counter()
    deadline = time.monotonic() + limit

    async def client(pub):
        nonlocal ok, i
        while i < total and time.monotonic() < deadline and len(errors) < 10:
            n = min(batch, total - i)
            batch_payloads = [payload(i + k, "w1") for k in range(n)]
            i += n
            t = time.perf_counter()
            try:
                if batch == 1:
                    await pub.one(batch_payloads[0])
                else:
                    await pub.many(batch_payloads)
                ok += n
            except Exception as exc:
                errors.append(f"{exc.__class__.__name__}: {exc}"[:300])
            latencies.append(time.perf_counter() - t)

    try:
        await asyncio.gather(*(client(p) for p in pubs))
    finally:
        seconds = time.perf_counter() - started
        for pub in pubs:
            await pub.close()
    stored = await system.stored(run, 1)
    return {
        "messages": ok,
        "target": total,
        "seconds": round(seconds, 3),
        "value": round(ok / seconds, 1),
        "unit": "msg/s",
        "clients": clients,
        "request_ms": {"p50": ms(pct(latencies, 50)), "p99": ms(pct(latencies, 99))},
        "errors": errors[:5],
        "time_limited": i < total,
        # No confirmed message may be missing; one the server stored but could not confirm (its
        # socket closed first) is the at-least-once case a client resends.
        "stored_unconfirmed": stored - ok,
        "server_closed_socket": getattr(pub, "reconnects", 0),
        "checks": {"no_errors": not errors, "confirmed_all_stored": stored >= ok, "stored": stored},
    }


def delivery_frames(res):
    """What the batch consumers counted of their `messages` frames, for the JSON (WS batch)."""
    return {"delivery_frames": res["frames"]} if res.get("frames") else {}


def received(records, phase):
    """Distinct message numbers of `phase`, and how many arrived more than once."""
    got = [r for r in records if r[0] == phase]
    distinct = {r[1] for r in got}
    return distinct, len(got) - len(distinct)


async def w2(system, run, total, limit, subscribers=W2_SUBSCRIBERS):
    spec = await system.prepare(run, subscribers, consumer="ws")
    group = systems.Subscribers(spec, subscribers, total, "w2", limit)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    pub = await system.publisher(run)
    started = time.monotonic()
    errors = []
    try:
        for first in range(0, total, 100):
            if time.monotonic() - started > limit:
                errors.append("publishing hit the time limit")
                break
            await pub.many([payload(i, "w2") for i in range(first, min(first + 100, total))])
    except Exception as exc:
        errors.append(f"{exc.__class__.__name__}: {exc}"[:300])
    published_in = time.monotonic() - started
    await pub.close()
    res = await group.result()
    counts, dups = [], 0
    for recs in res["records"]:
        distinct, d = received(recs, "w2")
        counts.append(len(distinct))
        dups += d
    finished = [t for t in res["done_at"] if t is not None]
    seconds = (max(finished) - started) if len(finished) == subscribers else None
    left = await wait_unacked_zero(system, run, subscribers)
    deliveries = subscribers * total
    return {
        "messages": total,
        "subscribers": subscribers,
        "deliveries": sum(counts),
        "target": deliveries,
        "seconds": None if seconds is None else round(seconds, 3),
        "publish_seconds": round(published_in, 3),
        "value": None if seconds is None else round(deliveries / seconds, 1),
        "unit": "acked deliveries/s",
        "duplicates": dups,
        **delivery_frames(res),
        "errors": errors + ([res["error"]] if res["error"] else []),
        "checks": {
            "all_received": counts == [total] * subscribers,
            "no_errors": not errors and not res["error"],
            "store_all_acked": left == 0,
        },
    }


async def w3(system, run, seconds, limit, rate=W3_RATE):
    total = int(rate * seconds)
    spec = await system.prepare(run, 1, consumer="ws")
    group = systems.Subscribers(spec, 1, total, "w3", limit + seconds)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    pub = await system.publisher(run)
    errors, tasks = [], []

    async def send(p):
        try:
            await pub.one(p)
        except Exception as exc:
            errors.append(f"{exc.__class__.__name__}: {exc}"[:300])

    async def paced(phase, count):
        # The send time in the payload is the time the message was due: a publisher that
        # falls behind (the server answers slowly) shows as latency, not as a slower rate.
        t0 = time.monotonic()
        for i in range(count):
            due = t0 + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() - t0 > seconds + limit:
                errors.append(f"publishing hit the time limit after {i} messages")
                break
            tasks.append(asyncio.ensure_future(send(payload(i, phase, sent=due))))

    await paced("warmup", WARMUP)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await paced("w3", total)
    # Confirms still owed are waited for, but not past the limit.
    _, late = await asyncio.wait(tasks, timeout=limit) if tasks else (None, set())
    for task in late:
        task.cancel()
    if late:
        errors.append(f"{len(late)} publishes not confirmed within {limit:.0f} s of the last send")
    publish_seconds = time.monotonic() - started
    await pub.close()
    res = await group.result()
    first = {}
    for r in res["records"][0]:
        if r[0] == "w3":
            first.setdefault(r[1], r)
    lat = [r[3] - r[2] for r in first.values()]
    _, dups = received(res["records"][0], "w3")
    left = await wait_unacked_zero(system, run, 1)
    return {
        "messages": len(first),
        "target": total,
        "rate": rate,
        "publish_seconds": round(publish_seconds, 3),
        "value": ms(pct(lat, 99)),
        "unit": "p99 ms",
        "latency_ms": {
            "p50": ms(pct(lat, 50)),
            "p95": ms(pct(lat, 95)),
            "p99": ms(pct(lat, 99)),
            "max": ms(max(lat)) if lat else None,
            "mean": ms(statistics.fmean(lat)) if lat else None,
        },
        "duplicates": dups,
        **delivery_frames(res),
        "errors": errors[:5] + ([res["error"]] if res["error"] else []),
        "checks": {
            "all_received": len(first) == total,
            "no_errors": not errors and not res["error"],
            "store_all_acked": left == 0,
        },
    }


async def w4(system, run, total, limit, consumer="ws"):
    spec = await system.prepare(run, 1, consumer=consumer)
    pub = (
        await system.backlog_publisher(run)
        if hasattr(system, "backlog_publisher")
        else await system.publisher(run)
    )
    fill = time.monotonic()
    try:
        for first in range(0, total, 100):
            await pub.many([payload(i, "w4") for i in range(first, min(first + 100, total))])
    finally:
        await pub.close()
    fill = time.monotonic() - fill
    stored = await system.stored(run, 1)
    group = systems.Subscribers(spec, 1, total, "w4", limit)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    res = await group.result()
    distinct, dups = received(res["records"][0], "w4")
    done = res["done_at"][0]
    seconds = None if done is None else done - group.started_at
    left = await wait_unacked_zero(system, run, 1)
    return {
        "messages": len(distinct),
        "target": total,
        "backlog_fill_seconds": round(fill, 2),
        "seconds": None if seconds is None else round(seconds, 3),
        "value": None if seconds is None else round(total / seconds, 1),
        "unit": "msg/s received+acked",
        "duplicates": dups,
        **delivery_frames(res),
        "errors": [res["error"]] if res["error"] else [],
        "checks": {
            "backlog_stored": stored == total,
            "all_received": len(distinct) == total,
            "no_errors": not res["error"],
            "store_all_acked": left == 0,
        },
    }


def failed(exc):
    return {"value": None, "error": f"{exc.__class__.__name__}: {exc}"[:500], "checks": {"ran": False}}


async def guarded(coro, label):
    print(f"  {label} ...", flush=True)
    t = time.monotonic()
    try:
        out = await coro
    except Exception as exc:
        out = failed(exc)
    out["ok"] = all(v for k, v in out["checks"].items() if k != "stored")
    out["wall_seconds"] = round(time.monotonic() - t, 1)
    shown = out.get("latency_ms") or out.get("value")
    print(f"  {label}: {shown} {out.get('unit', '')} ok={out['ok']} {out.get('error', '')}", flush=True)
    return out


# --- peers -----------------------------------------------------------------------------------------


def make_peer(name):
    return {
        "rabbitmq": systems.Rabbit,
        "nats": systems.Nats,
        "redis": systems.RedisStreams,
        "pg-ceiling": systems.Ceiling,
    }[name]()


class PeerRuns:
    """A peer with per-run names that do not collide with earlier runs; cleaned up after."""

    def __init__(self, peer, stamp):
        self.peer, self.stamp, self.made = peer, stamp, []

    def run_name(self, workload):
        return f"{workload.lower()}-{self.stamp}"

    async def prepare(self, run, n, consumer=None):
        self.made.append((run, n))
        return await self.peer.prepare(run, n)

    def __getattr__(self, name):
        return getattr(self.peer, name)

    async def cleanup(self):
        for run, n in self.made:
            try:
                await self.peer.cleanup(run, n)
            except Exception as exc:
                print(f"  cleanup of {run}: {exc}")


async def run_peer(name, sizes, limit, stamp, workloads):
    peer = make_peer(name)
    results = {}
    print(f"{peer.label}:", flush=True)
    try:
        if name == "pg-ceiling":
            await peer.setup(fresh=True)
        p = PeerRuns(peer, stamp)
        try:
            for w in workloads:
                if w != "W5":
                    results[w] = await run_workload(p, w, p.run_name(w), sizes, limit, "ws")
        finally:
            await p.cleanup()
        if name == "pg-ceiling" and "W5" in workloads:
            info = await asyncio.get_running_loop().run_in_executor(None, growth.ensure_ceiling, sizes["W5"])
            print(f"  ceiling growth table: {info}")
            peer_g = systems.Ceiling(table="ceiling_growth")
            await peer_g.setup(fresh=False)
            p = PeerRuns(peer_g, stamp)
            results["W5-W1b"] = await guarded(w1(p, f"w5b-{stamp}", sizes["W1b"], 100, limit), "W5 (W1b)")
            results["W5-W4"] = await guarded(w4(p, f"w5c-{stamp}", sizes["W4"], limit), "W5 (W4)")
            results["W5-W1b"]["growth_rows"] = results["W5-W4"]["growth_rows"] = info["rows"]
    except Exception as exc:
        print(f"  {peer.label} failed: {exc}")
        results.setdefault("error", f"{exc.__class__.__name__}: {exc}")
    return results


async def run_workload(system, w, run, sizes, limit, transport):
    if w == "W1a":
        return await guarded(w1(system, run, sizes["W1a"], 1, limit), w)
    if w == "W1a-8":
        return await guarded(w1(system, run, sizes["W1a-8"], 1, limit, clients=W1A_CLIENTS), w)
    if w == "W1b":
        return await guarded(w1(system, run, sizes["W1b"], 100, limit), w)
    if w == "W2":
        return await guarded(w2(system, run, sizes["W2"], limit), w)
    if w == "W3":
        return await guarded(w3(system, run, sizes["W3"], limit, sizes["W3_rate"]), w)
    if w == "W4":
        return await guarded(w4(system, run, sizes["W4"], limit, consumer=transport), w)
    raise ValueError(w)


# --- this server -----------------------------------------------------------------------------------


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


def w6_ladder(target):
    """The idle counts W6 tries, largest first: the target, then tenfold fewer, down to 10."""
    steps = [target]
    while steps[-1] > 10:
        steps.append(max(steps[-1] // 10, 10))
    return steps


async def w6_once(ours_by_transport, idle_tokens, port, sizes, limit, run):
    """Connect the idle subscribers, then W3 with each publisher while they stay connected."""
    target = len(idle_tokens)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    connect_limit = max(30.0, 1.5 * limit)
    proc = ctx.Process(
        target=systems.idle_process,
        args=(f"ws://127.0.0.1:{port}/ws/", idle_tokens, child, 100, connect_limit),
        daemon=True,
    )
    started = time.monotonic()
    proc.start()
    loop = asyncio.get_running_loop()
    connected, failures, progress, failed_count = 0, [], [], 0
    while True:
        if not await loop.run_in_executor(None, parent.poll, connect_limit + 60):
            break
        msg = parent.recv()
        if msg[0] == "progress":
            progress.append((round(time.monotonic() - started, 1), msg[1], msg[2]))
            if len(progress) % 10 == 0:
                print(f"    idle connected: {msg[1]} (failed {msg[2]})", flush=True)
            continue
        if msg[0] == "connected":
            connected, failures, failed_count = msg[1], msg[2], msg[3]
            break
    connect_seconds = time.monotonic() - started
    print(
        f"  W6: {connected} of {target} idle subscribers connected and answering ({connect_seconds:.0f} s)",
        flush=True,
    )
    out = {
        "target_idle": target,
        "idle_connected": connected,
        "connect_seconds": round(connect_seconds, 1),
        "connect_failures": failures,
        "connect_failure_count": failed_count,
        "progress": progress[::5],
    }
    await asyncio.sleep(5)  # let the connects' own work (catch-up leases) settle
    for transport, ours in ours_by_transport.items():
        if connected < 0.99 * target:
            out[transport] = {**failed(RuntimeError(f"only {connected} idle sockets answer")), "ok": False}
            continue
        out[transport] = await guarded(
            w3(ours, run, sizes["W3"], limit, sizes["W3_rate"]), f"W6 ({transport} publisher, {target} idle)"
        )
    parent.send("stop")
    if await loop.run_in_executor(None, parent.poll, 60):
        out["idle_still_open_at_end"] = parent.recv()[1]
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    for transport in TRANSPORTS:
        # The sockets that were still open when W3 was over are the idle ones it ran beside.
        out[transport]["idle_connected"] = min(connected, out.get("idle_still_open_at_end", connected))
    return out


async def w6(ours_by_transport, idle_tokens, port, sizes, limit):
    """W6 at the target; if W3 fails beside that many idle sockets, again with tenfold fewer
    (each step with queues of its own), until it passes. The last step is the result."""
    attempts = []
    for k, n in enumerate(w6_ladder(len(idle_tokens))):
        out = await w6_once(ours_by_transport, idle_tokens[:n], port, sizes, limit, f"w6s{k}")
        attempts.append(out)
        # This many is reachable if every idle socket still answered a ping after W3 and W3
        # itself could run (its subscriber connected); W3's own latency is then the figure.
        held = out.get("idle_still_open_at_end", 0) >= 0.99 * n
        if held and all(out[t].get("checks", {}).get("ran", True) for t in TRANSPORTS):
            break
        await asyncio.sleep(10)  # let the server close what the last step left
    final = attempts[-1]
    final["attempts"] = [
        {
            "target_idle": a["target_idle"],
            "idle_connected": a["idle_connected"],
            "idle_still_open_at_end": a.get("idle_still_open_at_end"),
            "connect_seconds": a["connect_seconds"],
            "connect_failure_count": a["connect_failure_count"],
            **{
                t: {"ok": a[t]["ok"], "latency_ms": a[t].get("latency_ms"), "error": a[t].get("error")}
                for t in TRANSPORTS
            },
        }
        for a in attempts
    ]
    return final


# Run names (and so queue names) of the workloads, whose own names are not valid queue names.
RUN_NAMES = {"W1a-8": "w1a8"}
REST_ONLY = {"W1a-8"}


async def run_ours_mode(mode, sizes, limit, workloads, workdir, stamp, processes=1):
    print(f"ours, {mode} mode, {processes} Daphne process(es):", flush=True)
    results = {t: {} for t in TRANSPORTS}
    if mode == "embedded":
        db_url, version = fresh_database("sqlite", workdir, None)
    else:
        db_url, version = fresh_database("postgresql", workdir, PG_DB)
        redis.Redis.from_url(SERVICES_REDIS, socket_timeout=5).flushdb()
    env = server_env(mode, db_url)
    manage(env, "migrate", "--noinput")
    keys = [w for w in workloads if w in OURS_WORKLOADS]
    runs = [RUN_NAMES.get(w, w.lower()) for w in keys]
    idle = sizes["W6"] if "W6" in workloads else 0
    w6_runs = [f"w6s{k}" for k in range(len(w6_ladder(idle)))] if idle else []
    made = provision(env, runs + w6_runs, idle=idle)
    tokens, idle_tokens = made["tokens"], made["idle_tokens"]
    info = {"db_version": version, "web_processes": processes}
    with server_process(env, workdir / f"daphne-{mode}.log", processes) as (port, proc):
        info["daphne_pid"] = proc.pid
        ours = {t: Ours(mode, t, port, db_url, tokens) for t in TRANSPORTS}
        for t in TRANSPORTS:
            print(f" transport {t}:", flush=True)
            for key, w in zip(keys, runs, strict=True):
                if t != "rest" and key in REST_ONLY:
                    continue
                if key in SAME_OVER_BATCH.get(t, ()):
                    continue
                r = results[t][key] = await run_workload(ours[t], key, w, sizes, limit, t)
                if key in ("W1a", "W1a-8", "W1b") and "messages" in r:
                    # Each message fanned out to its one subscription.
                    r["checks"]["one_delivery_each"] = await ours[t].deliveries(w) == r["checks"]["stored"]
                    r["ok"] = r["ok"] and r["checks"]["one_delivery_each"]
        if idle:
            w6res = await w6(ours, idle_tokens, port, sizes, limit)
            for t in TRANSPORTS:
                results[t]["W6"] = {
                    **w6res[t],
                    "idle": {k: v for k, v in w6res.items() if k not in TRANSPORTS},
                }
    return results, info


async def run_growth(sizes, limit, stamp, workdir, processes=1):
    print("ours, services mode with the history rows (W5):", flush=True)
    env = server_env("services", "")
    loop = asyncio.get_running_loop()
    url, info = await loop.run_in_executor(None, growth.ensure_ours, GROWTH_DB, sizes["W5"], env)
    print(f"  growth database: {info}", flush=True)
    env = server_env("services", url)
    redis.Redis.from_url(SERVICES_REDIS, socket_timeout=5).flushdb()
    suffix = f"-{stamp}"
    tokens = provision(env, ["w5b", "w5c"], suffix=suffix)["tokens"]
    results = {}
    with server_process(env, workdir / "daphne-growth.log", processes) as (port, _proc):
        for t in TRANSPORTS:
            ours = Ours("services", t, port, url, tokens, suffix=suffix)
            results[t] = {
                "W5-W1b": await guarded(w1(ours, "w5b", sizes["W1b"], 100, limit), f"W5 (W1b, {t})"),
                "W5-W4": await guarded(w4(ours, "w5c", sizes["W4"], limit, consumer=t), f"W5 (W4, {t})"),
            }
            for r in results[t].values():
                r["growth_rows"] = info["rows"]
    return results, info


# --- the table -------------------------------------------------------------------------------------

COLUMNS = [
    ("ours-services-rest", "ours services REST"),
    ("ours-services-ws", "ours services WS"),
    ("ours-services-ws-batch", "ours services WS batch"),
    ("ours-embedded-rest", "ours embedded REST"),
    ("ours-embedded-ws", "ours embedded WS"),
    ("ours-embedded-ws-batch", "ours embedded WS batch"),
    ("rabbitmq", "RabbitMQ quorum"),
    ("nats", "NATS JetStream"),
    ("redis", "Redis Streams (no disk)"),
    ("pg-ceiling", "PostgreSQL ceiling"),
]
ROWS = [
    ("W1a", "W1a publish, confirm each (msg/s)"),
    ("W1a-8", "W1a from 8 clients at once (msg/s; ÷ RabbitMQ's W1a)"),
    ("W1b", "W1b publish, batches of 100 (msg/s)"),
    ("W2", "W2 fan-out 1→10 (acked deliveries/s)"),
    ("W3", "W3 {rate}/s latency p50/p95/p99 (ms)"),
    ("W4", "W4 catch-up 50k (msg/s)"),
    ("W5-W1b", "W5 W1b with 10M rows (msg/s)"),
    ("W5-W4", "W5 W4 with 10M rows (msg/s)"),
    ("W6", "W6 W3 + idle subscribers, p50/p95/p99 (ms)"),
]
LOWER_IS_BETTER = {"W3", "W6"}


def cell(r):
    if not r:
        return "—"
    if r.get("value") is None:
        return "failed" if r.get("error") or not r.get("ok") else "—"
    if r.get("latency_ms"):
        lat = r["latency_ms"]
        text = f"{lat['p50']:.0f} / {lat['p95']:.0f} / {lat['p99']:.0f}"
    else:
        text = f"{r['value']:,.0f}"
    if (
        r.get("target")
        and r.get("messages") is not None
        and r["messages"] < r["target"]
        and "deliveries" not in r
    ):
        text += f" ({r['messages']:,} of {r['target']:,})"
    if r.get("idle_connected") is not None:
        text += f" with {r['idle_connected']:,} idle"
    if not r.get("ok"):
        text += " ✗"
    return text


def ratio(r, base, key):
    if not r or not base or r.get("value") is None or base.get("value") in (None, 0):
        return "—"
    return f"{r['value'] / base['value']:.2f}"


def table(grid, rate=W3_RATE):
    """grid[row][column] -> result. One line per workload and system, with the ratios."""
    lines = [
        "| workload | system | figure | ÷ RabbitMQ | ÷ PG ceiling | checks |",
        "| --- | --- | ---: | ---: | ---: | :---: |",
    ]
    for key, label in ROWS:
        label = label.format(rate=rate)
        row = grid.get(key, {})
        if not row:
            continue
        # W6 and W1a-8 run for us only: beside the peers' W3 and W1a.
        base = {"W6": "W3", "W1a-8": "W1a"}.get(key)
        rabbit = row.get("rabbitmq") or (grid.get(base, {}).get("rabbitmq") if base else None)
        ceiling = row.get("pg-ceiling") or (grid.get(base, {}).get("pg-ceiling") if base else None)
        for col, col_label in COLUMNS:
            r = row.get(col)
            if r is None:
                continue
            checks = "ok" if r.get("ok") else "FAIL"
            lines.append(
                f"| {label} | {col_label} | {cell(r)} | {ratio(r, rabbit, key)} | "
                f"{ratio(r, ceiling, key)} | {checks} |"
            )
    return "\n".join(lines)


FAILED = object()  # a run that did not pass its checks
BATCH_COLUMNS = {"ours-services-ws-batch", "ours-embedded-ws-batch"}
# The targets are judged for each mode's REST and WS; WS batch counts within WS (best_socket).
TARGET_COLUMNS = [c for c in COLUMNS if c[0].startswith("ours-") and c[0] not in BATCH_COLUMNS]
# The socket's W1b, W2 and W4 targets take the better of its two modes, single frames (WS) or
# batch frames (WS batch); the W5 run beside each comes from the same mode, so that W5 ÷ W1b
# and W5 ÷ W4 compare like with like. W1a and W3 publish one message a frame: WS only.
SOCKET_BEST_OF = {"W1b": ("W5-W1b",), "W2": (), "W4": ("W5-W4",)}
SOCKET_MODE_LABELS = {"ws": "WS", "ws-batch": "WS batch"}


def best_socket(grid):
    """(a copy of `grid` in which each mode's WS column holds, for W1b, W2 and W4, the run of
    the better socket mode, {(workload, WS column): that mode's label}). A run that failed its
    checks counts below every run that passed them."""
    grid = {key: dict(row) for key, row in grid.items()}
    chosen = {}

    def rank(r):
        return (bool(r.get("ok")) and r.get("value") is not None, r.get("value") or 0)

    for mode in MODES:
        ws, batch = f"ours-{mode}-ws", f"ours-{mode}-ws-batch"
        for key, beside in SOCKET_BEST_OF.items():
            single, batched = grid.get(key, {}).get(ws), grid.get(key, {}).get(batch)
            if not batched:
                continue
            use = "ws" if single and rank(single) >= rank(batched) else "ws-batch"
            for k in (key, *beside):
                chosen[(k, ws)] = SOCKET_MODE_LABELS[use]
                if use == "ws-batch" and k in grid:
                    r = grid[k].get(batch)
                    if r is None:
                        grid[k].pop(ws, None)  # not measured in that mode: no mixed ratio
                    else:
                        grid[k][ws] = r
    return grid, chosen


def socket_mode_noted(check, col, chosen):
    """A target's (name, met, note), its note saying which socket mode it was judged on."""
    name, met, note = check
    mode = chosen.get((name.split()[0], col))
    return (name, met, f"{note} ({mode})" if mode and met is not None else note)


def targets(grid):
    """The issue's targets, for each mode's REST and WS (the socket's W1b, W2 and W4 on its
    better mode, see best_socket): (name, met, note) each."""
    out = []
    grid, chosen = best_socket(grid)

    def val(key, col):
        r = grid.get(key, {}).get(col)
        if r and (not r.get("ok") or r.get("value") is None):
            return FAILED
        return None if not r else r.get("value")

    def check(name, ours, base, base_label, met, fmt="{:.2f}×"):
        if ours is FAILED:
            return (name, False, "our run failed its checks (✗)")
        if base is FAILED:
            return (name, None, f"{base_label} failed")
        if ours is None or base is None:
            return (name, None, "not measured")
        return (name, met(ours / base), fmt.format(ours / base))

    for col, label in TARGET_COLUMNS:
        checks = []
        rest = col.endswith("-rest")
        # Over REST the issue asks W1a ≥ 0.3 from one client and ≥ 1.0 from 8 (issue 15).
        wanted = [("W1a", "W1a", 0.3 if rest else 1.0)] + ([("W1a-8", "W1a", 1.0)] if rest else [])
        wanted += [("W1b", "W1b", 2.0), ("W2", "W2", 1.5), ("W4", "W4", 2.0)]
        for key, base, want in wanted:
            checks.append(
                check(
                    f"{key} ≥ {want}× RabbitMQ's {base}",
                    val(key, col),
                    val(base, "rabbitmq"),
                    "RabbitMQ",
                    lambda r, w=want: r >= w,
                )
            )
        checks.append(
            check(
                "W3 p99 ≤ 3× RabbitMQ's", val("W3", col), val("W3", "rabbitmq"), "RabbitMQ", lambda r: r <= 3
            )
        )
        if col.startswith("ours-services"):
            for key, base in (("W5-W1b", "W1b"), ("W5-W4", "W4")):
                checks.append(
                    check(f"{key} ≥ 0.8× {base}", val(key, col), val(base, col), base, lambda r: r >= 0.8)
                )
        name, met, note = check("W6 p99 ≤ 2× W3's", val("W6", col), val("W3", col), "W3", lambda r: r <= 2)
        r6 = grid.get("W6", {}).get(col)
        if r6 and r6.get("idle_connected") is not None:
            asked = (r6.get("idle", {}).get("attempts") or [{}])[0].get("target_idle")
            note += f" with {r6['idle_connected']:,} idle" + (f" ({asked:,} asked)" if asked else "")
        checks.append((name, met, note))
        out.append((label, [socket_mode_noted(c, col, chosen) for c in checks]))
    return out


def targets_text(rows):
    lines = ["| ours | target | ratio | met |", "| --- | --- | ---: | :---: |"]
    for label, checks in rows:
        for name, met, note in checks:
            mark = {True: "yes", False: "no", None: "—"}[met]
            lines.append(f"| {label} | {name} | {note} | {mark} |")
    return "\n".join(lines)


def build_grid(ours, growth_res, peers):
    grid = {}
    for (mode, t), res in ours.items():
        for key, r in res.items():
            grid.setdefault(key, {})[f"ours-{mode}-{t}"] = r
    for t, res in (growth_res or {}).items():
        for key, r in res.items():
            grid.setdefault(key, {})[f"ours-services-{t}"] = r
    for name, res in peers.items():
        for key, r in res.items():
            if isinstance(r, dict):
                grid.setdefault(key, {})[name] = r
    return grid


def versions():
    out = {}
    try:
        out["redis"] = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=5).info("server")[
            "redis_version"
        ]
    except Exception as exc:
        out["redis"] = f"unavailable: {exc}"
    for cmd, key in ((["rabbitmqctl", "version"], "rabbitmq"), (["nats-server", "--version"], "nats")):
        try:
            out[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as exc:
            out[key] = f"unknown: {exc}"
    try:
        with psycopg.connect(f"{growth.PG_SERVER}/postgres", connect_timeout=5) as conn:
            out["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
    except Exception as exc:
        out["postgresql"] = f"unavailable: {exc}"
    out["sqlite"] = sqlite3.sqlite_version
    return out


async def main_async(args):
    sizes = {k: max(int(v * args.scale), 1) for k, v in SIZES.items()}
    sizes["W3"] = max(SIZES["W3"] * args.scale, 2.0)
    sizes["W3_rate"] = args.w3_rate
    if args.w6_connections:
        sizes["W6"] = args.w6_connections
    if args.w5_rows:
        sizes["W5"] = args.w5_rows
    base_workloads = [w for w in OURS_WORKLOADS if w in args.workloads]
    stamp = datetime.now(UTC).strftime("%Y%m%dt%H%M%S")
    workdir = Path(tempfile.mkdtemp(prefix="mqcompare-"))
    print(f"sizes: {sizes}, limit {args.limit:.0f} s per run, work dir {workdir}", flush=True)
    ours, infos, peers, growth_res = {}, {}, {}, None
    for mode in args.modes:
        try:
            res, infos[mode] = await run_ours_mode(
                mode,
                sizes,
                args.limit,
                base_workloads + (["W6"] if "W6" in args.workloads else []),
                workdir,
                stamp,
                processes=web_processes(mode, args.web_processes),
            )
            for t in TRANSPORTS:
                ours[(mode, t)] = res[t]
        except Exception as exc:
            print(f"ours {mode} failed: {exc}")
            infos[mode] = {"error": f"{exc.__class__.__name__}: {exc}"[:2000]}
    if "W5" in args.workloads and "services" in args.modes:
        try:
            growth_res, infos["growth"] = await run_growth(
                sizes, args.limit, stamp, workdir, web_processes("services", args.web_processes)
            )
        except Exception as exc:
            print(f"W5 failed: {exc}")
            infos["growth"] = {"error": f"{exc.__class__.__name__}: {exc}"[:2000]}
    for name in args.peers:
        w = [k for k in base_workloads if k not in REST_ONLY]
        w += ["W5"] if "W5" in args.workloads and name == "pg-ceiling" else []
        peers[name] = await run_peer(name, sizes, args.limit, stamp, w)
    return sizes, ours, growth_res, peers, infos, workdir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every workload's size (0.1: quick)"
    )
    parser.add_argument("--limit", type=float, default=60.0, help="seconds each run may take at most")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS))
    parser.add_argument(
        "--workloads",
        nargs="*",
        default=["W1a", "W1a-8", "W1b", "W2", "W3", "W4", "W5", "W6"],
        help="W1a W1a-8 W1b W2 W3 W4 W5 W6",
    )
    parser.add_argument(
        "--web-processes",
        type=int,
        help="Daphne processes of the services mode (default: the CPU count, as MQ_WEB_PROCESSES; "
        "the embedded mode always runs one)",
    )
    parser.add_argument("--w6-connections", type=int, help="idle subscribers for W6 (default 10,000 × scale)")
    parser.add_argument(
        "--w5-rows", type=int, help="history delivery rows for W5 (default 10 million × scale)"
    )
    parser.add_argument("--w3-rate", type=int, default=W3_RATE, help="W3's and W6's messages a second")
    parser.add_argument("--update-readme", action="store_true", help="put the table into bench/README.md")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    nofile = systems.raise_nofile()
    now, host = datetime.now(UTC), machine()
    host["nofile"] = nofile
    started = time.monotonic()
    sizes, ours, growth_res, peers, infos, workdir = asyncio.run(main_async(args))
    host["loadavg_after"] = os.getloadavg()
    grid = build_grid(ours, growth_res, peers)
    text = table(grid, sizes["W3_rate"])
    goals = targets(grid)
    vers = versions()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    header = (
        f"{now.strftime('%Y-%m-%d %H:%M')} UTC, commit `{git('rev-parse', '--short', 'HEAD')}`"
        f"{' (with uncommitted changes in the tree)' if dirty else ''}"
        f", scale {args.scale:g}, at most {args.limit:.0f} s a run. Machine: {host['nproc']} CPUs "
        f"({host['cpu_model']}), {host['platform']}, Python {host['python']}; load average "
        f"{host['loadavg_before'][0]:.1f} before and {host['loadavg_after'][0]:.1f} after (other engineers' "
        f"tests share the machine). PostgreSQL {vers.get('postgresql')}, SQLite {vers.get('sqlite')}, "
        f"RabbitMQ {vers.get('rabbitmq')}, {vers.get('nats')}, Redis {vers.get('redis')}."
    )
    print()
    print(header)
    print()
    print(text)
    print()
    print(targets_text(goals))
    result = {
        "benchmark": "compare",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": host,
        "versions": vers,
        "args": vars(args),
        "sizes": sizes,
        "payload_bytes": PAYLOAD_BYTES,
        "prefetch": systems.PREFETCH,
        "notes": {n: make_peer(n).note for n in PEERS},
        "ours": {f"{m}-{t}": r for (m, t), r in ours.items()},
        "growth": growth_res,
        "peers": peers,
        "infos": infos,
        "targets": [{"ours": label, "checks": checks} for label, checks in goals],
        "table": text,
        "minutes": round((time.monotonic() - started) / 60, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compare-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwritten: {path.relative_to(ROOT)} ({result['minutes']} minutes)")
    if args.update_readme:
        update_readme(
            "compare",
            f"{header}\n\n`{path.relative_to(ROOT / 'bench')}`\n\n{text}\n\n"
            "Targets (ours ÷ RabbitMQ in the same "
            "run; W5 ÷ the same workload without the history rows; W6 ÷ W3; the socket's W1b, W2, "
            f"W4 and W5 on the better of WS and WS batch, named beside the ratio):\n\n{targets_text(goals)}",
        )
    all_ok = all(r.get("ok", True) for row in grid.values() for r in row.values())
    if all_ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"kept the server logs in {workdir}")
        sys.exit("FAILED: a run lost, duplicated or failed to ack a message, or did not finish (see ✗)")


if __name__ == "__main__":
    main()
