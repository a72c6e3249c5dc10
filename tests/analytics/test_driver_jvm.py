"""A local driver's JVM ends with the process that started it for an analysis, even when that
process dies while the JVM is still starting (mqsite/workarounds/spark_jvm.py): before, such a
JVM failed its start and stayed for ever (`make run` stopped as an analysis began left one)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from tests.support.servers import ROOT, eventually

pytestmark = pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="a JVM started and killed, with no database in it: the SQLite pass of make test runs it",
)

# What the analysis does when its run reaches Spark (analytics.analysis: it installs the
# workaround as it is imported), in a process of its own to be stopped. SIGTERM ends it as it
# ends a Celery pool child: an exception, so that PySpark's cleanup runs (it removes the file the
# JVM was to write its port to, and a JVM that cannot write it stays for ever).
STARTS_A_DRIVER = """
import signal, sys, time, django
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
django.setup()
from analytics import analysis, job
job.build_session("local[1]")
print("up", flush=True)
time.sleep(120)
"""


def spark_driver_of(pid):
    """The pid of the Spark driver JVM `pid` started (spark-submit execs into it), or None."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().split(")")[-1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == pid and b"java" in cmdline and b"org.apache.spark.deploy.SparkSubmit" in cmdline:
            return int(proc.name)
    return None


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "stop, when",
    [
        (signal.SIGTERM, "while it starts"),  # make run stopped as an analysis begins
        (signal.SIGKILL, "while it starts"),  # a pool child killed, or the OOM killer
        (signal.SIGKILL, "once it is up"),
    ],
)
def test_the_driver_jvm_dies_with_the_process_that_started_it(stop, when, tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "mqsite.settings"}
    log = tmp_path / "driver.log"
    command = [sys.executable, "-c", STARTS_A_DRIVER]
    python = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("wb"))
    try:
        jvm = None

        def started():
            nonlocal jvm
            jvm = spark_driver_of(python.pid)
            return jvm is not None

        assert eventually(started, timeout=60, step=0.05), log.read_text(errors="replace")
        if when == "once it is up":  # the session is built: the JVM watches its stdin
            assert python.stdout.readline() == b"up\n", log.read_text(errors="replace")
        python.send_signal(stop)
        python.wait(timeout=30)
        assert eventually(lambda: not alive(jvm), timeout=15, step=0.1), f"the JVM {jvm} outlived its Python"
    finally:
        if python.poll() is None:
            python.kill()
        if jvm is not None and alive(jvm):
            os.kill(jvm, signal.SIGKILL)
