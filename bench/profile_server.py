"""Where the server's time goes under W1a and W4: py-spy on the Daphne process, plus the round
trips and query plans of the hot SQL on PostgreSQL with 10 million delivery rows.

1. The services mode (PostgreSQL + Redis), one Daphne process, as in compare.py. Under W1a
   (REST publishes one at a time) and under W4 (a websocket subscriber catching up on a
   backlog), py-spy samples Daphne three times: an SVG flame graph of the CPU
   (bench/results/profile-<time>-<workload>.svg), the same as collapsed stacks, and the
   collapsed stacks with idle threads included (where the wall-clock time goes, waits on
   PostgreSQL included). The collapsed stacks are summed up into the top functions.
2. django_trace.py against the W5 database (`mqsite_cmp_growth`, made by compare.py or here):
   round trips per publish, lease and ack, and EXPLAIN (ANALYZE, BUFFERS) of their statements.

Writes bench/results/profile-<time>.json and -plans.txt; bench/PROFILE.md is written by hand
from them.
"""

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import growth
import ours
import redis
import subscriber_processes
import systems
import workloads
from harness import RESULTS, ROOT, fresh_database, git, machine, manage, server_process

PYSPY = Path(sys.executable).parent / "py-spy"
PG_DB = "mqsite_cmp_profile"
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def short_file(path):
    for marker in ("site-packages/", f"{ROOT}/", "lib/python3.11/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


PROJECT = ("delivery/", "queues/", "subscribers/", "mqsite/", "dashboard/", "analytics/")


def summarise(collapsed_text, top=25):
    """Top functions by self samples and by inclusive samples, and samples per package; and the
    same restricted to stacks that run the project's code (a request, a consumer's call), which
    leaves out the pool threads and the event loop waiting for work."""
    counters = {k: collections.Counter() for k in ("self", "inclusive", "packages")}
    work = {k: collections.Counter() for k in ("self", "inclusive", "packages")}
    totals = {"all": 0, "work": 0}
    for line in collapsed_text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = []
        for f in stack.split(";"):
            m = FRAME.match(f)
            frames.append((m["func"], short_file(m["file"])) if m else (f, ""))
        in_project = any(fi.startswith(PROJECT) for _, fi in frames)
        for c, kind in ((counters, "all"), (work, "work")):
            if kind == "work" and not in_project:
                continue
            totals[kind] += n
            leaf = frames[-1]
            c["self"][f"{leaf[0]} ({leaf[1]})"] += n
            for name in {f"{fn} ({fi})" for fn, fi in frames}:
                c["inclusive"][name] += n
            c["packages"][leaf[1].split("/")[0] if leaf[1] else "?"] += n

    def share(counter, total):
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)] if total else []

    out = {"samples": totals["all"], "work_samples": totals["work"]}
    for k in ("self", "inclusive", "packages"):
        out[k] = share(counters[k], totals["all"])
        out[f"work_{k}"] = share(work[k], totals["work"])
    # The project's own functions, by inclusive share of the work samples.
    out["project_functions"] = [
        (name, pc)
        for name, pc in share(work["inclusive"], totals["work"] or 1)
        if name.split("(")[-1].startswith(PROJECT)
    ][:top]
    return out


