"""What an operator waits for at scale: every admin page, the dashboard's socket, /metrics,
`queuestats`, a pull from a big backlog, and what open dashboards cost a publisher, against a
services-mode server (Daphne processes and Celery workers as `make run` starts them,
PostgreSQL, Redis) holding a backlog of 2 million pending deliveries (bench/backlog.py).

Run with `make bench-operators` (2 million) or `.venv/bin/python bench/operators.py`;
`--rows`, `--on-w5` (the backlog on top of W5's 10 million rows, as `make bench` runs it) and
`--rebuild` choose the database. Prints a markdown table with each figure beside its target
and writes bench/results/operators-<UTC time>.json.
"""

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path

import backlog
import psycopg
import redis
from harness import PG_SERVER, RESULTS, ROOT, Client, git, machine, message, services_server, update_readme

REDIS_URL = "redis://127.0.0.1:6379/13"  # this benchmark's own db (others: 9-12), flushed
RUN_DB = "mq_bench_operators_run"
METRICS_TOKEN = "ops-bench-metrics-token"
REPEAT = 3  # requests per page, scrapes, queuestats runs, pulls
PUBLISHES, WARMUP = 300, 20
ROUNDS = 3  # publishes alone and with dashboards open, interleaved
BLOCK_SECS = 5.0  # each round's publishes last at least this: long enough to count snapshots
DASHBOARDS = 3
SETTLE_SECS = 5.0  # after the server starts: beat's first sweeps, the first connections

# The targets.
PAGE_S = 1.0
FIRST_SNAPSHOT_S = 1.0
SNAPSHOTS_PER_S = 0.9  # "one a second", from the gaps between snapshots, with room for jitter
METRICS_S = 0.5
QUEUESTATS_S = 1.0
PUBLISH_RATIO = 1.2

# Rows picked for the change pages: the subscriber, queue and subscription with the big backlog
# and rows of theirs. Other models of the admin index get the first row of their changelist.
PICKS = {
    "subscribers/subscriber": "SELECT id FROM subscribers_subscriber WHERE name = 'ops-sub-0'",
    "queues/queue": "SELECT id FROM queues_queue WHERE name = 'ops-a'",
    "queues/event": """SELECT e.id FROM queues_event e JOIN queues_queue q ON q.id = e.queue_id
                       WHERE q.name = 'ops-a' AND e.name = 'create'""",
    "queues/message": """SELECT m.id FROM queues_message m JOIN queues_queue q ON q.id = m.queue_id
                         WHERE q.name = 'ops-a' ORDER BY m.seq LIMIT 1""",
    "subscribers/subscription": """SELECT s.id FROM subscribers_subscription s
                                   JOIN subscribers_subscriber b ON b.id = s.subscriber_id
                                   JOIN queues_queue q ON q.id = s.queue_id
                                   WHERE b.name = 'ops-sub-0' AND q.name = 'ops-a'""",
    "delivery/delivery": """SELECT d.id FROM delivery_delivery d
                            JOIN subscribers_subscriber b ON b.id = d.subscriber_id
                            WHERE b.name = 'ops-sub-0' AND d.status = 'pending' LIMIT 1""",
    "delivery/deadletter": "SELECT id FROM delivery_delivery WHERE status = 'dead' LIMIT 1",
    "subscribers/connection": """SELECT c.id FROM subscribers_connection c
                                 JOIN subscribers_subscriber b ON b.id = c.subscriber_id
                                 WHERE b.name = 'ops-watch' LIMIT 1""",
    "auth/user": f"SELECT id FROM auth_user WHERE username = '{backlog.ADMIN}'",
}
TOOLS = ["/admin/", "/admin/tools/head-of-line/", "/"]  # the admin index, head of line, the dashboard page


def pct(values, p):
    values = sorted(values)
    return values[min(int(round(p / 100 * (len(values) - 1))), len(values) - 1)] if values else None


