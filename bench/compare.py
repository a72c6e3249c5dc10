"""This server side by side with RabbitMQ, NATS JetStream, Redis Streams and a bare PostgreSQL
table (the ceiling of our design). Run with `make bench` (full sizes) or `make bench-quick`.

The comparison in modules of one job each:

- workloads.py: W1a to W7 (what each does, its full size) and the drivers that run them;
- systems.py: the peers, each through its usual Python client (and this server's clients);
- ours.py: this server in its two modes (services, embedded) and three transports;
- subscriber_processes.py: the processes that run the subscribers, and W6's idle sockets;
- report.py: the table with the ratios, the targets, the README block (`--update-readme`).

This file runs them: every workload against each mode and transport of ours, then against each
peer, then writes bench/results/compare-<UTC time>.json with every figure, the checks, the
machine and the versions, and prints the table.
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import growth
import psycopg
import redis
import report
import systems
from harness import (
    PAYLOAD_BYTES,
    RESULTS,
    ROOT,
    celery_workers,
    fresh_database,
    git,
    machine,
    manage,
    server_process,
    update_readme,
)
from ours import (
    GROWTH_DB,
    MODES,
    PG_DB,
    SAME_OVER_BATCH,
    SERVICES_REDIS,
    TRANSPORTS,
    WEBHOOK_PROGRAMS,
    WEBHOOK_QUEUE,
    Ours,
    OursWebhook,
    provision,
    server_env,
    web_processes,
)
from webhook_rate import Receiver
from workloads import (
    ORDERED_PEERS,
    OURS_WORKLOADS,
    REST_ONLY,
    RUN_NAMES,
    W3_RATE,
    guarded,
    run_workload,
    scaled,
    w1,
    w4,
    w6,
    w6_ladder,
    w7_webhook,
)

# --- the runs: each peer, each mode of ours, W5 beside the history rows ----------------------------


async def run_peer(name, sizes, limit, stamp, workloads):
    peer = systems.make_peer(name)
    results = {}
    print(f"{peer.label}:", flush=True)
    try:
        if name == "pg-ceiling":
            await peer.setup(fresh=True)
        p = systems.PeerRuns(peer, stamp)
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
            p = systems.PeerRuns(peer_g, stamp)
            results["W5-W1b"] = await guarded(w1(p, f"w5b-{stamp}", sizes["W1b"], 100, limit), "W5 (W1b)")
            results["W5-W4"] = await guarded(w4(p, f"w5c-{stamp}", sizes["W4"], limit), "W5 (W4)")
            results["W5-W1b"]["growth_rows"] = results["W5-W4"]["growth_rows"] = info["rows"]
    except Exception as exc:
        print(f"  {peer.label} failed: {exc}")
        results.setdefault("error", f"{exc.__class__.__name__}: {exc}")
    return results


async def workers_beating(ours, count, limit=60.0):
    """Wait until `count` Celery workers beat (delivery.liveness rows of kind `worker`)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if ours._query("SELECT count(*) FROM subscribers_serverprocess WHERE kind = %s", ["worker"]) >= count:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the Celery workers did not start beating within {limit:.0f} s")


async def w7_webhook_with_workers(hook, secret, receiver, env, workdir, sizes, limit):
    """W7 by webhook: the Celery workers of WEBHOOK_PROGRAMS, started for it alone and
    beating before it publishes (so that their start-up is not timed)."""
    with celery_workers(env, workdir, WEBHOOK_PROGRAMS):
        # beat is no worker: it takes no job and beats into no liveness row
        await workers_beating(hook, len([name for name in WEBHOOK_PROGRAMS if name != "beat"]))
        return await w7_webhook(hook, WEBHOOK_QUEUE, sizes["W7"], limit, receiver, secret)


