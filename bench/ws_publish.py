"""Sequential single publishes over one socket: the rate and p50/p99 of publish -> published
(W1a's socket path alone, with a fresh database and one Daphne). For A/B runs of the socket's
database path: `python bench/ws_publish.py services 1000`, and with MQ_ASYNC_DB=false in the
environment for the threads' path. SPY=flamegraph:/tmp/out.svg records the server with py-spy.

It starts its own Daphne on a fresh database; see bench/PROFILE.md for results."""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import websockets

MODE = sys.argv[1] if len(sys.argv) > 1 else "services"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
SPY = os.environ.get("SPY")
WARM_UP = 50


async def publish_sequentially(port, token, pid):
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws/?token={token}") as ws:
        for i in range(WARM_UP):
            await ws.send(json.dumps({"type": "publish", "queue": "bench", **harness.message(i), "ref": i}))
            await ws.recv()
        spy = None
        if SPY:
            kind, out = SPY.split(":")
            spy = subprocess.Popen(
                [Path(sys.executable).parent / "py-spy", "record", "--nonblocking", "-r", "200", "-f", kind]
                + ["-o", out, "-p", str(pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await asyncio.sleep(1)
        latencies, start, cpu = [], time.perf_counter(), cpu_secs(pid)
        for i in range(N):
            sent = time.perf_counter()
            await ws.send(json.dumps({"type": "publish", "queue": "bench", **harness.message(i), "ref": i}))
            answer = json.loads(await ws.recv())
            assert answer["type"] == "published", answer
            latencies.append(time.perf_counter() - sent)
        elapsed, cpu = time.perf_counter() - start, cpu_secs(pid) - cpu
        latencies.sort()
        p50, p99 = latencies[N // 2] * 1000, latencies[int(N * 0.99)] * 1000
        way = f"{MODE} async_db={os.environ.get('MQ_ASYNC_DB', 'true')}"
        cpu_ms = cpu / N * 1000
        print(f"{way}: {N / elapsed:.0f}/s  p50 {p50:.2f} ms  p99 {p99:.2f} ms  server CPU {cpu_ms:.2f} ms")
        if spy:
            spy.send_signal(2)
            spy.wait()


def cpu_secs(pid):
    """The server's CPU time so far (user and system, all threads): less noisy than the rate
    on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    work = Path(tempfile.mkdtemp(prefix="ws_publish-"))
    db_url, _ = harness.fresh_database(
        "postgres" if MODE == "services" else "sqlite", work, "mqsite_ws_publish"
    )
    env = {**os.environ, "DATABASE_URL": db_url, "MQ_THROTTLE_RATE": "1000000/s", "DEBUG": "false"}
    if MODE == "services":
        env["REDIS_URL"] = "redis://127.0.0.1:6379/13"
    else:
        env.pop("REDIS_URL", None)
    harness.manage(env, "migrate", "--noinput")
    token = harness.provision(env)
    with harness.server_process(env, work / "daphne.log") as (port, proc):
        asyncio.run(publish_sequentially(port, token, proc.pid))


if __name__ == "__main__":
    main()