def server_env(db_url):
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "REDIS_URL": REDIS_URL,
        "MQ_THROTTLE_RATE": "1000000/s",
        "MQ_METRICS_TOKEN": METRICS_TOKEN,
        "DEBUG": "false",
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


# --- the operator's HTTP: a logged-in superuser session -----------------------------------------


class Browser:
    """An operator's browser: one keep-alive HTTP/1.1 connection that keeps the cookies the
    server sets (the session, CSRF). Redirects are not followed."""

    def __init__(self, port, headers=None):
        self.port, self.headers, self.cookies, self.conn = port, headers or {}, {}, None

    def request(self, method, path, body=None, headers=None):
        """(seconds from sending to the last byte of the body, status, headers, body)."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        cookie = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        sent = {**self.headers, **({"Cookie": cookie} if cookie else {}), **(headers or {})}
        started = time.perf_counter()
        try:
            self.conn.request(method, path, body, sent)
            answer = self.conn.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = None
            raise
        took = time.perf_counter() - started
        for name, value in answer.getheaders():
            if name.lower() == "set-cookie":
                key, _, val = value.split(";", 1)[0].partition("=")
                self.cookies[key.strip()] = val
        return took, answer.status, answer, data

    def close(self):
        if self.conn is not None:
            self.conn.close()


def login(port):
    browser = Browser(port)
    _, _, _, page = browser.request("GET", "/admin/login/")
    csrf = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1].decode()
    form = urllib.parse.urlencode(
        {
            "csrfmiddlewaretoken": csrf,
            "username": backlog.ADMIN,
            "password": backlog.ADMIN_PASSWORD,
            "next": "/admin/",
        }
    )
    _, status, _, body = browser.request(
        "POST", "/admin/login/", form, {"Content-Type": "application/x-www-form-urlencoded"}
    )
    if status != 302 or "sessionid" not in browser.cookies:
        raise RuntimeError(f"the admin login answered {status}: {body[:300]!r}")
    return browser


def time_page(browser, path, repeat=REPEAT):
    seconds, statuses, body = [], [], b""
    for _ in range(repeat):
        took, status, _, body = browser.request("GET", path)
        seconds.append(took)
        statuses.append(status)
    return {
        "path": path,
        "seconds": [round(s, 4) for s in seconds],
        "median_s": round(statistics.median(seconds), 4),
        "statuses": statuses,
        "bytes": len(body),
        "ok": all(s == 200 for s in statuses),
    }, body.decode(errors="replace")


def admin_pages(browser, db_url):
    """The admin index's every changelist, then one change page of each of those models."""
    index = browser.request("GET", "/admin/")[3].decode()
    models = sorted(set(re.findall(r'href="/admin/([a-z0-9_]+)/([a-z0-9_]+)/"', index)))
    out = {"tools": [], "changelists": [], "changes": []}
    for path in TOOLS:
        out["tools"].append(time_page(browser, path)[0])
    first_rows = {}
    for app, model in models:
        row, body = time_page(browser, f"/admin/{app}/{model}/")
        out["changelists"].append({"model": f"{app}/{model}", **row})
        found = re.search(rf'href="/admin/{app}/{model}/(\d+)/change/', body)
        first_rows[f"{app}/{model}"] = int(found[1]) if found else None
        print(f"  changelist {app}/{model}: {row['median_s']:.3f} s", flush=True)
    with psycopg.connect(db_url, autocommit=True) as conn:
        for app, model in models:
            key, pk = f"{app}/{model}", None
            if key in PICKS:
                try:
                    got = conn.execute(PICKS[key]).fetchone()
                    pk = got[0] if got else None
                except psycopg.Error:  # the schema moved on: take the changelist's first row
                    pk = None
            pk = pk or first_rows.get(key)
            if pk is None:
                out["changes"].append({"model": key, "path": None, "skipped": "no row"})
                continue
            row, _ = time_page(browser, f"/admin/{app}/{model}/{pk}/change/")
            out["changes"].append({"model": key, **row})
            print(f"  change page {key} #{pk}: {row['median_s']:.3f} s", flush=True)
    return out


