"""How long `manage.py analyze --json` takes as an operator runs it, on issue 19's archive in the
archive's own layout, and whether its figures agree with DuckDB's.

    .venv/bin/python bench/analytics_run.py [--deliveries 5000000] [--layouts hourly,daily]
                                            [--sizes 1000000,2500000] [--master local[2]]
                                            [--local-bytes N] [--connect] [--days 10]

Everything goes through the command line, as an operator would use it (no internal API): for
each layout (`hourly`: one file per queue and hour, as the hourly archive task leaves them;
`daily`: one per queue and day, compacted), a generated archive (bench/analytics_history.py)
beside a small live set in the hot tables of a fresh database, then three runs, each a new
process (`manage.py analyze --json --out DIR`, with SPARK_MASTER, MQ_ARCHIVE_DIR and
DATABASE_URL in its environment), timed wall clock:

    first   a fresh --out folder: everything computed, the JVM's start included
    rerun   the same folder again with nothing new
    hour    the same folder again after one new hourly file (a new hour of one queue)

The archive is reduced as the settings say: in the analysing process with Arrow up to
MQ_ANALYTICS_LOCAL_BYTES (its default, or --local-bytes; 0 sends everything to Spark), else by
Spark. --connect starts a long-lived Spark Connect server on the same master before the runs
(its start not timed: it stands for one an operator keeps running) and gives the runs
SPARK_REMOTE, so that no run starts a JVM of its own; its CPU is not counted in the runs'.

Then the first run alone on smaller histories in the hourly layout (--sizes), to fit
wall = fixed + rows / (rate * cores): the fixed cost in seconds and the input rows (messages
plus deliveries read, archive and hot) a second per core past it.

After every run its printed JSON is checked against DuckDB over the same archive and the hot
rows (read through the ORM, not through analytics.extract): counts per queue and event and
per subscriber exactly, and p50/p95/p99 within 1 % of rank (between DuckDB's quantile_disc at
p - 0.01 and p + 0.01, as tests/analytics/test_job.py checks). A delivery in both the archive
and the hot tables (the live set holds some archived messages with their deliveries still
pending) counts once, as the archive's copy. A disagreement prints FAIL and makes the exit
status 1.

The database is DATABASE_URL when it names a PostgreSQL database whose name contains "bench"
(dropped and made again for each archive), else a fresh SQLite file in the work folder.
Peak RSS and CPU time are of the whole process tree (the JVM included), sampled from /proc every
0.2 s. Results: bench/results/analytics-<UTC time>.json, and a table on stdout. The load
average is recorded beside every run: other work on the machine skews the figures.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import analytics_history as history  # noqa: E402
import harness  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RUN_TIMEOUT = 1800
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the process tree, from /proc -----------------------------------------------------------------


def _stat(pid):
    """(ppid, cpu seconds, rss bytes) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, rss 24.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[21]) * PAGE


def _tree(root):
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            s = _stat(int(entry))
            if s:
                stats[int(entry)] = s
    members, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in stats.items():
            if ppid == parent and pid not in members:
                members.add(pid)
                frontier.append(pid)
    return {pid: stats[pid] for pid in members if pid in stats}