async def run_ours_mode(mode, sizes, limit, workloads, workdir, stamp, processes=1):
    print(f"ours, {mode} mode, {processes} Daphne process(es):", flush=True)
    results = {t: {} for t in TRANSPORTS}
    if mode == "embedded":
        db_url, version = fresh_database("sqlite", workdir, None)
    else:
        db_url, version = fresh_database("postgresql", workdir, PG_DB)
        redis.Redis.from_url(SERVICES_REDIS, socket_timeout=5).flushdb()
    env = server_env(mode, db_url, workdir)
    manage(env, "migrate", "--noinput")
    keys = [w for w in workloads if w in OURS_WORKLOADS]
    runs = [RUN_NAMES.get(w, w.lower()) for w in keys]
    idle = sizes["W6"] if "W6" in workloads else 0
    w6_runs = [f"w6s{k}" for k in range(len(w6_ladder(idle)))] if idle else []
    receiver = Receiver() if "W7" in workloads else None  # W7's webhook endpoint
    made = provision(env, runs + w6_runs, idle=idle, webhook_url=receiver and receiver.url)
    tokens, idle_tokens = made["tokens"], made["idle_tokens"]
    info = {"db_version": version, "web_processes": processes}
    with (
        contextlib.closing(receiver) if receiver else contextlib.nullcontext(),
        server_process(env, workdir / f"daphne-{mode}.log", processes) as (port, proc),
    ):
        info["daphne_pid"] = proc.pid
        ours = {t: Ours(mode, t, port, db_url, tokens) for t in TRANSPORTS}
        for t in TRANSPORTS:
            todo = [
                (key, w)
                for key, w in zip(keys, runs, strict=True)
                if not (t != "rest" and key in REST_ONLY) and key not in SAME_OVER_BATCH.get(t, ())
            ]
            if todo:
                print(f" transport {t}:", flush=True)
            for key, w in todo:
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
        if receiver:
            secret = made["secrets"][f"{WEBHOOK_QUEUE}-0"]
            hook = OursWebhook(mode, port, db_url, tokens)
            results["webhook"] = {
                "W7": await guarded(
                    w7_webhook_with_workers(hook, secret, receiver, env, workdir, sizes, limit),
                    "W7 (webhook)",
                )
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


# --- the entry point -------------------------------------------------------------------------------


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
    sizes = scaled(args.scale, args.w3_rate, args.w6_connections, args.w5_rows)
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
            for t, r in res.items():  # the transports, and W7's webhook
                ours[(mode, t)] = r
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
        w = [k for k in base_workloads if k not in REST_ONLY and (k != "W7" or name in ORDERED_PEERS)]
        w += ["W5"] if "W5" in args.workloads and name == "pg-ceiling" else []
        if w:
            peers[name] = await run_peer(name, sizes, args.limit, stamp, w)
    return sizes, ours, growth_res, peers, infos, workdir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every workload's size (0.1: quick)"
    )
    parser.add_argument("--limit", type=float, default=60.0, help="seconds each run may take at most")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--peers", nargs="*", choices=list(systems.PEERS), default=list(systems.PEERS))
    parser.add_argument(
        "--workloads",
        nargs="*",
        default=["W1a", "W1a-8", "W1b", "W2", "W3", "W4", "W5", "W6", "W7"],
        help="W1a W1a-8 W1b W2 W3 W4 W5 W6 W7",
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
    result = {
        "benchmark": "compare",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": host,
        "versions": versions(),
        "args": vars(args),
        "sizes": sizes,
        "payload_bytes": PAYLOAD_BYTES,
        "prefetch": systems.PREFETCH,
        "notes": {n: systems.make_peer(n).note for n in systems.PEERS},
        "ours": {f"{m}-{t}": r for (m, t), r in ours.items()},
        "growth": growth_res,
        "peers": peers,
        "infos": infos,
    }
    text, goals = report.render(result)
    print(f"\n{report.header(result)}\n\n{text}\n\n{report.targets_text(goals)}")
    result["targets"] = [{"ours": label, "checks": checks} for label, checks in goals]
    result["table"] = text
    result["minutes"] = round((time.monotonic() - started) / 60, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compare-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwritten: {path.relative_to(ROOT)} ({result['minutes']} minutes)")
    if args.update_readme:
        update_readme("compare", report.readme_block(result, path))
    grid = report.build_grid(result["ours"], growth_res, peers)
    all_ok = all(r.get("ok", True) for row in grid.values() for r in row.values())
    if all_ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"kept the server logs in {workdir}")
        sys.exit("FAILED: a run lost, duplicated or failed to ack a message, or did not finish (see ✗)")


if __name__ == "__main__":
    main()