class Scrapes:
    """/metrics with the scraper's token, each at least the server's snapshot age apart (as a
    Prometheus scraping every 15 s would find it): a scrape inside that age is a cache hit."""

    def __init__(self, port, min_gap):
        self.min_gap, self.last, self.rows = min_gap, None, []
        self.browser = Browser(port, {"Authorization": f"Bearer {METRICS_TOKEN}"})

    def scrape(self, wait=False):
        if self.last is not None and time.monotonic() - self.last < self.min_gap:
            if not wait:
                return
            time.sleep(self.min_gap - (time.monotonic() - self.last))
        took, status, answer, body = self.browser.request("GET", "/metrics")
        self.last = time.monotonic()
        age = answer.getheader("Age")
        self.rows.append({"seconds": round(took, 4), "status": status, "age": age, "bytes": len(body)})
        print(f"  /metrics: {took:.3f} s (Age {age})", flush=True)

    def result(self):
        self.browser.close()
        seconds = [r["seconds"] for r in self.rows]
        return {
            "scrapes": self.rows,
            "median_s": round(statistics.median(seconds), 4),
            "ok": all(r["status"] == 200 for r in self.rows),
        }


def queuestats(env):
    """`manage.py queuestats --json` as an operator runs it, beside `manage.py help queuestats`
    (the same process start and Django setup, no query) for what the start alone costs."""

    def run(*args):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode:
            raise RuntimeError(f"manage.py {' '.join(args)} failed: {done.stderr[-1000:]}")
        return time.perf_counter() - started, done.stdout

    start_only, seconds, rows = [], [], []
    for _ in range(REPEAT):  # interleaved: the machine's other load weighs on both alike
        start_only.append(run("help", "queuestats")[0])
        took, out = run("queuestats", "--json")
        seconds.append(took)
        rows = json.loads(out)["queues"]
    print(f"  queuestats --json: {statistics.median(seconds):.3f} s", flush=True)
    return {
        "seconds": [round(s, 4) for s in seconds],
        "median_s": round(statistics.median(seconds), 4),
        "startup_median_s": round(statistics.median(start_only), 4),
        "pending": sum(r["pending"] for r in rows),
        "queues": rows,
    }


def pull(port, token):
    """GET /api/deliveries?limit=100 as a subscriber with the big backlog, then the ack of what
    came (the backlog keeps all but these few hundred)."""
    client, rows = Client(port, token), []
    for _ in range(REPEAT):
        started = time.perf_counter()
        status, body = client.request("GET", "/api/deliveries?limit=100")
        took = time.perf_counter() - started
        ids = [d["id"] for d in json.loads(body)["deliveries"]] if status == 200 else []
        started = time.perf_counter()
        ack_status, _ = client.request("POST", "/api/deliveries/ack", {"ids": ids})
        rows.append(
            {
                "seconds": round(took, 4),
                "got": len(ids),
                "status": status,
                "ack_seconds": round(time.perf_counter() - started, 4),
                "ack_status": ack_status,
            }
        )
    client.close()
    print(f"  pull of 100: {statistics.median(r['seconds'] for r in rows):.3f} s", flush=True)
    return {
        "pulls": rows,
        "median_s": round(statistics.median(r["seconds"] for r in rows), 4),
        "ok": all(r["status"] == 200 and r["got"] == 100 and r["ack_status"] == 200 for r in rows),
    }