def timed(cmd, env, cwd):
    """Run cmd; returns (wall s, stdout, stderr, peak tree RSS bytes, tree CPU s, exit code)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err)
        peak, cpu = 0, {}
        while proc.poll() is None:
            tree = _tree(proc.pid)
            peak = max(peak, sum(rss for _, _, rss in tree.values()))
            for pid, (_, seconds, _) in tree.items():
                cpu[pid] = max(cpu.get(pid, 0.0), seconds)
            if time.perf_counter() - started > RUN_TIMEOUT:
                proc.kill()
            time.sleep(0.2)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        return wall, out.read().decode(), err.read().decode(), peak, sum(cpu.values()), proc.returncode


# --- the database ---------------------------------------------------------------------------------


def fresh_database(workdir):
    """A migrated, empty database: DATABASE_URL's (PostgreSQL, "bench" in its name), made again,
    or a new SQLite file. Returns its URL."""
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith(("postgres://", "postgresql://")):
        import psycopg

        server, name = url.rsplit("/", 1)
        if "bench" not in name:
            raise SystemExit(f"refusing to drop {name}: give a database whose name contains 'bench'")
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
    else:
        path = Path(workdir) / "hot.sqlite3"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        url = f"sqlite:///{path}"
    harness.manage({**os.environ, "DATABASE_URL": url}, "migrate", "--noinput")
    return url


def history_script(env, *args):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "analytics_history.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"analytics_history.py {args[0]} failed:\n{done.stderr[-3000:]}")
    return done.stdout


# --- a long-lived Spark Connect server (--connect) ----------------------------------------------

CONNECT_SERVER = """
import sys
from pyspark.sql import SparkSession
spark = (
    SparkSession.builder.master(sys.argv[2])
    .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
    .config("spark.connect.grpc.binding.port", sys.argv[1])
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", sys.argv[3])
    .getOrCreate()
)
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes it
spark.stop()
"""


def start_connect_server(master, cores):
    """A Spark Connect server on `master` (the pyspark package's own plugin); returns (process,
    its sc:// URL) once it listens. Cold: the first run is its first query (the JVM compiles
    Spark's code paths then); the later runs meet it warm, as an operator's server is. Its CPU
    is not in a run's (it is not the run's child)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", CONNECT_SERVER, str(port), master, str(2 * (cores or 1))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the Spark Connect server did not start")
    return proc, f"sc://127.0.0.1:{port}"


def stop_connect_server(proc):
    proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


# --- DuckDB, the independent engine ---------------------------------------------------------------

BOUNDS = [0.49, 0.51, 0.94, 0.96, 0.98, 1.0]  # 1 % of rank either side of p50, p95, p99
COUNTS = ("pending", "inflight", "acked", "dead")
# The fields the API promises (docs/analytics.md, "What `analyze --json` prints"); the others (pending and in
# flight per event, deliveries and in flight per subscriber) are checked when analyze prints them.
EVENT_REQUIRED = ("messages", "deliveries", "acked", "dead")
SUBSCRIBER_REQUIRED = ("pending", "acked", "dead")


