"""How fast the analytics job (analytics/job.py) runs: input rows per second per core, on local[1]
against local[2], over generated histories of 1 and 10 million deliveries.

    .venv/bin/python bench/spark_job.py [--sizes 1000000,10000000] [--cores 1,2]

The history is generated straight to Parquet with pyarrow (bench/analytics_history.py), in the
archive's layout (queue=/day=/part-<first>-<last>.parquet, one file per queue and day), with no
database: 4 queues, 3 events, 50 subscribers, 30 days, a fan-out of 2; 90 % of deliveries
acked, 5 % pending, 3 % in flight, 2 % dead. The last 7 days go to the
"recent" root (as analytics.extract would write them), the rest to the "archive" root, and 1 %
of the archived messages are in both (as a crash between the archive's write and delete leaves
them), so the job's dedupe has work to do.

Each core count runs in its own process (a fresh JVM, so one does not inherit the other's JIT
warm-up), which first runs the job once, untimed, on the smallest history (a first run takes
about twice as long: the JIT; a run on a tiny history does not warm it up enough), then times
job.run() (read, dedupe, aggregate, write the results) once per size. Results:
bench/results/spark_job-<UTC time>.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import analytics_history as history  # noqa: E402

from analytics import job  # noqa: E402

RESULTS = ROOT / "bench" / "results"
QUEUES = ["db", "filesystem", "network", "auth"]
EVENTS = ["create", "delete", "error"]
SUBSCRIBERS = [f"subscriber-{i:02d}" for i in range(50)]
STATUS_MIX = [("acked", 0.90), ("pending", 0.05), ("inflight", 0.03), ("dead", 0.02)]
DAYS = 30
RECENT_DAYS = 7
FANOUT = 2
END = datetime(2026, 11, 20, tzinfo=UTC)
START = END - timedelta(days=DAYS)
DRIVER_MEMORY = "4g"


# --- the generated history -------------------------------------------------------------------------


def generate(base, deliveries):
    """Write a history of `deliveries` deliveries under base/archive and base/recent, one file
    per queue and day in the archive's layout (bench/analytics_history.py makes the rows)."""
    messages, deliveries_t = history.history_tables(
        deliveries // FANOUT,
        start=START,
        end=END,
        queues=QUEUES,
        events=EVENTS,
        subscribers=SUBSCRIBERS,
        fanout=FANOUT,
        status_mix=STATUS_MIX,
    )
    recent_from = pa.scalar(END - timedelta(days=RECENT_DAYS), pa.timestamp("us", tz="UTC"))
    recent, archived = {}, {}
    for name, table in (("messages", messages), ("deliveries", deliveries_t)):
        is_recent = pc.greater_equal(table["created_at"], recent_from)
        # 1 % of the archived rows also in the recent root: the overlap a crash leaves.
        id_col = table["id"] if name == "messages" else table["message_id"]
        overlap = pc.and_(pc.invert(is_recent), pc.equal(history._mod(id_col, 100), 0))
        archived[name] = table.filter(pc.invert(is_recent))
        recent[name] = table.filter(pc.or_(is_recent, overlap))
    history.write_files(base / "archive", archived["messages"], archived["deliveries"], "daily")
    history.write_files(base / "recent", recent["messages"], recent["deliveries"], "daily")
    return {"messages": len(messages), "deliveries": len(deliveries_t)}


# --- one core count, in its own process -------------------------------------------------------------


def worker(args):
    """Run in a child: warm up, then time the job on each history; print JSON."""
    spark = job.build_session(
        f"local[{args.worker}]",
        app_name="mqsite-bench",
        conf={"spark.ui.enabled": "false", "spark.driver.memory": DRIVER_MEMORY},
    )
    timings = {}
    runs = [("warmup", args.warmup), *[h.split("=", 1) for h in args.histories]]
    for label, base in runs:
        base = Path(base)
        out = base / f"out-{args.worker}-{label}"
        started = time.perf_counter()
        job.run(spark, str(base / "archive"), str(base / "recent"), str(out), now=END)
        timings[label] = time.perf_counter() - started
        print(f"  local[{args.worker}] {label}: {timings[label]:.1f} s", file=sys.stderr, flush=True)
    spark.stop()
    print(json.dumps(timings))


def run_cores(cores, warmup, histories):
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(cores),
        "--warmup",
        str(warmup),
        *[arg for size, base in histories.items() for arg in ("--history", f"{size}={base}")],
    ]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="deliveries per history")
    parser.add_argument("--cores", default="1,2", help="local[N] to compare")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", help=argparse.SUPPRESS)
    parser.add_argument("--history", dest="histories", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import harness

    sizes = [int(s) for s in args.sizes.split(",")]
    cores = [int(c) for c in args.cores.split(",")]
    machine = harness.machine()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mqbench-spark-") as tmp:
        tmp = Path(tmp)
        histories, generated = {}, {}
        for size in sizes:
            started = time.perf_counter()
            generated[size] = generate(tmp / str(size), size)
            generated[size]["generate_s"] = round(time.perf_counter() - started, 2)
            generated[size]["parquet_bytes"] = sum(
                f.stat().st_size for f in (tmp / str(size)).rglob("*.parquet")
            )
            histories[size] = tmp / str(size)
            print(f"generated {size:,} deliveries in {generated[size]['generate_s']} s", file=sys.stderr)
        runs, warmups = [], {}
        warmup = histories[min(sizes)]
        for n_cores in cores:
            timings = run_cores(n_cores, warmup, histories)
            warmups[f"local[{n_cores}]"] = round(timings["warmup"], 2)
            for size in sizes:
                seconds = timings[str(size)]
                total = generated[size]["messages"] + generated[size]["deliveries"]
                runs.append(
                    {
                        "master": f"local[{n_cores}]",
                        "cores": n_cores,
                        "deliveries": size,
                        "messages": generated[size]["messages"],
                        "seconds": round(seconds, 2),
                        "deliveries_per_s": round(size / seconds),
                        "deliveries_per_s_per_core": round(size / seconds / n_cores),
                        "input_rows_per_s_per_core": round(total / seconds / n_cores),
                    }
                )
    result = {
        "benchmark": "spark_job",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": harness.git("rev-parse", "--short", "HEAD"),
        "machine": machine,
        "loadavg_after": os.getloadavg(),
        "java": subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0],
        "pyspark": __import__("pyspark").__version__,
        "driver_memory": DRIVER_MEMORY,
        "workload": {
            "queues": len(QUEUES),
            "events": len(EVENTS),
            "subscribers": len(SUBSCRIBERS),
            "days": DAYS,
            "recent_days": RECENT_DAYS,
            "fanout": FANOUT,
            "histories": {str(k): v for k, v in generated.items()},
        },
        "runs": runs,
        "warmup_s": warmups,  # the untimed first run on the smallest history
        "wall_s": round(time.perf_counter() - began, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"spark_job-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'master':<9} {'deliveries':>11} {'seconds':>8} {'deliveries/s':>13} {'per core':>10}")
    for r in runs:
        print(
            f"{r['master']:<9} {r['deliveries']:>11,} {r['seconds']:>8.1f} {r['deliveries_per_s']:>13,} "
            f"{r['deliveries_per_s_per_core']:>10,}"
        )
    print(f"written to {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