class Publisher:
    """Single REST publishes to a backlog queue (10 subscriptions each), one at a time, on one
    keep-alive connection; WARMUP first, not counted."""

    def __init__(self, port, token):
        self.client, self.i, self.failed = Client(port, token), 0, 0
        self.run(WARMUP)

    def run(self, n, at_least=0.0):
        """n publishes, and more until `at_least` seconds have passed; their latencies."""
        seconds, began = [], time.monotonic()
        while len(seconds) < n or time.monotonic() - began < at_least:
            self.i += 1
            started = time.perf_counter()
            status, _ = self.client.request(
                "POST", f"/api/queues/{backlog.QUEUES[0]}/messages", message(self.i)
            )
            seconds.append(time.perf_counter() - started)
            self.failed += status != 201
        return seconds

    def close(self):
        self.client.close()


def latency(seconds):
    return {
        "n": len(seconds),
        "p50_ms": round(pct(seconds, 50) * 1000, 2),
        "p95_ms": round(pct(seconds, 95) * 1000, 2),
        "max_ms": round(max(seconds) * 1000, 2),
    }


# --- sockets: the dashboards, and a subscriber's socket for a Connection row --------------------


class Socket(threading.Thread):
    """A websocket in a thread of its own, recording when each frame came."""

    def __init__(self, url, headers=None, first=None):
        super().__init__(daemon=True)
        self.url, self.headers, self.first_frame = url, headers or {}, first
        self.frames, self.error, self.ws = [], None, None
        self.ready, self.started_at = threading.Event(), None

    def run(self):
        from websockets.sync.client import connect

        self.started_at = time.monotonic()
        try:
            with connect(self.url, additional_headers=self.headers, max_size=None, open_timeout=60) as ws:
                self.ws = ws
                if self.first_frame is not None:
                    ws.send(json.dumps(self.first_frame))
                for raw in ws:
                    frame = json.loads(raw)
                    self.frames.append((time.monotonic(), frame.get("type"), len(raw)))
                    if frame.get("type") in ("snapshot", "subscribed"):
                        self.ready.set()
        except Exception as exc:
            self.error = repr(exc)
        finally:
            self.ready.set()

    def close(self):
        if self.ws is not None:
            self.ws.close()
        self.join(30)

    def snapshots(self, since=None, until=None):
        return [
            t for t, kind, _ in self.frames if kind == "snapshot" and (since is None or since <= t < until)
        ]


def open_dashboard(port, session_cookie):
    dash = Socket(f"ws://127.0.0.1:{port}/ws/dashboard/", {"Cookie": f"sessionid={session_cookie}"})
    dash.start()
    # Generous: at 12 million rows (--on-w5) a first snapshot of the server before issue 18
    # may take tens of seconds, and that is a figure, not a failure.
    if not dash.ready.wait(300) or dash.error or not dash.snapshots():
        raise RuntimeError(f"the dashboard sent no snapshot: {dash.error}")
    first = dash.snapshots()[0] - dash.started_at
    print(f"  dashboard's first snapshot: {first:.3f} s", flush=True)
    return dash, first


def rates(dashboards, since, until):
    """Snapshots a second each dashboard got between `since` and `until`: from the gaps between
    them (a count over a few seconds would be off by one tick), and the longest gap."""
    out = []
    for d in dashboards:
        times = d.snapshots(since, until)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        out.append(
            {
                "snapshots": len(times),
                "seconds": round(until - since, 2),
                "per_s": round(len(gaps) / sum(gaps), 2) if gaps else round(len(times) / (until - since), 2),
                "max_gap_s": round(max(gaps), 2) if gaps else None,
                "bytes": d.frames[-1][2] if d.frames else None,
            }
        )
    return out


