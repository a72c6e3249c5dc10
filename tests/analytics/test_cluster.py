"""The analytics on a cluster, on this machine: more than one executor JVM, a real shuffle, a
master that is not local, and a Hadoop default filesystem that is not this disk.

- `spark-submit analytics/job.py` on `local-cluster[2,1,1024]` (two executor JVMs), as it is
  (neither Django nor this project on its path), then `manage.py analyze --parts DIR --json` on
  what it wrote, as docs/analytics.md says;
- a standalone master and worker started from the pyspark package (`spark-class`), and
  `manage.py analyze --json` run against it with SPARK_MASTER=spark://... as an operator
  runs it, its Spark settings in MQ_SPARK_CONF.

Both set `spark.hadoop.fs.defaultFS` to an HDFS nobody serves: a path given to Spark without
its scheme would be looked for there (as on YARN) and fail the run. Every figure is checked
against plain Python over the same rows. Each starts several JVMs (tens of seconds): the
SQLite pass of make test runs them, as it does the Spark Connect test.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyspark
import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from analytics import partitions
from mqsite.commands import EXIT_USAGE
from queues.models import Message
from tests.analytics import history
from tests.support import history_rows, servers
from tests.support.servers import ROOT, free_port

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="several JVMs for tens of seconds: the SQLite pass of make test runs them",
    ),
]

SPARK_HOME = Path(pyspark.__file__).parent
# Where a cluster's HDFS would be: nothing listens there, so a path Spark resolves against the
# default filesystem (one without a scheme) fails the run at once.
ELSEWHERE = "hdfs://127.0.0.1:1/"
# Tiny jobs: JVMs that start and compile sooner (as the suite's own session, tests/support/spark.py)
QUICK_JVM = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"


def spark_env(**extra):
    """The environment of Spark's own launchers from the pip package: its folder is SPARK_HOME
    (the launchers find it themselves; named here so that no SPARK_* of the caller's leaks in),
    the jars a worker puts on its executors' class path; the driver's Python is this one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        **extra,
    )
    return env


def _bare_env(home):
    bin_dir = Path(sys.executable).parent
    bare = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home)}
    return {**bare, **{k: v for k, v in spark_env().items() if k.startswith(("SPARK_", "PYSPARK_"))}}


def manage(*args, env):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def event_log(folder):
    """The events of the one application whose event log is in `folder`."""
    (log,) = [p for p in Path(folder).iterdir() if not p.name.startswith(".")]
    return [json.loads(line) for line in log.read_text().splitlines()]


# Spark's event log, whole and plain, one file an application: what the tests read back
EVENT_LOG_CONF = {"spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"}


def sql_settings(events):
    """The SQL settings the session had changed from Spark's defaults when its queries ran."""
    found = {}
    for e in events:
        if e["Event"].endswith("SparkListenerSQLExecutionStart"):
            found.update(e.get("modifiedConfigs") or {})
    return found


# --- local-cluster: spark-submit, then analyze --parts -------------------------------------------


def test_a_spark_submitted_job_on_two_executors_is_read_by_analyze_parts(tmp_path):
    # Given a generated archive, and the list of its files (what the operator hands the job)
    h = history.generate(seed=11, n_messages=300)
    history.write(h, tmp_path / "archive")
    listing = partitions.list_archive(str(tmp_path / "archive"))
    files = tmp_path / "files.txt"
    files.write_text("".join(f"{path}\n" for p in listing.values() for _, path in p.files))
    (tmp_path / "events").mkdir()

    # When the job is spark-submitted to two executor JVMs, Hadoop's default filesystem elsewhere
    submitted = subprocess.run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--master", "local-cluster[2,1,1024]",
            "--conf", f"spark.hadoop.fs.defaultFS={ELSEWHERE}",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.sql.shuffle.partitions=4",  # Spark's 200 are for a bigger cluster
            # Both executors up before the first task, so that both get some
            "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
            "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=300s",
            "--conf", f"spark.driver.extraJavaOptions={QUICK_JVM}",
            "--conf", f"spark.executor.extraJavaOptions={QUICK_JVM}",
            "--conf", "spark.eventLog.enabled=true",
            *(arg for key, value in EVENT_LOG_CONF.items() for arg in ("--conf", f"{key}={value}")),
            "--conf", f"spark.eventLog.dir=file://{tmp_path}/events",
            str(ROOT / "analytics" / "job.py"),
            "--archive", str(tmp_path / "archive"),
            "--files", str(files),
            "--out", str(tmp_path / "parts"),
        ],
        # As it is: neither Django nor this project on its path, nothing of this environment
        cwd=tmp_path, env=_bare_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-4000:]

    # Then it ran on two executors, each running tasks, and its shuffle crossed between them
    events = event_log(tmp_path / "events")
    added = {e["Executor ID"] for e in events if e["Event"] == "SparkListenerExecutorAdded"}
    assert len(added) == 2
    tasks = [e for e in events if e["Event"] == "SparkListenerTaskEnd"]
    assert {t["Task Info"]["Executor ID"] for t in tasks} == added
    remote = sum(
        t.get("Task Metrics", {}).get("Shuffle Read Metrics", {}).get("Remote Blocks Fetched", 0)
        for t in tasks
    )
    assert remote > 0
    # ... tuned as a master on this machine is
    assert sql_settings(events)["spark.sql.files.openCostInBytes"] == str(64 * 1024)

    # ... and analyze --parts gives the figures of exactly the archived rows
    done = manage("analyze", "--parts", str(tmp_path / "parts"), "--json", env=_django_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    archived_ids = {m["id"] for m in _archived_messages(tmp_path / "archive")}
    archived = history.History(
        messages=[m for m in h.messages if m["id"] in archived_ids],
        deliveries=[d for d in h.deliveries if d["message_id"] in archived_ids],
    )
    history.assert_figures(result, history.expected_events(archived))


def test_analyze_parts_of_a_folder_that_is_no_jobs_output_is_a_usage_error(tmp_path):
    with pytest.raises(CommandError, match="holds no message_hours/") as raised:
        call_command("analyze", "--parts", str(tmp_path), "--json", stdout=io.StringIO())
    assert raised.value.returncode == EXIT_USAGE
    with pytest.raises(CommandError, match="takes no --since") as raised:
        call_command("analyze", "--parts", str(tmp_path), "--since", "2026-01-01", stdout=io.StringIO())
    assert raised.value.returncode == EXIT_USAGE


def _django_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(extra)
    return env


def _archived_messages(root):
    import pyarrow.parquet as pq

    return pq.read_table(root / "messages", columns=["id"]).to_pylist()


# --- a standalone master and worker, and manage.py analyze against them ---------------------------


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """A standalone Spark master and one worker (two cores, 1 GiB) from the pyspark package, on
    loopback; stopped with every JVM they started (the worker's executors too) at the end."""
    work = tmp_path_factory.mktemp("spark-standalone")
    # Each daemon's web UI on a port of its own: with "0" the worker's could take the port just
    # freed for the master's before the master's JVM bound it, and answer its /json/ with a page.
    port, ui, worker_ui = free_port(), free_port(), free_port()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    master_url = f"spark://127.0.0.1:{port}"
    started = []
    try:
        for args in (
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", str(ui)],
            ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "2", "--memory", "1g",
             "--webui-port", str(worker_ui), "--work-dir", str(work), master_url],
        ):  # fmt: skip
            started.append(
                subprocess.Popen(
                    [spark_class, *args],
                    cwd=work,
                    env=spark_env(SPARK_LOCAL_IP="127.0.0.1"),
                    stdout=subprocess.DEVNULL,
                    stderr=open(work / f"{args[0].rsplit('.', 1)[1]}.log", "w"),  # noqa: SIM115
                    start_new_session=True,  # a group of its own: stopped with its children
                )
            )
        _wait_for_worker(f"http://127.0.0.1:{ui}/json/", started, work)
        yield master_url, f"http://127.0.0.1:{ui}/json/"
    finally:
        for proc in reversed(started):
            _stop_group(proc)


