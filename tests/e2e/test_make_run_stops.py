"""`make run` stops whole: stopped by Ctrl-C or SIGTERM, every process it started is gone within
10 s, an analysis in the middle of its Spark run included; and none outlives supervisord being
killed outright (mqsite/supervisord.conf says how). One of its processes restarts alone
(`make ctl`), the others going on. Each run is the real `make run`, on free ports and the test
database, in the embedded mode on SQLite and the services mode on PostgreSQL.

Its processes are found by a mark in their environment, which every child inherits (the Spark
JVM too), so a process reparented to init is found as well as one still under supervisord."""

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from delivery import subscribing
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support import servers
from tests.support.publish import publish
from tests.support.servers import ROOT, eventually, free_port, start_redis

pytestmark = pytest.mark.django_db(transaction=True)

STOPPED_WITHIN_SECS = 10
ENQUEUE_ANALYSIS = "from analytics.tasks import analyze; analyze.delay()"


def tagged(tag):
    """The pids and command lines of live processes whose environment carries `tag`."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"MQ_RUN_TAG={tag}".encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().split(")")[-1].split()[0] == "Z":
                continue  # a zombie has exited: only its parent's wait is missing
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


class MakeRun:
    """`make run` in a session of its own (as in a terminal of its own), its output in a file."""

    def __init__(self, tmp_path, extra_env):
        self.tag = uuid.uuid4().hex
        self.port = free_port()
        self.redis = None
        env = {**os.environ, "DATABASE_URL": servers.test_database_url(), "MQ_RUN_TAG": self.tag}
        env["MQ_ARCHIVE_DIR"] = str(tmp_path / "archive")  # the analytics write beside it
        env.pop("PYTEST_CURRENT_TEST", None)
        if connection.vendor == "postgresql":
            self.redis = start_redis()
            env["REDIS_URL"] = self.redis.url
        else:
            env["REDIS_URL"] = ""
            env["MQ_CELERY_DIR"] = tempfile.mkdtemp(prefix="celery-", dir=tmp_path)
        self.env = {**env, **extra_env}
        self.run_dir = tmp_path / "run"
        self.log = (tmp_path / "make-run.log").open("wb")
        self.make = subprocess.Popen(
            ["make", "--no-print-directory", "run", f"PORT={self.port}", f"RUN_DIR={self.run_dir}"],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self):
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def serving(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def ctl(self, args):
        """`make ctl ARGS=...` against this run; its output."""
        done = subprocess.run(
            ["make", "--no-print-directory", "ctl", f"ARGS={args}", f"RUN_DIR={self.run_dir}"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout + done.stderr

    def pids(self):
        """{program: pid} of the running programs, as `make ctl ARGS=status` lists them."""
        out = {}
        for line in self.ctl("status").splitlines():
            fields = line.replace(",", " ").split()
            if len(fields) > 3 and fields[1] == "RUNNING" and fields[2] == "pid":
                out[fields[0]] = int(fields[3])
        return out

    def supervisord(self):
        return next(pid for pid, cmd in tagged(self.tag).items() if "supervisord" in cmd)

    def wait_until_gone(self, seconds):
        """Seconds until no process of the run is left, or None after `seconds`."""
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if not tagged(self.tag):
                return time.monotonic() - started
            time.sleep(0.1)
        return None

    def cleanup(self):
        for pid in tagged(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.make.poll() is None:
            self.make.kill()
        self.make.wait()
        if self.redis is not None:
            self.redis.stop(signal.SIGKILL)


@pytest.fixture
def make_run(tmp_path):
    # An operator exists, so that `manage.py bootstrap` writes no password file into var/.
    get_user_model().objects.create_superuser("operator", password="not-used-here")
    runs = []

    def start(**extra_env):
        run = MakeRun(tmp_path, extra_env)
        runs.append(run)
        assert eventually(run.serving, timeout=90, step=0.2), run.output()
        # every program is up (supervisord's startsecs): the web server answering is not enough
        assert eventually(lambda: len(tagged(run.tag)) >= 6, timeout=30), (tagged(run.tag), run.output())
        return run

    yield start
    for run in runs:
        run.cleanup()


# Each run is half a minute of `make run` starting: the worst case (an analysis under way) runs
# in both modes, these two in the embedded one (the SQLite pass of make test).
embedded_pass_only = pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="the SQLite pass of make test runs it (the services mode: SIGTERM below)",
)


@embedded_pass_only
def test_one_process_restarts_alone_and_ctrl_c_stops_every_process_it_started(make_run):
    run = make_run()
    programs = {"workers:worker", "workers:maintenance", "workers:analytics", "workers:beat", "web:web0"}
    assert eventually(lambda: programs <= set(run.pids()), 30), run.ctl("status")  # all RUNNING
    before = run.pids()
    restarted = run.ctl("restart workers:worker")
    assert "workers:worker: started" in restarted, restarted
    assert eventually(lambda: run.pids().get("workers:worker") not in (None, before["workers:worker"]), 15)
    after = run.pids()
    assert {k: v for k, v in after.items() if k != "workers:worker"} == {
        k: v for k, v in before.items() if k != "workers:worker"
    }  # the others kept running
    os.killpg(run.make.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the foreground group
    took = run.wait_until_gone(STOPPED_WITHIN_SECS)
    assert took is not None, (tagged(run.tag), run.output())
    print(f"Ctrl-C: everything gone in {took:.1f} s")


def test_sigterm_stops_every_process_even_in_the_middle_of_an_analysis(make_run):
    # Deliveries past MQ_ANALYTICS_HOT_SPARK_ROWS, so that the analysis runs on Spark.
    queue = Queue.objects.create(name="db")
    subscriber, _ = create_subscriber("logger", subscribe=["db"])
    subscribing.subscribe(subscriber, queue)
    publish(queue, 3)
    run = make_run(MQ_ANALYTICS_HOT_SPARK_ROWS="1")
    # An analysis on the analytics worker, as beat starts one: its Spark driver is a JVM.
    subprocess.run(
        [".venv/bin/python", "manage.py", "shell", "-c", ENQUEUE_ANALYSIS],
        cwd=ROOT,
        env=run.env,
        check=True,
        capture_output=True,
    )
    assert eventually(lambda: any("java" in cmd for cmd in tagged(run.tag).values()), timeout=60, step=0.2), (
        tagged(run.tag),
        run.output(),
    )
    run.make.send_signal(signal.SIGTERM)  # to make alone, as a process manager or `kill` does
    took = run.wait_until_gone(STOPPED_WITHIN_SECS)
    assert took is not None, (tagged(run.tag), run.output())
    print(f"SIGTERM during an analysis: everything gone in {took:.1f} s")


@embedded_pass_only
def test_no_process_outlives_supervisord_killed_outright(make_run):
    run = make_run()
    os.kill(run.supervisord(), signal.SIGKILL)  # no chance to stop its programs itself
    took = run.wait_until_gone(STOPPED_WITHIN_SECS)
    assert took is not None, (tagged(run.tag), run.output())
    print(f"supervisord killed: everything gone in {took:.1f} s")