def dashboards_and_publishes(port, token, cookie, window):
    """ROUNDS rounds of: PUBLISHES / ROUNDS publishes alone, then DASHBOARDS dashboards opened
    one after another (each one's first snapshot timed), then as many publishes with them
    open, counting their snapshots; the dashboards closed. Interleaved, so that the other
    load on a shared machine weighs on both alike. The first round also counts the open
    dashboards' snapshots for `window` seconds with nothing else going on."""
    publisher = Publisher(port, token)
    alone, beside, firsts, idle, busy, errors = [], [], [], None, [], []
    per_round = PUBLISHES // ROUNDS
    try:
        for k in range(ROUNDS):
            alone += publisher.run(per_round, BLOCK_SECS)
            dashboards = []
            try:
                for _ in range(DASHBOARDS):
                    dash, first = open_dashboard(port, cookie)
                    dashboards.append(dash)
                    firsts.append(first)
                if k == 0:
                    since = time.monotonic()
                    time.sleep(window)
                    idle = rates(dashboards, since, time.monotonic())
                    print(f"  snapshots a second, {DASHBOARDS} dashboards: {[r['per_s'] for r in idle]}")
                else:
                    time.sleep(1.5)  # the opening's first snapshots out of the way
                since = time.monotonic()
                beside += publisher.run(per_round, BLOCK_SECS)
                busy += rates(dashboards, since, time.monotonic())
            finally:
                for d in dashboards:
                    d.close()
                    if d.error:
                        errors.append(d.error)
            print(f"  round {k + 1}: alone {latency(alone)}, with dashboards {latency(beside)}", flush=True)
    finally:
        publisher.close()
    return {
        "publish": {"alone": latency(alone), "dashboards": latency(beside), "failed": publisher.failed},
        "dashboards": {
            "first_snapshot_s": [round(f, 4) for f in firsts],
            "window_s": window,
            "idle": idle,
            "while_publishing": busy,
            "errors": errors,
        },
    }


def measure(port, env, db_url, window, backlog_each):
    toks = backlog.tokens(env, backlog.PUBLISHER, backlog.BACKLOG_SUBSCRIBER, backlog.WATCHER)
    time.sleep(SETTLE_SECS)
    browser = login(port)
    watcher = Socket(
        f"ws://127.0.0.1:{port}/ws/?token={toks['ops-watch']}",
        first={"type": "subscribe", "queue": "ops-live"},
    )
    watcher.start()
    if not watcher.ready.wait(60) or watcher.error:
        raise RuntimeError(f"the watcher's socket did not subscribe: {watcher.error}")
    scrapes = Scrapes(port, float(env.get("MQ_METRICS_MAX_AGE_SECS") or 5.0) + 1.0)
    out = {"backlog_each": backlog_each}
    try:
        scrapes.scrape()
        out["queuestats"] = queuestats(env)
        scrapes.scrape(wait=True)
        out["admin"] = admin_pages(browser, db_url)
        scrapes.scrape(wait=True)
        out["metrics"] = scrapes.result()
        out["pull"] = pull(port, toks["ops-sub-0"])
        out.update(dashboards_and_publishes(port, toks["ops-pub"], browser.cookies["sessionid"], window))
    finally:
        watcher.close()
        browser.close()
    return out


# --- the table ------------------------------------------------------------------------------------


