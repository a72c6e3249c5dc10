"""Publishes per second over REST, on SQLite and on PostgreSQL. Run with `make bench`.

For each backend: a fresh database, `migrate`, a queue `bench`, a subscriber `bencher`
subscribed to it (so every publish fans out to one delivery), then the real server (Daphne)
as a subprocess and three workloads against it, each stopped at its message count or after
TIME_LIMIT seconds. Every answer must be a 201, and the database must hold every message.
Prints a Markdown table and writes bench/results/publish_rate-<UTC time>.json.
"""

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from harness import (  # bench/, the script's own directory, is first on sys.path
    PAYLOAD_BYTES,
    RESULTS,
    ROOT,
    Client,
    count_in_db,
    fresh_database,
    git,
    machine,
    manage,
    message,
    provision,
    server,
)

PG_DB = "mqsite_bench"
TIME_LIMIT = 30.0  # seconds per workload

# name, messages, client threads (each with its own keep-alive connection), messages per request
WORKLOADS = [
    ("W1a", 2_000, 1, 1),
    ("W1a-c8", 4_000, 8, 1),
    ("W1b", 20_000, 1, 100),
]


def run_workload(port, token, name, total, threads, batch):
    deadline = time.monotonic() + TIME_LIMIT
    share = total // threads

    def worker(t):
        client, done, attempted, errors, latencies = Client(port, token), 0, 0, [], []
        while attempted < share and time.monotonic() < deadline:
            n = min(batch, share - attempted)
            msgs = [message(t * share + attempted + k) for k in range(n)]
            body = msgs[0] if batch == 1 else {"messages": msgs}
            started = time.perf_counter()
            status, answer = client.request("POST", "/api/queues/bench/messages", body)
            latencies.append(time.perf_counter() - started)
            attempted += n
            if status == 201:
                done += n
            else:
                errors.append(f"{status}: {answer[:200].decode(errors='replace')}")
        client.close()
        return done, attempted, errors, latencies

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(worker, range(threads)))
    seconds = time.perf_counter() - started
    done = sum(p[0] for p in parts)
    errors = [e for p in parts for e in p[2]]
    latencies = sorted(x for p in parts for x in p[3])
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return {
        "workload": name,
        "target": total,
        "clients": threads,
        "batch": batch,
        "messages": done,
        "requests": len(latencies),
        "failed_requests": len(errors),
        "first_errors": errors[:5],
        "seconds": round(seconds, 3),
        "messages_per_second": round(done / seconds, 1),
        "latency_ms": {"p50": round(q[49] * 1000, 2), "p99": round(q[98] * 1000, 2)},
        "time_limited": sum(p[1] for p in parts) < total,
    }


def run_backend(backend, database_url, workdir):
    print(f"{backend}: {database_url}")
    env = {**os.environ, "DATABASE_URL": database_url, "MQ_THROTTLE_RATE": "1000000/s", "DEBUG": "false"}
    env.pop("REDIS_URL", None)  # the embedded mode: nothing but the database
    manage(env, "migrate", "--noinput")
    token = provision(env)
    with server(env, workdir / f"daphne-{backend}.log") as port:
        client = Client(port, token)
        status, answer = client.request("POST", "/api/subscriptions", {"queue": "bench"})
        client.close()
        if status != 201:
            raise RuntimeError(f"subscribing answered {status}: {answer[:500]!r}")
        rows = []
        for name, total, threads, batch in WORKLOADS:
            row = {"backend": backend, **run_workload(port, token, name, total, threads, batch)}
            print(f"  {name}: {row['messages']} messages in {row['seconds']} s")
            rows.append(row)
    messages, deliveries = count_in_db(env)
    sent = sum(r["messages"] for r in rows)
    check = {
        "backend": backend,
        "published_201": sent,
        "in_database": messages,
        "deliveries": deliveries,
        "ok": messages == sent == deliveries and not any(r["failed_requests"] for r in rows),
    }
    print(f"  check: {sent} answered 201, {messages} in the database, {deliveries} deliveries")
    return rows, check


def table(rows):
    lines = [
        "| backend | workload | messages | seconds | messages/s | p50 ms | p99 ms | non-201 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        messages = f"{r['messages']} of {r['target']}" if r["messages"] < r["target"] else str(r["messages"])
        cells = [r["backend"], r["workload"], messages, f"{r['seconds']:.2f}"]
        cells += [f"{r['messages_per_second']:.0f}", f"{r['latency_ms']['p50']:.2f}"]
        cells += [f"{r['latency_ms']['p99']:.2f}", str(r["failed_requests"])]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    now, host = datetime.now(UTC), machine()
    workdir = Path(tempfile.mkdtemp(prefix="mqbench-"))
    rows, checks, versions = [], [], {}
    try:
        for backend in ("sqlite", "postgresql"):
            try:
                url, versions[backend] = fresh_database(backend, workdir, PG_DB)
            except psycopg.OperationalError as exc:
                print(f"{backend}: skipped, the server does not answer: {exc}")
                checks.append({"backend": backend, "skipped": str(exc), "ok": False})
                continue
            backend_rows, check = run_backend(backend, url, workdir)
            rows += backend_rows
            checks.append(check)
    finally:
        if checks and all(c["ok"] for c in checks):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept the databases and server logs in {workdir}")

    print()
    print(table(rows))
    result = {
        "benchmark": "publish_rate",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": host,
        "database_versions": versions,
        "payload_bytes": PAYLOAD_BYTES,
        "time_limit_s": TIME_LIMIT,
        "results": rows,
        "checks": checks,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"publish_rate-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmachine: {result['machine']}\nwritten: {path.relative_to(ROOT)}")
    if not all(c["ok"] for c in checks):
        sys.exit("FAILED: a request was not answered 201, or the database does not hold every message")


if __name__ == "__main__":
    main()
