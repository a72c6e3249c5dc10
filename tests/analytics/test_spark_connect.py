"""SPARK_REMOTE: the analytics' session is a Spark Connect client of the server it names.

The server is a local Spark with Spark Connect's plugin (its jar ships in the pyspark package),
in a process of its own; the client is another process with SPARK_REMOTE set, as a worker
would be. It fails, saying which, where PySpark's Connect client lacks a package it needs
(requirements.txt installs them: pyspark[connect] and pandas).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from django.db import connection

from tests.support.servers import ROOT, free_port


def _connect_missing():
    try:
        from pyspark.sql.connect.utils import check_dependencies

        check_dependencies()
    except ImportError as exc:
        return str(exc)
    return None


# No skip when the Connect client's packages are missing: requirements.txt holds them
# (pyspark[connect]), so a missing one is a broken install, which a skip would hide.
pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="two JVMs for half a minute, with no database in them: the SQLite pass of make test runs it",
    ),
]

SERVER = """
import sys
from pyspark.sql import SparkSession
spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
    .config("spark.connect.grpc.binding.port", sys.argv[1])
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "1")
    .getOrCreate()
)
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
spark.stop()
"""

CLIENT = """
import json, os, sys, tempfile
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "mqsite.settings"
django.setup()
from pyspark.sql.connect.session import SparkSession as ConnectSession
from analytics import analysis, job, spark_settings
from tests.analytics import history
with job.session(**spark_settings.session_options()) as spark:
    assert isinstance(spark, ConnectSession), type(spark)
    # The whole computation (the archive's parts by Spark, the rest here) through the server
    base = tempfile.mkdtemp()
    h = history.generate(seed=3, n_messages=60)
    snapshot = history.write(h, base + "/archive")
    run = analysis.compute(base + "/archive", base + "/out", snapshot, now=history.NOW)
    assert run.manifest["spark"] and run.manifest["partitions"]["recomputed"] > 0
    print(json.dumps([sum(e["messages"] for e in run.event_stats), len(h.messages),
                      sum(e["deliveries"] for e in run.event_stats), len(h.deliveries)]))
"""


def _wait_listening(port, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.5)
    return False


def test_with_spark_remote_the_job_runs_on_a_spark_connect_server():
    assert _connect_missing() is None, f"Spark Connect's client cannot run: {_connect_missing()}"
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its JVM goes with it at the end
    )
    try:
        assert _wait_listening(port, server, 90), "the Spark Connect server did not start"
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        # A tiny archive, which would be reduced in the client itself: Spark is asked for.
        env.update(
            SPARK_REMOTE=f"sc://127.0.0.1:{port}", SPARK_MASTER="local[1]", MQ_ANALYTICS_LOCAL_BYTES="0"
        )
        client = subprocess.run(
            [sys.executable, "-c", CLIENT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert client.returncode == 0, client.stderr[-3000:]
        messages, want_messages, deliveries, want_deliveries = json.loads(
            client.stdout.strip().splitlines()[-1]
        )
        assert (messages, deliveries) == (want_messages, want_deliveries)
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
