"""Real server processes for end-to-end tests: Daphne on a free loopback port, pointed at the
test database that pytest-django made (so tests must use transactional_db)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from django.db import connection

from mqsite import run_programs

ROOT = Path(__file__).resolve().parents[2]
# The Redis the tests use: the machine's by default; `make test` gives each of its two passes,
# which run at once, a server of its own (MQ_TEST_REDIS), so neither sees the other's keys.
TEST_REDIS = os.environ.get("MQ_TEST_REDIS", "redis://127.0.0.1:6379").rstrip("/")


def redis_db(number):
    """A database of the tests' Redis, by number (each kind of test keeps to its own)."""
    return f"{TEST_REDIS}/{number}"


# A database of the end-to-end tests' own (tests/conftest.py: announcing).
E2E_REDIS = redis_db(9)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_database_url():
    """The test database, as a DATABASE_URL for a child process (a server, a manage.py run)."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "", safe="") + (f":{quote(s['PASSWORD'], safe='')}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Server:
    def __init__(self, port, proc, log):
        self.port, self.proc, self.log = port, proc, log
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/ws/"

    def rss_bytes(self):
        """The server process's resident memory now (Linux: /proc/<pid>/status)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SERVER_APPLICATION_NAME = "mq-test-server"


def start_daphne(extra_env=None, port=None, daphne_args=()):
    """A Daphne on loopback; `daphne_args` are more of its command line options."""
    port = port or free_port()
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "MQ_THROTTLE_RATE": "1000000/s",
        # A web process alone: its /healthz needs no worker (a test that starts one says so).
        "MQ_HEALTH_WORKERS": "false",
        # Its PostgreSQL sessions are named, so that a test can end them and not its own
        # (tests/support/outage.py); libpq reads it from the environment.
        "PGAPPNAME": SERVER_APPLICATION_NAME,
        **(extra_env or {}),
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    env = {k: v for k, v in env.items() if v is not None}  # None: the server's default
    log = tempfile.NamedTemporaryFile(prefix="daphne-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), *daphne_args]
        + ["mqsite.asgi:application"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    server = Server(port, proc, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daphne exited: {Path(log.name).read_text()[-2000:]}")
        if _healthy(server):
            return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError("daphne did not answer /healthz within 30 s")


class SharedPortServers(Server):
    """Several Daphne processes accepting on one listening socket, as `make run` starts them in
    the services mode (supervisord's fcgi-program hands them its socket; here, this process
    does). Each writes its access log to a file of its own, so a test can see which answered."""

    def __init__(self, port, procs, access_logs):
        super().__init__(port, procs[0], None)
        self.procs, self.access_logs = procs, access_logs

    def requests_served(self):
        """Requests each process has logged, in the order of the processes."""
        return [len(Path(p).read_text().splitlines()) for p in self.access_logs]

    def stop(self, sig=signal.SIGTERM):
        for proc in self.procs:
            self.proc = proc
            super().stop(sig)


@contextlib.contextmanager
def separate_daphnes(count, extra_env=None):
    """`count` Daphne processes, each on a port of its own (a test says which it talks to),
    stopped at the end."""
    started = []
    try:
        for _ in range(count):
            started.append(start_daphne(extra_env))
        yield started
    finally:
        for s in started:
            s.stop()


def start_daphnes(count, extra_env=None):
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "MQ_THROTTLE_RATE": "1000000/s",
        "MQ_HEALTH_WORKERS": "false",
        "MQ_WEB_PROCESSES": str(count),
        **(extra_env or {}),
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port, procs, logs = listener.getsockname()[1], [], []
    for _ in range(count):
        access = tempfile.NamedTemporaryFile(prefix="daphne-access-", suffix=".log", delete=False)  # noqa: SIM115
        logs.append(access.name)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "daphne", "--fd", str(listener.fileno()), "--access-log", access.name]
                + ["mqsite.asgi:application"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=[listener.fileno()],
            )
        )
    listener.close()  # the servers hold it
    servers = SharedPortServers(port, procs, logs)
    if not eventually(lambda: _healthy(servers) or any(p.poll() is not None for p in procs), timeout=30):
        servers.stop()
        raise RuntimeError("daphne did not answer /healthz within 30 s")
    if any(p.poll() is not None for p in procs):
        servers.stop()
        raise RuntimeError("a daphne process exited at start")
    return servers


def _healthy(server):
    """It serves: /healthz answers, its database and broker ok (a 503 for want of a worker
    still serves, where a test asked for the workers' health: MQ_HEALTH_WORKERS)."""
    try:
        with urllib.request.urlopen(f"{server.http}/healthz", timeout=1) as r:
            return r.status == 200
    except urllib.error.HTTPError as exc:
        return exc.code == 503 and json.loads(exc.read() or b"{}").get("database") == "ok"
    except OSError:
        return False


class Process:
    """A child process with its log in a file, stopped with a signal (SIGKILL for faults).

    It leads a process group of its own and signals go to the whole group: a worker's
    embedded beat (start_worker's -B) or pool child is a child process, which a SIGKILL of the
    worker alone would leave running (sweeping the test database of a later test)."""

    def __init__(self, args, env, name):
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def signal_group(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, sig=signal.SIGTERM, timeout=15):
        if self.proc.poll() is None:
            self.signal_group(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait()
        if sig == signal.SIGKILL:
            self.signal_group(signal.SIGKILL)  # what the leader left behind, if anything

    def output(self):
        return Path(self.log.name).read_text(errors="replace")


def start_redis(port=None, data_dir=None):
    """A private redis-server that keeps nothing on disk: restarting it loses every job. With
    `data_dir` it keeps an append-only file there, so that a restart after a SIGTERM (which
    writes it out) finds its jobs again."""
    port = port or free_port()
    keep = ["--appendonly", "no"]
    if data_dir is not None:
        keep = ["--dir", str(data_dir), "--appendonly", "yes"]
    p = Process(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *keep],
        dict(os.environ),
        "redis",
    )
    p.url, p.port = f"redis://127.0.0.1:{port}/0", port
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return p
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


# Every queue of CELERY_TASK_ROUTES and the default one: a worker of the tests serves them all.
ALL_QUEUES = "webhooks,maintenance,analytics,celery"


def start_worker(extra_env):
    """A Celery worker with beat inside it, serving every queue, on the test database."""
    env = {**os.environ, "DATABASE_URL": test_database_url(), **extra_env}
    env.pop("PYTEST_CURRENT_TEST", None)
    args = [sys.executable, "-m", "celery", "-A", "mqsite", "worker", "-B", "-l", "info", "-P", "threads"]
    args += ["-Q", ALL_QUEUES, "-c", "4", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    args += ["-s", str(Path(tempfile.mkdtemp()) / "beat-schedule")]
    return Process(args, env, "worker")


def run_command(program):
    """The command line that `make run` (mqsite/supervisord.conf) starts `program` with."""
    return run_programs.programs()[program]


def start_as_make_run(program, extra_env, log_level="info"):
    """A worker (or beat) started as `make run` starts `program`, on the test database: the
    same queues, pool and concurrency; only its log level (the tests read its log) and beat's
    schedule file (a fresh one) differ. Beat is a program of its own: start "beat" beside
    "maintenance" where sweeps must run."""
    env = {**os.environ, "DATABASE_URL": test_database_url(), **extra_env}
    env.pop("PYTEST_CURRENT_TEST", None)
    args = run_command(program)
    args[0] = str(Path(sys.executable).parent / "celery")
    args[args.index("-l") + 1] = log_level
    if "-s" in args:
        args[args.index("-s") + 1] = str(Path(tempfile.mkdtemp()) / "beat-schedule")
    return Process(args, env, program)


def eventually(check, timeout=5, step=0.05):
    """A server works on its own time: poll `check` until it holds (True) or time runs out."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def frames_within(ws, seconds):
    """Every frame (decoded) a websocket (websockets' sync client) sends within `seconds`."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            got.append(json.loads(ws.recv(timeout=left)))
        except TimeoutError:
            break
    return got


def nothing_for(ws, seconds):
    """True if a websocket (websockets' sync client) sends nothing within `seconds`."""
    try:
        frame = ws.recv(timeout=seconds)
    except TimeoutError:
        return True
    raise AssertionError(f"unexpected frame {frame}")
