"""Webhook deliveries per second with ONE Celery worker, on SQLite (embedded mode) and on
PostgreSQL + Redis (services mode). Run with `.venv/bin/python bench/webhook_rate.py`.

For each mode: a fresh database, `migrate`, a queue `bench`, a subscriber `hook` whose webhook
is a fast receiver in this process (a threaded HTTP/1.1 server on loopback answering 200),
subscribed to the queue over the REST API, and a publisher. MESSAGES messages are published in
batches of BATCH through Daphne, which is then stopped; only then does one worker start
(`celery -A mqsite worker -B -Q webhooks,maintenance,celery -P threads -c 8 -l warning`: the
queues `make run` gives two workers, served by one). The clock
runs from the worker's start until every delivery is acked, by the time the database stamped
on the last ack. The receiver must have seen every message id, a sample of the posts must
carry a valid Standard Webhooks signature, and `queuestats --json` must count every delivery
acked. Each run is bounded by TIME_LIMIT seconds. Writes bench/results/webhook_rate-<UTC>.json.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import redis
from harness import (  # bench/, the script's own directory, is first on sys.path
    PAYLOAD_BYTES,
    RESULTS,
    ROOT,
    Client,
    fresh_database,
    git,
    machine,
    manage,
    message,
    server,
)
from standardwebhooks import Webhook

PG_DB = "mqsite_whbench"
REDIS_URL = "redis://127.0.0.1:6379/10"
MESSAGES = 2_000
BATCH = 100
TIME_LIMIT = 120.0  # seconds from the worker's start
SIGNATURE_SAMPLE = 50
CELERY = Path(sys.executable).parent / "celery"
WORKER_ARGS = [
    "-A",
    "mqsite",
    "worker",
    "-B",
    "-Q",
    "webhooks,maintenance,celery",
    "-P",
    "threads",
    "-c",
    "8",
]
WORKER_ARGS += ["-l", "warning"]

# The embedded mode's broker is a folder, by default var/celery of the working tree, which
# any other embedded worker on this tree would share (and take our jobs from). These settings
# are the project's with only that folder moved into the run's own directory.
SETTINGS_MODULE = "webhook_bench_settings"
SETTINGS = """
from mqsite.settings import *  # noqa: F403
from mqsite.settings import CELERY_BROKER_TRANSPORT_OPTIONS