def table_rows(res, each_page=True):
    """(surface, figure, target, met) for the table; met is None where no target applies. With
    `each_page` false (bench/README.md's table), one row for each kind of admin page: its
    slowest page, and how many answered an error."""
    rows = []
    for group, label in (("tools", "page"), ("changelists", "changelist"), ("changes", "change page")):
        pages = [r for r in res["admin"][group] if r.get("path") is not None]  # a model with no row: none
        if not each_page and pages:
            slowest = max(pages, key=lambda r: r["median_s"])
            failed = sum(not r["ok"] for r in pages)
            fig = f"{slowest['median_s']:.3f} s ({slowest.get('model') or slowest['path']})"
            fig += f", {failed} answered an error" if failed else ""
            met = not failed and slowest["median_s"] <= PAGE_S
            rows.append((f"{label}s: the slowest of {len(pages)}", fig, f"≤ {PAGE_S:g} s", met))
            continue
        for r in pages:
            fig = f"{r['median_s']:.3f} s" + ("" if r["ok"] else f" (HTTP {r['statuses']})")
            met = r["ok"] and r["median_s"] <= PAGE_S
            rows.append((f"{label} {r.get('model') or r['path']}", fig, f"≤ {PAGE_S:g} s", met))
    d = res["dashboards"]
    firsts = d["first_snapshot_s"]
    rows.append(
        (
            f"dashboard's first snapshot (median, worst of {len(firsts)})",
            f"{statistics.median(firsts):.3f} s, {max(firsts):.3f} s",
            f"≤ {FIRST_SNAPSHOT_S:g} s",
            max(firsts) <= FIRST_SNAPSHOT_S,
        )
    )
    for key, label in (("idle", f"over {d['window_s']:g} s"), ("while_publishing", "while publishing")):
        per = [r["per_s"] for r in d[key]]
        got = sum(r["snapshots"] for r in d[key])
        rows.append(
            (
                f"snapshots a second to each open dashboard ({DASHBOARDS} open), {label}",
                f"{min(per):.2f} to {max(per):.2f} ({got} snapshots)",
                f"≥ {SNAPSHOTS_PER_S:g} each",
                min(per) >= SNAPSHOTS_PER_S and not d["errors"],
            )
        )
    m = res["metrics"]
    rows.append(
        (
            "/metrics scrape",
            f"{m['median_s']:.3f} s",
            f"≤ {METRICS_S:g} s",
            m["ok"] and m["median_s"] <= METRICS_S,
        )
    )
    q = res["queuestats"]
    rows.append(
        (
            "`manage.py queuestats --json`",
            f"{q['median_s']:.3f} s (its process start alone {q['startup_median_s']:.3f} s)",
            f"≤ {QUEUESTATS_S:g} s",
            q["median_s"] <= QUEUESTATS_S,
        )
    )
    p = res["pull"]
    rows.append(
        ("REST pull of 100 from a 200,000 backlog", f"{p['median_s']:.3f} s", "", None if p["ok"] else False)
    )
    pub = res["publish"]
    for q in ("p50", "p95"):
        alone, beside = pub["alone"][f"{q}_ms"], pub["dashboards"][f"{q}_ms"]
        rows.append(
            (
                f"single REST publish {q}: alone → {DASHBOARDS} dashboards open",
                f"{alone:.1f} → {beside:.1f} ms ({beside / alone:.2f}×)",
                f"≤ {PUBLISH_RATIO:g}×",
                beside / alone <= PUBLISH_RATIO and not pub["failed"],
            )
        )
    return rows


def markdown(rows):
    mark = {True: "✓", False: "✗", None: ""}
    lines = ["| surface | figure | target | met |", "| --- | ---: | ---: | :---: |"]
    lines += [f"| {name} | {figure} | {target} | {mark[met]} |" for name, figure, target, met in rows]
    return "\n".join(lines)


def readme_block(header, path, res):
    """What goes between the README's markers: the table with one row for each kind of admin
    page (every page's own row is in the results file's `table`)."""
    text = markdown(table_rows(res, each_page=False))
    where = f"`{path.relative_to(ROOT / 'bench')}` (every page's own time is in its `table`)"
    return f"{header}.\n\n{where}\n\n{text}"


