"""How fast the analytics job's Spark part runs (analytics.job: the archive's files to the three
parts per hour), on the archive's real layouts: input rows per second per core past the fixed
cost, and the fixed cost.

    .venv/bin/python bench/spark_job.py [--sizes 1000000,2500000,5000000] [--layouts hourly,daily] [--cores 2]

The archives are generated straight to Parquet (bench/analytics_history.py: issue 19's
workload, 6 queues, 3 events, 50 subscribers, 10 days, fan-out 5): `hourly` is one file per
queue and hour, as the hourly archive task leaves it (1,440 files per kind at 5 M deliveries);
`daily` one file per queue and day, as compaction leaves it.

Each layout and core count runs in a fresh process, as `analyze` does (a new JVM, with the
session options a local run gets: job.build_session). In it:

- `session_s`: the session's start (the JVM);
- `first_s`: the job on the largest archive, cold (what a first `analyze` pays: the JIT too);
- then, after three more runs on the largest (the JIT's warm-up), the job on each size three
  times (the median kept).

The warm times are fitted to `fixed + rows / rate`: `rate / cores` is the input rows (messages
and deliveries read) per second per core past the fixed cost. The job here is what Spark
does: list the partitions, read the files, compute the parts and bring them back (toArrow).
`bench/analytics_run.py` times the whole `manage.py analyze` around it. Results:
bench/results/spark_job-<UTC time>.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import analytics_history as history  # noqa: E402

from analytics import job, partitions  # noqa: E402

RESULTS = ROOT / "bench" / "results"
REPEAT = 3
WARMUP_RUNS = 3


def run_job(spark, root):
    """List the archive under root and compute its parts; returns the input rows read."""
    listing = partitions.list_archive(root)
    files = {kind: [f for p in listing.values() for f in p.paths(kind)] for kind in partitions.KINDS}
    parts = job.compute_parts(
        spark,
        job.extract_archive(spark, root, "messages", files["messages"]),
        job.extract_archive(spark, root, "deliveries", files["deliveries"]),
    )
    messages = sum(parts["message_hours"]["messages"].to_pylist())
    deliveries = sum(parts["delivery_cells"]["n"].to_pylist())
    return messages + deliveries


def worker(args):
    """In a child: start the session, time a cold run on the largest archive, then warm runs on
    each; print JSON."""
    started = time.perf_counter()
    spark = job.build_session(f"local[{args.worker}]", app_name="mqsite-bench")
    out = {"session_s": round(time.perf_counter() - started, 2), "warm": {}}
    largest = args.archives[-1].split("=", 1)[1]
    started = time.perf_counter()
    out["rows"] = {"first": run_job(spark, largest)}
    out["first_s"] = round(time.perf_counter() - started, 2)
    # The optimising compiler keeps compiling for a few runs more: warm up on the largest
    # before timing any (measured: without it, the first size timed was slower than bigger ones).
    for _ in range(WARMUP_RUNS):
        run_job(spark, largest)
    for spec in args.archives:
        size, root = spec.split("=", 1)
        times = []
        for _ in range(REPEAT):
            started = time.perf_counter()
            out["rows"][size] = run_job(spark, root)
            times.append(time.perf_counter() - started)
        out["warm"][size] = round(statistics.median(times), 3)
        print(f"  local[{args.worker}] {size}: {out['warm'][size]:.2f} s", file=sys.stderr, flush=True)
    spark.stop()
    print(json.dumps(out))


def fit(points):
    """Least squares of seconds = fixed + rows / rate over (rows, seconds); (fixed, rate)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1 / slope


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,2500000,5000000", help="deliveries per archive")
    parser.add_argument("--layouts", default="hourly,daily", help="hourly (as archived), daily (compacted)")
    parser.add_argument("--cores", default="2", help="local[N] to run")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--archive", dest="archives", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import harness

    sizes = sorted(int(s) for s in args.sizes.split(","))
    machine = harness.machine()
    began = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="mqbench-spark-") as tmp:
        for layout in args.layouts.split(","):
            archives = {}
            for size in sizes:
                root = Path(tmp) / f"{layout}-{size}"
                archives[size] = (root, history.generate_archive(root, size, files=layout))
                print(f"generated {size:,} deliveries, {layout}", file=sys.stderr, flush=True)
            for cores in (int(c) for c in args.cores.split(",")):
                load = os.getloadavg()[0]
                cmd = [sys.executable, __file__, "--worker", str(cores)]
                cmd += [a for size, (root, _) in archives.items() for a in ("--archive", f"{size}={root}")]
                done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600, check=True)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                fixed, rate = fit([(got["rows"][str(s)], got["warm"][str(s)]) for s in sizes])
                runs.append(
                    {
                        "layout": layout,
                        "master": f"local[{cores}]",
                        "files_per_kind": archives[sizes[-1]][1]["files_per_kind"],
                        "input_rows": {str(s): got["rows"][str(s)] for s in sizes},
                        "session_s": got["session_s"],
                        "first_s": got["first_s"],
                        "warm_s": got["warm"],
                        "fixed_s": round(fixed, 2),
                        "rows_per_s_per_core": round(rate / cores),
                        "loadavg_before": round(load, 2),
                        "loadavg_after": round(os.getloadavg()[0], 2),
                    }
                )
    result = {
        "benchmark": "spark_job",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": harness.git("rev-parse", "--short", "HEAD"),
        "machine": machine,
        "java": subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[0],
        "pyspark": __import__("pyspark").__version__,
        "sizes": sizes,
        "runs": runs,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"spark_job-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'layout':<7} {'master':<9} {'session':>8} {'first':>7} {'fixed':>7} {'rows/s/core':>12}  warm")
    for r in runs:
        warm = ", ".join(f"{int(k) / 1e6:g}M {v:.2f}s" for k, v in r["warm_s"].items())
        print(
            f"{r['layout']:<7} {r['master']:<9} {r['session_s']:>7.1f}s {r['first_s']:>6.1f}s "
            f"{r['fixed_s']:>6.2f}s {r['rows_per_s_per_core']:>12,}  {warm}"
        )
    print(f"results: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