FOLDER = {folder!r}
CELERY_BROKER_TRANSPORT_OPTIONS = {{
    **CELERY_BROKER_TRANSPORT_OPTIONS,
    "data_folder_in": FOLDER + "/queue",
    "data_folder_out": FOLDER + "/queue",
    "processed_folder": FOLDER + "/processed",
    "control_folder": FOLDER + "/control",
}}
"""

# The database's own clock on the last ack, as epoch seconds (the bench and the database share
# the machine's clock).
LAST_ACK = """
from django.db.models import Max
from delivery.models import Delivery
last = Delivery.objects.filter(status="acked").aggregate(at=Max("acked_at"))["at"]
print(last.timestamp() if last else "")
"""


class Receiver:
    """A threaded HTTP/1.1 server on loopback (keep-alive, as a real endpoint would be) that
    answers 200 at once and records each post: (monotonic time, headers, body).

    TCP_NODELAY: the handler writes the headers and the body in two sends; with Nagle's
    algorithm the body would wait for the client's delayed ACK, some 20-40 ms a post, and
    the benchmark would measure that instead of the worker."""

    def __init__(self):
        self.posts = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    receiver.posts.append((time.monotonic(), dict(self.headers), body))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self):
        with self.lock:
            self.posts = []

    def snapshot(self):
        with self.lock:
            return list(self.posts)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def queuestats(env):
    rows = json.loads(manage(env, "queuestats", "--json"))["queues"]
    rows = [r for r in rows if r["queue"] == "bench"]
    return {s: sum(r[s] for r in rows) for s in ("published", "pending", "inflight", "acked", "dead")}


def setup(env, receiver_url, workdir, mode):
    """Queue, subscribers, subscription, and MESSAGES published; returns (webhook secret, the
    published message ids). Daphne serves the REST calls and is stopped before the worker."""
    manage(env, "migrate", "--noinput")
    manage(env, "createqueue", "bench")
    out = manage(env, "createsubscriber", "hook", "--subscribe", "bench", "--webhook", receiver_url)
    lines = out.strip().splitlines()
    secret = next(ln.split(": ", 1)[1] for ln in lines if ln.startswith("webhook secret: "))
    hook_token = lines[-1]
    publisher_token = (
        manage(env, "createsubscriber", "publisher", "--publish", "bench").strip().splitlines()[-1]
    )
    ids = []
    with server(env, workdir / f"daphne-{mode}.log") as port:
        hook = Client(port, hook_token)
        status, answer = hook.request("POST", "/api/subscriptions", {"queue": "bench"})
        hook.close()
        if status != 201:
            raise RuntimeError(f"subscribing answered {status}: {answer[:500]!r}")
        publisher = Client(port, publisher_token)
        for start in range(0, MESSAGES, BATCH):
            body = {"messages": [message(i) for i in range(start, min(start + BATCH, MESSAGES))]}
            status, answer = publisher.request("POST", "/api/queues/bench/messages", body)
            if status != 201:
                raise RuntimeError(f"publishing answered {status}: {answer[:500]!r}")
            ids += [m["id"] for m in json.loads(answer)["messages"]]
        publisher.close()
    return secret, ids


def start_worker(env, workdir, mode):
    log = open(workdir / f"worker-{mode}.log", "w")  # noqa: SIM115 - closed in stop_worker
    # A session of its own: the embedded beat is a child process, stopped with the worker.
    proc = subprocess.Popen(
        [CELERY, *WORKER_ARGS, "-s", str(workdir / f"beat-{mode}")],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


def stop_worker(proc, log):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the group we made for it: worker and beat
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # a beat child left behind, if any
    except ProcessLookupError:
        pass
    log.close()


def run_mode(mode, receiver, workdir):
    backend = "sqlite" if mode == "embedded" else "postgresql"
    database_url, db_version = fresh_database(backend, workdir, PG_DB)
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
        "MQ_THROTTLE_RATE": "1000000/s",
        "DEBUG": "false",
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    broker = {}
    if mode == "embedded":
        env.pop("REDIS_URL", None)
        folder = workdir / "celery"
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        (workdir / f"{SETTINGS_MODULE}.py").write_text(SETTINGS.format(folder=str(folder)))
        env["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE
        env["PYTHONPATH"] = os.pathsep.join([str(workdir), str(ROOT)])
        broker = {"broker": "filesystem", "folder": str(folder)}
    else:
        env["REDIS_URL"] = REDIS_URL
        r = redis.Redis.from_url(REDIS_URL)
        r.flushdb()  # db 10 is this benchmark's: no jobs or debounce keys of an earlier run
        broker = {"broker": "redis", "url": REDIS_URL, "redis_version": r.info()["redis_version"]}
        r.close()
    print(f"{mode}: {database_url} ({broker['broker']})")

    receiver.reset()
    secret, published = setup(env, receiver.url, workdir, mode)
    before = queuestats(env)
    print(f"  published {len(published)}; before the worker: {before}")

    started_wall, started = time.time(), time.monotonic()
    proc, log = start_worker(env, workdir, mode)
    wanted = set(published)
    try:
        # Wait on the receiver (in this process: costs the worker no CPU), then let queuestats
        # say whether every delivery is acked; a manage.py call every half second would take
        # a good part of a CPU from the worker on this small machine.
        while time.monotonic() - started < TIME_LIMIT:
            seen = {json.loads(body)["message_id"] for _, _, body in receiver.snapshot()}
            if wanted <= seen:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited:\n{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.05)
        stats = queuestats(env)
        while stats["acked"] < len(published) and time.monotonic() - started < TIME_LIMIT:
            time.sleep(0.5)
            stats = queuestats(env)
        waited = time.monotonic() - started
        last_ack = manage(env, "shell", "-c", LAST_ACK).strip().splitlines()[-1]
    finally:
        stop_worker(proc, log)

    posts = receiver.snapshot()
    frames = [json.loads(body) for _, _, body in posts]
    seen = [f["message_id"] for f in frames]
    sample = random.Random(0).sample(posts, min(SIGNATURE_SAMPLE, len(posts)))
    bad_signatures = 0
    for _, headers, body in sample:
        try:
            Webhook(secret).verify(body, {k.lower(): v for k, v in headers.items()})
        except Exception:  # the library raises its own WebhookVerificationError
            bad_signatures += 1
    acked = stats["acked"]
    seconds = (float(last_ack) - started_wall) if last_ack and acked == len(published) else None
    first_post, last_post = (posts[0][0] - started, posts[-1][0] - started) if posts else (None, None)
    row = {
        "mode": mode,
        "backend": backend,
        "database_version": db_version,
        **broker,
        "published": len(published),
        "published_before_worker": True,
        "acked": acked,
        "queuestats_before": before,
        "queuestats_after": stats,
        "seconds_worker_start_to_last_ack": round(seconds, 3) if seconds else None,
        "deliveries_per_second": round(acked / seconds, 1) if seconds else None,
        "seconds_worker_start_to_first_post": round(first_post, 3) if posts else None,
        "seconds_first_to_last_post": round(last_post - first_post, 3) if posts else None,
        "posts_per_second_first_to_last": (
            round(len(posts) / (last_post - first_post), 1) if posts and last_post > first_post else None
        ),
        "posts": len(posts),
        "duplicate_posts": len(seen) - len(set(seen)),
        "message_ids_missing": len(wanted - set(seen)),
        "signatures_checked": len(sample),
        "signatures_bad": bad_signatures,
        "waited_s": round(waited, 3),
        "time_limited": acked < len(published),
    }
    row["ok"] = (
        acked == len(published)
        and row["message_ids_missing"] == 0
        and bad_signatures == 0
        and stats["dead"] == 0
    )
    print(
        f"  {acked} acked; {row['deliveries_per_second']}/s from worker start "
        f"({row['seconds_worker_start_to_last_ack']} s; first post after "
        f"{row['seconds_worker_start_to_first_post']} s); {row['posts']} posts, "
        f"{row['duplicate_posts']} duplicates, {row['message_ids_missing']} ids missing, "
        f"{bad_signatures} of {len(sample)} signatures bad"
    )
    return row


def table(rows):
    lines = [
        "| mode | database, broker | deliveries | s, worker start to last ack | deliveries/s "
        "| s to first post | posts/s, first to last | duplicates | ids missing | bad signatures |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['mode']} | skipped: {r['skipped'][:60]} | | | | | | | | |")
            continue
        cells = [
            r["mode"],
            f"{r['backend']} {r['database_version']}, {r['broker']}",
            f"{r['acked']} of {r['published']}",
            str(r["seconds_worker_start_to_last_ack"]),
            str(r["deliveries_per_second"]),
            str(r["seconds_worker_start_to_first_post"]),
            str(r["posts_per_second_first_to_last"]),
            str(r["duplicate_posts"]),
            str(r["message_ids_missing"]),
            f"{r['signatures_bad']} of {r['signatures_checked']}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the processes are stopped
    now, host = datetime.now(UTC), machine()
    workdir = Path(tempfile.mkdtemp(prefix="mqwhbench-"))
    receiver = Receiver()
    rows = []
    try:
        for mode in ("embedded", "services"):
            try:
                rows.append(run_mode(mode, receiver, workdir))
            except (psycopg.OperationalError, redis.exceptions.ConnectionError) as exc:
                print(f"{mode}: skipped, a service does not answer: {exc}")
                rows.append({"mode": mode, "skipped": str(exc), "ok": False})
    finally:
        receiver.close()
        if rows and all(r["ok"] for r in rows):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept the databases and logs in {workdir}")

    print()
    print(table(rows))
    result = {
        "benchmark": "webhook_rate",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": {**host, "loadavg_after": os.getloadavg()},
        "worker": ["celery", *WORKER_ARGS],
        "messages": MESSAGES,
        "publish_batch": BATCH,
        "payload_bytes": PAYLOAD_BYTES,
        "time_limit_s": TIME_LIMIT,
        "results": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"webhook_rate-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmachine: {result['machine']}\nwritten: {path.relative_to(ROOT)}")
    if not all(r["ok"] for r in rows):
        sys.exit("FAILED: a delivery was not acked, an id never reached the receiver, or a signature was bad")


if __name__ == "__main__":
    main()