def versions():
    out = {}
    with psycopg.connect(f"{PG_SERVER}/postgres", connect_timeout=5) as conn:
        out["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
    out["redis"] = redis.Redis.from_url(REDIS_URL, socket_timeout=5).info("server")["redis_version"]
    return out


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="pending deliveries of the backlog")
    parser.add_argument(
        "--on-w5", action="store_true", help="make the backlog on top of W5's 10 million rows"
    )
    parser.add_argument("--rebuild", action="store_true", help="make the template database again")
    parser.add_argument(
        "--build-only", action="store_true", help="make (or check) the template, time nothing"
    )
    parser.add_argument("--keep", action="store_true", help=f"keep the run's copy ({RUN_DB}) and the logs")
    parser.add_argument("--update-readme", action="store_true", help="put the table into bench/README.md")
    parser.add_argument("--window", type=float, default=10.0, help="seconds the dashboards' rate is counted")
    parser.add_argument(
        "--web-processes", type=int, default=int(os.environ.get("MQ_WEB_PROCESSES") or os.cpu_count() or 1)
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    now, host = datetime.now(UTC), machine()
    host["uptime_before"] = uptime()
    workdir = Path(tempfile.mkdtemp(prefix="mqoperators-"))
    print(f"work dir {workdir}; {host['uptime_before']}", flush=True)
    redis.Redis.from_url(REDIS_URL, socket_timeout=5).flushdb()
    started = time.monotonic()
    template, info, made = backlog.ensure(
        server_env(""), args.rows, args.on_w5, args.rebuild, workdir, args.web_processes
    )
    build_s = round(time.monotonic() - started, 1)
    print(f"template {template}: {json.dumps(info)}", flush=True)
    if args.build_only:
        return
    db_url = f"{PG_SERVER}/{RUN_DB}"
    copied = backlog.copy(template, RUN_DB)
    print(f"copied into {RUN_DB} in {copied['seconds']} s ({copied['bytes'] / 2**30:.1f} GiB)", flush=True)
    env = server_env(db_url)
    redis.Redis.from_url(REDIS_URL, socket_timeout=5).flushdb()
    started = time.monotonic()
    try:
        with services_server(env, workdir, args.web_processes) as port:
            res = measure(port, env, db_url, args.window, info["messages"])
    finally:
        if not args.keep:
            backlog.drop(RUN_DB)
    timings_s = round(time.monotonic() - started, 1)
    host["uptime_after"] = uptime()
    host["loadavg_after"] = os.getloadavg()
    rows = table_rows(res)
    text = markdown(rows)
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    header = (
        f"{now.strftime('%Y-%m-%d %H:%M')} UTC, commit `{commit[:7]}`{' (uncommitted changes)' * dirty}, "
        f"{info.get('rows', args.rows):,} pending deliveries{' on W5' if args.on_w5 else ''} "
        f"({template}), {args.web_processes} Daphne processes + Celery; {host['nproc']} CPUs "
        f"({host['cpu_model']}); load average {host['loadavg_before'][0]:.1f} before, "
        f"{host['loadavg_after'][0]:.1f} after"
    )
    print(f"\n{header}\n\n{text}\n")
    result = {
        "benchmark": "operators",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "machine": host,
        "versions": versions(),
        "args": vars(args),
        "template": {"name": template, "made_now": made, "ensure_s": build_s, **info},
        "copy": copied,
        "timings_s": timings_s,
        "results": res,
        "table": [dict(zip(("surface", "figure", "target", "met"), r, strict=True)) for r in rows],
        "markdown": f"{header}\n\n{text}",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"operators-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"written: {path.relative_to(ROOT)} (template ready in {build_s} s, timings {timings_s} s)")
    if args.update_readme:
        update_readme(
            "operators-w5" if args.on_w5 else "operators",
            readme_block(header, path, res),
        )
    broken = failures(res)
    if broken:
        print(f"kept the server logs in {workdir}")
        sys.exit("FAILED: " + "; ".join(broken))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


def failures(res):
    """What did not work at all (an error answer, a socket that failed): unlike a missed
    target, these make the run fail."""
    out = [
        f"{r['path']} answered {r['statuses']}"
        for g in res["admin"].values()
        for r in g
        if r.get("ok") is False
    ]
    out += [f"a dashboard: {e}" for e in res["dashboards"]["errors"]]
    if not res["metrics"]["ok"]:
        out.append(f"/metrics answered {[r['status'] for r in res['metrics']['scrapes']]}")
    if not res["pull"]["ok"]:
        out.append(f"the pull: {res['pull']['pulls']}")
    if res["publish"]["failed"]:
        out.append(f"{res['publish']['failed']} publishes were not answered 201")
    return out


if __name__ == "__main__":
    main()
