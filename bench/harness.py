"""What the benchmarks share: a fresh database, the manage.py setup, Daphne as a subprocess,
a keep-alive REST client, the payload, and the machine description for the results file."""

import contextlib
import http.client
import json
import os
import platform
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's own code (a worktree's, when one is measured)

from mqsite import run_programs  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DAPHNE = Path(sys.executable).parent / "daphne"
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
COMMAND_WAIT = 180.0  # how long to wait for createqueue/createsubscriber to appear in the tree
PAYLOAD_BYTES = 200

# Used only while the management commands do not exist yet.
FALLBACK_SETUP = """
from queues.models import Queue
from subscribers.provisioning import create_subscriber
Queue.objects.get_or_create(name="bench")
print(create_subscriber("bencher", publish=["*"], subscribe=["*"])[1])
"""
FALLBACK_COUNT = """
import json
from delivery.models import Delivery
from queues.models import Message
print(json.dumps({"messages": Message.objects.count(), "deliveries": Delivery.objects.count()}))
"""


def message(i, **fields):
    """One message whose payload is PAYLOAD_BYTES of compact JSON (`fields` included)."""
    payload = {"i": i, **fields, "host": "bench-01.example.net", "path": f"/srv/bench/{i:08d}.dat", "pad": ""}
    payload["pad"] = "x" * (PAYLOAD_BYTES - len(json.dumps(payload, separators=(",", ":"))))
    return {"event": "create", "payload": payload}


def manage(env, *args):
    cmd = [sys.executable, "manage.py", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stderr.strip()}")
    return done.stdout


def provision(env):
    """Make the queue and the subscriber; return its token."""
    deadline = time.monotonic() + COMMAND_WAIT
    while True:
        commands = manage(env, "help", "--commands").split()
        if {"createqueue", "createsubscriber"} <= set(commands):
            manage(env, "createqueue", "bench")
            out = manage(env, "createsubscriber", "bencher", "--publish", "*", "--subscribe", "*")
            return out.strip().splitlines()[-1]
        if time.monotonic() > deadline:
            print("  createqueue/createsubscriber missing: falling back to manage.py shell")
            return manage(env, "shell", "-c", FALLBACK_SETUP).strip().splitlines()[-1]
        print("  waiting for createqueue/createsubscriber to exist...")
        time.sleep(10)