def expected(archive, hot):
    """What analyze must print, computed by DuckDB from the archive's files and the hot rows."""
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    glob = lambda kind: f"read_parquet('{archive}/{kind}/**/*.parquet', hive_partitioning = true)"  # noqa: E731
    db.execute(f"CREATE VIEW am AS SELECT id, queue::VARCHAR AS queue, event FROM {glob('messages')}")
    db.execute(
        "CREATE VIEW ad AS SELECT id, queue::VARCHAR AS queue, event, subscriber, status, created_at, "
        f"acked_at FROM {glob('deliveries')}"
    )
    # The archive's copy wins: a hot row counts only when its id is not archived.
    db.execute(
        f"""CREATE VIEW m AS SELECT * FROM am UNION ALL
        SELECT id, queue, event FROM '{hot}/messages.parquet' WHERE id NOT IN (SELECT id FROM am)"""
    )
    db.execute(
        f"""CREATE VIEW d AS SELECT * FROM ad UNION ALL
        SELECT id, queue, event, subscriber, status, created_at, acked_at FROM '{hot}/deliveries.parquet'
        WHERE id NOT IN (SELECT id FROM ad)"""
    )
    counts = ", ".join(f"count(*) FILTER (status = '{s}') AS {s}" for s in COUNTS)
    events = db.execute(
        f"""
        WITH pm AS (SELECT queue, event, count(*) AS messages FROM m GROUP BY ALL),
        pd AS (
            SELECT queue, event, count(*) AS deliveries, {counts},
                quantile_disc((epoch_us(acked_at) - epoch_us(created_at)) / 1000, {BOUNDS})
                    FILTER (status = 'acked') AS q
            FROM d GROUP BY ALL)
        SELECT queue, event, messages, coalesce(deliveries, 0), coalesce(pending, 0),
            coalesce(inflight, 0), coalesce(acked, 0), coalesce(dead, 0), q
        FROM pm LEFT JOIN pd USING (queue, event) ORDER BY ALL
        """
    ).fetchall()
    subscribers = db.execute(
        f"SELECT subscriber, count(*) AS deliveries, {counts} FROM d GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    rows = db.execute("SELECT (SELECT count(*) FROM m), (SELECT count(*) FROM d)").fetchone()
    return {
        "events": {
            (q, e): dict(zip(("messages", "deliveries", *COUNTS), vals, strict=True)) | {"bounds": bounds}
            for q, e, *vals, bounds in events
        },
        "subscribers": {s: dict(zip(("deliveries", *COUNTS), vals, strict=True)) for s, *vals in subscribers},
        "messages": rows[0],
        "deliveries": rows[1],
    }


def compare(printed, want):
    """The disagreements between analyze's JSON and DuckDB's figures, as sentences."""
    problems = []
    got = {(e["queue"], e["event"]): e for e in printed["events"]}
    if got.keys() != want["events"].keys():
        problems.append(
            f"events: missing {sorted(want['events'].keys() - got.keys())}, "
            f"extra {sorted(got.keys() - want['events'].keys())}"
        )
    for key, w in want["events"].items():
        row = got.get(key)
        if row is None:
            continue
        for name in ("messages", "deliveries", *COUNTS):
            if name not in row:
                if name in EVENT_REQUIRED:
                    problems.append(f"{key} {name}: missing from analyze's JSON")
            elif row[name] != w[name]:
                problems.append(f"{key} {name}: analyze {row[name]}, DuckDB {w[name]}")
        for i, p in enumerate(("p50", "p95", "p99")):
            value = row["latency_ms"][p]
            if w["bounds"] is None:
                if value is not None:
                    problems.append(f"{key} {p}: analyze {value}, DuckDB none (no acked delivery)")
                continue
            low, high = w["bounds"][2 * i], w["bounds"][2 * i + 1]
            if value is None or not low <= value <= high:
                problems.append(f"{key} {p}: analyze {value}, DuckDB between {low} and {high}")
    subs = {s["subscriber"]: s for s in printed["subscribers"]}
    if subs.keys() != want["subscribers"].keys():
        problems.append(
            f"subscribers: missing {sorted(want['subscribers'].keys() - subs.keys())}, "
            f"extra {sorted(subs.keys() - want['subscribers'].keys())}"
        )
    for name, w in want["subscribers"].items():
        row = subs.get(name)
        for field in ("deliveries", *COUNTS) if row else ():
            if field not in row:
                if field in SUBSCRIBER_REQUIRED:
                    problems.append(f"subscriber {name} {field}: missing from analyze's JSON")
            elif row[field] != w[field]:
                problems.append(f"subscriber {name} {field}: analyze {row[field]}, DuckDB {w[field]}")
    return problems


# --- the runs -------------------------------------------------------------------------------------


def analyze(env, out, label):
    """One `manage.py analyze --json --out DIR` in a new process; returns its record."""
    load_before = os.getloadavg()
    wall, stdout, stderr, peak, cpu, code = timed(
        [sys.executable, "manage.py", "analyze", "--json", "--out", str(out)], env, ROOT
    )
    record = {
        "run": label,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 1),
        "peak_rss_mb": round(peak / 2**20),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "exit": code,
    }
    printed = _json_in(stdout)
    if code or printed is None:
        record["error"] = (stderr or stdout)[-3000:]
    return record, printed


def _json_in(stdout):
    """The object analyze printed: all of stdout, or else its last line that is one."""
    try:
        return json.loads(stdout)
    except ValueError:
        pass
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def check(record, printed, want):
    if printed is None:
        record["check"] = "FAIL: analyze printed no JSON"
        record["problems"] = [record.get("error", "")]
        return
    problems = compare(printed, want)
    record["check"] = "FAIL" if problems else "ok"
    record["problems"] = problems[:50]
    record["problem_count"] = len(problems)
    if problems:
        print(f"  FAIL: {record['run']}: {len(problems)} disagreements with DuckDB, e.g.", file=sys.stderr)
        for p in problems[:8]:
            print(f"    {p}", file=sys.stderr)