def _wait_for_worker(url, procs, work, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"a Spark daemon exited: {(work / 'Worker.log').read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if any(w["state"] == "ALIVE" for w in json.load(answer)["workers"]):
                    return
        except (OSError, ValueError, KeyError):  # not up yet, or not the master's answer yet
            pass
        time.sleep(0.5)
    raise AssertionError("the standalone master has no live worker after 3 minutes")


def _stop_group(proc):
    """SIGTERM to the daemon's process group (the worker kills its executors as it stops), then
    SIGKILL to whatever is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_manage_py_analyze_runs_on_a_standalone_cluster(
    standalone, transactional_db, archive_dir, make_queue, db_queue, logger, peer
):
    master_url, master_json = standalone
    # Given history in two queues, acked, pending and dead, most of it archived
    history_rows.two_queues_of_history(db_queue, make_queue("network"), logger, peer)
    expected = history_rows.expected_events()
    call_command("archive", "--older-than-days", "5", stdout=open(os.devnull, "w"))  # noqa: SIM115
    assert Message.objects.count() < 24 and (archive_dir / "messages").is_dir()

    # When an operator runs analyze with the cluster's master and its Spark settings
    conf = {
        "spark.hadoop.fs.defaultFS": ELSEWHERE,
        "spark.executor.memory": "512m",
        "spark.cores.max": "2",
        "spark.ui.enabled": "false",
        "spark.executor.extraJavaOptions": QUICK_JVM,
        **EVENT_LOG_CONF,
    }
    (archive_dir.parent / "events").mkdir()
    env = _django_env(
        **spark_env(),
        DATABASE_URL=servers.test_database_url(),
        MQ_ARCHIVE_DIR=str(archive_dir),
        SPARK_MASTER=master_url,
        MQ_SPARK_CONF=json.dumps(conf),
        MQ_SPARK_DRIVER_MEMORY="512m",
        MQ_SPARK_EVENT_LOG_DIR=f"file://{archive_dir.parent}/events",
        # Every partition to the cluster: an archive this small is otherwise reduced in process.
        MQ_ANALYTICS_LOCAL_BYTES="0",
    )
    done = manage("analyze", "--json", env=env)
    assert done.returncode == 0, done.stderr[-4000:]

    # Then the figures are those of the rows before anything moved
    history.assert_figures(json.loads(done.stdout), expected)
    # ... computed by the cluster's executors: the master lists the run as its application
    assert _applications(master_json) == ["mqsite-analytics"]
    # ... with the settings every run needs, and none of the tuning for a local disk and cores
    settings = sql_settings(event_log(archive_dir.parent / "events"))
    assert settings["spark.sql.objectHashAggregate.sortBased.fallbackThreshold"] == "1000000"
    assert "spark.sql.files.openCostInBytes" not in settings
    assert "spark.sql.sources.parallelPartitionDiscovery.threshold" not in settings


def _applications(master_json, timeout=30):
    """The names of the master's finished applications, once none is running (the master
    hears of a driver's end a moment after it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(master_json, timeout=5) as answer:
            state = json.load(answer)
        if not state["activeapps"] or time.monotonic() > deadline:
            return [a["name"] for a in state["activeapps"] + state["completedapps"]]
        time.sleep(0.5)