def count_in_db(env):
    """(messages, deliveries) in the database, from `queuestats --json` when it exists."""
    if "queuestats" in manage(env, "help", "--commands").split():
        rows = json.loads(manage(env, "queuestats", "--json"))["queues"]
        rows = [r for r in rows if r["queue"] == "bench"]
        deliveries = sum(r[s] for r in rows for s in ("pending", "inflight", "acked", "dead"))
        return sum(r["published"] for r in rows), deliveries
    counts = json.loads(manage(env, "shell", "-c", FALLBACK_COUNT).strip().splitlines()[-1])
    return counts["messages"], counts["deliveries"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One keep-alive HTTP/1.1 connection, authenticated as the subscriber."""

    def __init__(self, port, token):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def request(self, method, path, body=None):
        try:
            self.conn.request(method, path, None if body is None else json.dumps(body), self.headers)
            response = self.conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.conn.close()  # the next request reconnects
            return None, repr(exc).encode()

    def close(self):
        self.conn.close()


@contextlib.contextmanager
def server(env, log_path):
    """Daphne serving the app on a free port; stopped (TERM, then KILL) whatever happens."""
    with server_process(env, log_path) as (port, _proc):
        yield port


@contextlib.contextmanager
def server_process(env, log_path, processes=1):
    """As server(), but yields (port, the first Daphne's Popen): a profiler needs its pid.
    With `processes` > 1, that many Daphne processes accept on one listening socket made here
    (`daphne --fd`), as supervisord's fcgi-program does for `make run` (MQ_WEB_PROCESSES)."""
    port = free_port()
    listener = None
    if processes > 1:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1024)
        where = ["--fd", str(listener.fileno())]
    else:
        where = ["-b", "127.0.0.1", "-p", str(port)]
    # make run's Daphne options (its log level, pings, timeouts), on this socket or port.
    web = run_programs.programs()["web"]
    web_options = [a for i, a in enumerate(web[1:], 1) if "--fd" not in (a, web[i - 1])]
    procs = []
    with open(log_path, "w") as log:
        for _ in range(processes):
            procs.append(
                subprocess.Popen(
                    [DAPHNE, *where, *web_options],
                    cwd=ROOT,
                    # Healthy when it serves, whether or not its workers have started yet.
                    env={"MQ_HEALTH_WORKERS": "false", **env, "MQ_WEB_PROCESSES": str(processes)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=[listener.fileno()] if listener else (),
                )
            )
    if listener is not None:
        listener.close()  # the children hold it
    try:
        client, deadline = Client(port, ""), time.monotonic() + 60
        while client.request("GET", "/healthz")[0] != 200:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"daphne did not become healthy:\n{Path(log_path).read_text()[-2000:]}")
            time.sleep(0.2)
        client.close()
        yield port, procs[0]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def celery_commands(workdir):
    """The Celery programs `make run` starts, as supervisord.conf names them ([program:worker],
    [program:maintenance], [program:beat], ...): read from there (mqsite.run_programs), so a
    benchmark runs what production runs. Beat's schedule file goes into `workdir` rather than
    the tree's var/, and `celery` is the one beside this Python (as DAPHNE is): a worktree of
    the repository has no .venv of its own."""
    out = {}
    for name, args in run_programs.programs().items():
        if not args or Path(args[0]).name != "celery":
            continue
        args[0] = str(Path(sys.executable).parent / Path(args[0]).name)
        if "-s" in args:
            args[args.index("-s") + 1] = str(Path(workdir) / f"celerybeat-{name}")
        out[name] = args
    return out


@contextlib.contextmanager
def celery_workers(env, workdir, programs=None):
    """The Celery workers of the services mode (celery_commands; only those named in `programs`
    if given), each in a session of its own (a prefork worker's pool child goes with it); TERM to each group
    at the end, then KILL."""
    procs = []
    try:
        for name, args in celery_commands(workdir).items():
            if programs is not None and name not in programs:
                continue
            log = open(Path(workdir) / f"celery-{name}.log", "w")  # noqa: SIM115 - closed below
            procs.append(
                (
                    subprocess.Popen(
                        args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    ),
                    log,
                )
            )
        yield [p for p, _ in procs]
    finally:
        for proc, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, log in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


@contextlib.contextmanager
def services_server(env, workdir, processes):
    """The services mode as `make run` runs it: `processes` Daphne processes on one port and
    the Celery workers beside them. Yields the port."""
    with (
        celery_workers(env, workdir),
        server_process(env, Path(workdir) / "daphne.log", processes) as (port, _),
    ):
        yield port


def fresh_database(backend, workdir, pg_db):
    """Return (DATABASE_URL, server version) of an empty database: a new SQLite file in
    `workdir`, or the PostgreSQL database `pg_db` dropped and made again."""
    if backend == "sqlite":
        return f"sqlite:///{workdir / 'bench.sqlite3'}", sqlite3.sqlite_version
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {pg_db} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {pg_db}")
        return f"{PG_SERVER}/{pg_db}", conn.execute("SHOW server_version").fetchone()[0]


def insert_queue(conn, name, events, *, ordered=False, last_seq=0):
    """A queue and its events, inserted with SQL into a migrated PostgreSQL database (for the
    benchmarks that fill millions of rows with generate_series, too many for the ORM); returns
    (queue id, [event ids])."""
    queue_id = conn.execute(
        "INSERT INTO queues_queue (name, ordered, max_attempts, ack_timeout, retention_days, paused,"
        " last_seq, created_at) VALUES (%s, %s, 10, 30, 7, false, %s, now() - interval '3 days')"
        " RETURNING id",
        [name, ordered, last_seq],
    ).fetchone()[0]
    event_ids = [
        conn.execute(
            "INSERT INTO queues_event (queue_id, name, created_at) VALUES (%s, %s, now()) RETURNING id",
            [queue_id, event],
        ).fetchone()[0]
        for event in events
    ]
    return queue_id, event_ids


README = ROOT / "bench" / "README.md"


def update_readme(name, text):
    """Put `text` between the markers `<!-- name:begin -->` and `<!-- name:end -->` of
    bench/README.md (at its end, with the markers, if they are missing)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    current = README.read_text()
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        _, tail = rest.split(end, 1)
        README.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
    else:
        README.write_text(f"{current.rstrip()}\n\n{begin}\n{text}\n{end}\n")


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def machine():
    cpuinfo = Path("/proc/cpuinfo").read_text()
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": models[0] if models else platform.processor(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_before": os.getloadavg(),  # other work on the machine skews the numbers
    }