async def pyspy(pid, seconds, out, fmt, idle=False):
    cmd = [str(PYSPY), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100"]
    cmd += ["--format", fmt, "--output", str(out), "--nonblocking"]
    if idle:
        cmd.append("--idle")
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    text, _ = await proc.communicate()
    return proc.returncode, text.decode(errors="replace")[-500:]


async def three_recordings(pid, seconds, stem):
    """SVG of the CPU, collapsed CPU stacks, collapsed stacks with idle threads."""
    svg = RESULTS / f"{stem}.svg"
    out = {"svg": str(svg.relative_to(ROOT))}
    out["svg_rc"] = await pyspy(pid, seconds, svg, "flamegraph")
    with tempfile.TemporaryDirectory() as tmp:
        cpu, wall = Path(tmp) / "cpu.txt", Path(tmp) / "wall.txt"
        out["cpu_rc"] = await pyspy(pid, seconds, cpu, "raw")
        out["wall_rc"] = await pyspy(pid, seconds, wall, "raw", idle=True)
        out["cpu"] = summarise(cpu.read_text()) if cpu.exists() else None
        out["wall"] = summarise(wall.read_text()) if wall.exists() else None
    return out


async def profile_w1a(system, pid, seconds, stem):
    """REST publishes one at a time while py-spy samples."""
    pub = await system.publisher("w1a")
    stop, count = asyncio.Event(), [0]

    async def publish():
        i = 0
        while not stop.is_set():
            await pub.one(workloads.payload(i, "w1"))
            count[0] += 1
            i += 1

    task = asyncio.ensure_future(publish())
    await asyncio.sleep(2)
    started, before = time.monotonic(), count[0]
    rec = await three_recordings(pid, seconds, f"{stem}-w1a")
    rate = (count[0] - before) / (time.monotonic() - started)
    stop.set()
    await task
    await pub.close()
    return rec | {"publishes_per_second_while_sampled": round(rate, 1)}


async def profile_w4(system, pid, seconds, backlog, stem):
    """A websocket subscriber catching up on a backlog while py-spy samples."""
    pub = await system.backlog_publisher("w4")
    for first in range(0, backlog, 100):
        await pub.many([workloads.payload(i, "w4") for i in range(first, min(first + 100, backlog))])
    await pub.close()
    spec = await system.prepare("w4", 1, consumer="ws")
    group = subscriber_processes.Subscribers(spec, 1, backlog, "w4", 3 * seconds + 120)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    rec = await three_recordings(pid, seconds, f"{stem}-w4")
    res = await group.result()
    got = {r[1] for r in res["records"][0] if r[0] == "w4"}
    done = res["done_at"][0]
    rate = None if done is None else round(len(got) / (done - group.started_at), 1)
    return rec | {"received": len(got), "backlog": backlog, "messages_per_second": rate}


async def run(args, stamp):
    workdir = Path(tempfile.mkdtemp(prefix="mqprofile-"))
    db_url, _ = fresh_database("postgresql", workdir, PG_DB)
    redis.Redis.from_url(ours.SERVICES_REDIS, socket_timeout=5).flushdb()
    env = ours.server_env("services", db_url)
    manage(env, "migrate", "--noinput")
    tokens = ours.provision(env, ["w1a", "w4"])["tokens"]
    out = {}
    with server_process(env, workdir / "daphne-profile.log") as (port, proc):
        print(f"daphne pid {proc.pid}; W1a for {3 * args.seconds:.0f} s under py-spy", flush=True)
        out["W1a"] = await profile_w1a(
            ours.Ours("services", "rest", port, db_url, tokens), proc.pid, args.seconds, stamp
        )
        print(f"W4: a backlog of {args.backlog}, then a websocket subscriber under py-spy", flush=True)
        out["W4"] = await profile_w4(
            ours.Ours("services", "ws", port, db_url, tokens), proc.pid, args.seconds, args.backlog, stamp
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10, help="each of the three py-spy recordings")
    parser.add_argument("--backlog", type=int, default=50_000, help="W4's waiting messages")
    parser.add_argument("--growth-rows", type=int, default=10_000_000)
    args = parser.parse_args()
    systems.raise_nofile()
    now = datetime.now(UTC)
    stamp = f"profile-{now.strftime('%Y%m%dT%H%M%SZ')}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "machine": machine(),
    }
    result["pyspy"] = asyncio.run(run(args, stamp))
    env = ours.server_env("services", "")
    url, result["growth"] = growth.ensure_ours(ours.GROWTH_DB, args.growth_rows, env)
    print(f"round trips and plans on {url}", flush=True)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "django_trace.py")],
        env={**env, "DATABASE_URL": url},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    if done.returncode:
        sys.exit(f"django_trace.py failed:\n{done.stderr[-3000:]}")
    trace = json.loads(done.stdout.strip().splitlines()[-1])
    plans_path = RESULTS / f"{stamp}-plans.txt"
    with plans_path.open("w") as f:
        f.write(f"EXPLAIN (ANALYZE, BUFFERS) on {trace['delivery_rows']:,} delivery rows ")
        f.write(f"({trace['delivery_table_size']} with indexes), {now.isoformat(timespec='seconds')}\n")
        for op, items in trace.pop("plans").items():
            for k, item in enumerate(items):
                f.write(f"\n===== {op} #{k + 1}\n{item['sql']}\n\n{item['plan']}\n")
    result["round_trips"] = trace
    result["machine"]["loadavg_after"] = os.getloadavg()
    path = RESULTS / f"{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for w in ("W1a", "W4"):
        p = result["pyspy"][w]
        rate = p.get("publishes_per_second_while_sampled") or p.get("messages_per_second")
        print(f"\n{w}: {rate}/s while sampled")
        for kind in ("cpu", "wall"):
            if p.get(kind):
                q = p[kind]
                print(f"  {kind}: {q['samples']} samples, {q['work_samples']} in the project's code")
                print(f"    leaf packages there: {q['work_packages'][:8]}")
                for name, pc in q["work_self"][:10]:
                    print(f"    {pc:5.1f}%  {name}")
    print("\nround trips to PostgreSQL:")
    for op, v in trace["ops"].items():
        print(f"  {op}: {v['round_trips']}")
    print(f"\nwritten: {path.relative_to(ROOT)}, {plans_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