def one_archive(
    workdir, size, layout, master, runs, extra_env=None, days=history.DAYS, hot_messages=history.HOT_MESSAGES
):
    """Generate an archive and its hot set, run analyze `runs` ("first", "rerun", "hour")."""
    base = Path(workdir) / f"{layout}-{size}"
    archive, hot = base / "archive", base / "hot"
    info = history.generate_archive(archive, size, files=layout, days=days)
    print(
        f"{layout} {size:,}: {info['files_per_kind']} files per kind, {info['parquet_bytes'] / 1e6:.0f} MB, "
        f"generated in {info['generate_s']} s",
        file=sys.stderr,
    )
    url = fresh_database(base.parent)
    env = {**os.environ, "DATABASE_URL": url}
    info["hot"] = json.loads(
        history_script(env, "hot", "--archive", str(archive), "--messages", str(hot_messages))
    )
    history_script(env, "dump-hot", str(hot))
    env |= {"SPARK_MASTER": master, "MQ_ARCHIVE_DIR": str(archive), **(extra_env or {})}
    out = base / "out"
    records = []
    for label in runs:
        if label == "hour":
            per_hour = max(1, info["messages"] // (info["days"] * 24 * info["queues"]))
            added = history.add_hour(
                archive, queue=history.QUEUES[0], first_id=info["messages"] + 1, n_messages=per_hour
            )
            info["added_hour"] = {"messages": added[0], "deliveries": added[1]}
        want = expected(archive, hot)
        record, printed = analyze(env, out, label)
        record |= {
            "layout": layout,
            "deliveries": size,
            "input_rows": _input_rows(archive, hot),
            "unique_messages": want["messages"],
            "unique_deliveries": want["deliveries"],
        }
        check(record, printed, want)
        if label == "first":
            record["printed"] = printed  # what analyze said, for a look after a FAIL
        print(
            f"  {label:<6} {record['wall_s']:>7.1f} s wall, {record['cpu_s']:>6.1f} s CPU, "
            f"{record['peak_rss_mb']:>5} MB, load {record['load_before'][0]:.2f}: {record['check']}",
            file=sys.stderr,
        )
        records.append(record)
    return info, records


def _input_rows(archive, hot):
    """Messages plus deliveries the run reads: every archived row and every hot row."""
    db = duckdb.connect()
    return sum(
        db.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchone()[0]
        for path in (
            f"{archive}/messages/**/*.parquet",
            f"{archive}/deliveries/**/*.parquet",
            f"{hot}/messages.parquet",
            f"{hot}/deliveries.parquet",
        )
    )


def fit(points, cores):
    """Least squares wall = fixed + rows * slope; returns (fixed s, rows/s per core past it)."""
    if len(points) < 2:
        return None, None
    n = len(points)
    mx = sum(r for r, _ in points) / n
    my = sum(w for _, w in points) / n
    sxx = sum((r - mx) ** 2 for r, _ in points)
    slope = sum((r - mx) * (w - my) for r, w in points) / sxx
    fixed = my - slope * mx
    return round(fixed, 2), (round(1 / slope / cores) if slope > 0 else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=5_000_000, help="the archive of the layout runs")
    parser.add_argument("--layouts", default="hourly,daily", help="hourly, daily, or both")
    parser.add_argument(
        "--sizes", default="1000000,2500000", help="more hourly sizes for the fit ('' for none)"
    )
    parser.add_argument("--runs", default="first,rerun,hour", help="which runs per layout")
    parser.add_argument(
        "--days", type=int, default=history.DAYS, help="the layout runs' history spans this many days"
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--local-bytes", type=int, default=None, help="MQ_ANALYTICS_LOCAL_BYTES for the runs (0: Spark only)"
    )
    parser.add_argument(
        "--connect", action="store_true", help="run Spark on a long-lived Spark Connect server (SPARK_REMOTE)"
    )
    parser.add_argument("--workdir", default=str(ROOT / "var" / "bench-analytics"))
    parser.add_argument("--keep", action="store_true", help="keep the archives and outputs in --workdir")
    parser.add_argument(
        "--hot-messages",
        type=int,
        default=history.HOT_MESSAGES,
        help="live messages in the hot tables beside the archive (5 deliveries each)",
    )
    args = parser.parse_args()
    cores = int(args.master.removeprefix("local[").rstrip("]")) if args.master.startswith("local[") else None
    runs = [r for r in args.runs.split(",") if r]
    machine = harness.machine()
    began = time.perf_counter()
    workdir = Path(args.workdir)
    if workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    archives, records = [], []
    extra_env = {} if args.local_bytes is None else {"MQ_ANALYTICS_LOCAL_BYTES": str(args.local_bytes)}
    server = None
    if args.connect:
        server, extra_env["SPARK_REMOTE"] = start_connect_server(args.master, cores)
    try:
        for layout in [x for x in args.layouts.split(",") if x]:
            info, recs = one_archive(
                workdir,
                args.deliveries,
                layout,
                args.master,
                runs,
                extra_env,
                days=args.days,
                hot_messages=args.hot_messages,
            )
            archives.append(info)
            records += recs
            _remove(workdir / f"{layout}-{args.deliveries}", args.keep)
        for size in [int(s) for s in args.sizes.split(",") if s]:
            info, recs = one_archive(workdir, size, "hourly", args.master, ["first"], extra_env)
            archives.append(info)
            records += recs
            _remove(workdir / f"hourly-{size}", args.keep)
    finally:
        if server is not None:
            stop_connect_server(server)
        if not args.keep:
            _remove(workdir, False)
    points = [
        (r["input_rows"], r["wall_s"]) for r in records if r["run"] == "first" and r["layout"] == "hourly"
    ]
    fixed, rate = fit(points, cores or 1)
    # The same line through CPU seconds (the process tree's): less skewed by other work on the
    # machine than wall time, though not free of it.
    cpu_fixed, cpu_rate = fit(
        [(r["input_rows"], r["cpu_s"]) for r in records if r["run"] == "first" and r["layout"] == "hourly"], 1
    )
    result = {
        "benchmark": "analytics",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": harness.git("rev-parse", "--short", "HEAD"),
        "machine": machine,
        "master": args.master,
        "cores": cores,
        "settings": dict(extra_env),
        "command": "manage.py analyze --json --out DIR (a new process per run)",
        "archives": archives,
        "runs": records,
        "fit": {"points": points, "fixed_s": fixed, "input_rows_per_s_per_core": rate},
        "cpu_fit": {"fixed_cpu_s": cpu_fixed, "input_rows_per_cpu_s": cpu_rate},
        "failed": [f"{r['run']} {r['layout']} {r['deliveries']:,}" for r in records if r["check"] != "ok"],
        "wall_s": round(time.perf_counter() - began, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"analytics-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'layout':<7} {'deliveries':>10} {'run':<6} {'wall s':>7} {'CPU s':>6} {'RSS MB':>6} "
        f"{'rows/s/core':>11} {'load':>5}  check"
    )
    for r in records:
        per_core = round(r["input_rows"] / r["wall_s"] / (cores or 1))
        print(
            f"{r['layout']:<7} {r['deliveries']:>10,} {r['run']:<6} {r['wall_s']:>7.1f} {r['cpu_s']:>6.1f} "
            f"{r['peak_rss_mb']:>6} {per_core:>11,} {r['load_before'][0]:>5.2f}  {r['check']}"
        )
    if fixed is not None:
        print(f"fit over the hourly first runs: fixed {fixed} s, then {rate or 0:,} input rows/s per core")
        print(f"  in CPU time: fixed {cpu_fixed} CPU s, then {cpu_rate or 0:,} input rows per CPU second")
    print(f"written to {path.relative_to(ROOT)}")
    if result["failed"]:
        print(f"FAIL: analyze disagrees with DuckDB in {', '.join(result['failed'])}")
        return 1
    return 0


def _remove(path, keep):
    if not keep and Path(path).exists():
        import shutil

        shutil.rmtree(path)


if __name__ == "__main__":
    sys.exit(main())
