"""What the latency histograms (delivery.observe) cost a publish and an ack in the process, with
no database: each case timed in alternating blocks of many calls, in both of prometheus-client's
modes (the process's memory, and the multiprocess mode's memory-mapped files, in a child
process given a scratch PROMETHEUS_MULTIPROC_DIR, as `make run` gives its processes one).

    .venv/bin/python bench/observe_cost.py [--blocks 10] [--calls 20000]

Cases, per call:
- `bare`: an empty `with` (what a publish site would cost with no histogram at all);
- `publish`: `with observe.publishing("rest")`, the observation of one publish call;
- `ack 1`, `ack 100`: acked_statement() over the rows of an ack of 1 and of 100 deliveries of
  a queue whose name the process knows (the ack's own statement is the database's cost).
Prints microseconds per call of each, and per acked delivery for the acks.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cases():
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    import django

    django.setup()
    from delivery import observe

    observe._queue_names[1] = "db"
    one = [(1, None, 1, 0.02)]
    hundred = one * 100

    def bare():
        with contextlib.nullcontext():
            pass

    def publish():
        with observe.publishing("rest"):
            pass

    def ack(rows):
        def run():
            for _ in observe.acked_statement(rows):  # known queue: no statement
                pass

        return run

    return {"bare": bare, "publish": publish, "ack 1": ack(one), "ack 100": ack(hundred)}


def measure(blocks, calls):
    """{case: [microseconds per call, one per block]}, the cases in alternating order."""
    runs = cases()
    names = list(runs)
    per_call = {name: [] for name in names}
    for block in range(blocks):
        for name in names if block % 2 == 0 else reversed(names):
            run = runs[name]
            for _ in range(calls // 10):  # unmeasured
                run()
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            per_call[name].append((time.perf_counter() - t0) / calls * 1e6)
    return per_call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.blocks, args.calls)))
        return
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    command = [sys.executable, __file__, "--child", "--blocks", str(args.blocks), "--calls", str(args.calls)]
    for mode in ("in memory", "multiprocess files"):
        env = dict(os.environ)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with tempfile.TemporaryDirectory(prefix="observe-cost-") as folder:
            if mode != "in memory":
                env["PROMETHEUS_MULTIPROC_DIR"] = folder
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        per_call = json.loads(out)
        print(mode)
        for name, us in per_call.items():
            median = statistics.median(us)
            line = f"  {name:8s} median {median:7.3f} µs a call (blocks {min(us):.3f}-{max(us):.3f})"
            if name.startswith("ack"):
                line += f", {median / int(name.split()[1]):.3f} µs an acked delivery"
            print(line)


if __name__ == "__main__":
    main()
