"""How the analytics are operated: the beat task, the Spark settings as the session's
arguments, and the session itself on the masters operators give it."""

import io
import os
import subprocess
import sys

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.db import connection
from django.urls import reverse

from analytics import analysis, job, spark_settings, tasks
from analytics.models import AnalyticsFailure, AnalyticsRun, EventStats
from delivery import subscribing
from tests.dashboard.test_metrics import TOKEN, scrape, value
from tests.support.publish import publish
from tests.support.servers import ROOT


@pytest.mark.django_db
def test_the_beat_task_runs_the_analysis(monkeypatch):
    runs = []
    monkeypatch.setattr(analysis, "run_analysis", lambda: runs.append(1) or {"events": [], "subscribers": []})
    assert tasks.analyze.apply().get() == "done" and runs == [1]


@pytest.mark.django_db
def test_the_beat_task_skips_while_another_run_holds_the_analysis(monkeypatch, caplog):
    def busy():
        raise analysis.AnalysisBusy("a run started at 12:00 is still going")

    monkeypatch.setattr(analysis, "run_analysis", busy)
    with caplog.at_level("INFO", logger="analytics.tasks"):
        assert tasks.analyze.apply().get() == "busy"
    assert "still going" in caplog.text and not AnalyticsRun.objects.exists()


def test_a_failed_run_on_beat_is_logged_and_recorded_and_the_last_figures_stay_with_their_age(
    archive_dir, db_queue, logger, settings, caplog, client, operator_client
):
    # Given a good run on beat (the hot tables only: no Spark)
    settings.MQ_ANALYTICS_LOCAL_BYTES = 1 << 20
    settings.MQ_METRICS_TOKEN = TOKEN
    subscribing.subscribe(logger, db_queue)
    publish(db_queue, 3)
    assert tasks.analyze.apply().get() == "done"
    good = list(EventStats.objects.values())
    assert good and good[0]["messages"] == 3

    # When a file of the archive cannot be read (cut short, say), the next run fails
    bad = archive_dir / "deliveries" / "queue=db" / "day=2026-11-20" / "part-1-9.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"PAR1 cut short")
    with caplog.at_level("ERROR", logger="analytics.tasks"):
        assert tasks.analyze.apply().get() == "failed"

    # Then it is logged as an error, with its exception
    [logged] = [r for r in caplog.records if r.name == "analytics.tasks" and r.levelname == "ERROR"]
    assert logged.exc_info and "ArrowInvalid" in caplog.text
    # ... and recorded, and the figures stay the good run's
    failure = AnalyticsFailure.objects.get()
    assert failure.error.startswith("ArrowInvalid:")
    assert list(EventStats.objects.values()) == good
    # ... which the API shows with their age, and the failure since
    body = operator_client.get("/api/analytics").json()
    assert body["run"]["age_s"] > 0 and body["events"][0]["messages"] == 3
    assert body["failures"]["since_run"] == 1
    assert body["failures"]["last"] == {"failed_at": failure.failed_at.isoformat(), "error": failure.error}
    # ... and so does /metrics
    cache.clear()
    samples = scrape(client)
    assert value(samples, "mq_analytics_failed_runs") == 1
    assert value(samples, "mq_analytics_last_failure_timestamp_seconds") == failure.failed_at.timestamp()
    assert value(samples, "mq_analytics_last_run_age_seconds") > 0
    assert value(samples, "mq_analytics_messages", queue="db", event="create") == 3
    # ... and the admin lists it
    page = operator_client.get(reverse("admin:analytics_analyticsfailure_changelist"))
    assert page.status_code == 200 and "ArrowInvalid" in page.content.decode()

    # When the file is gone, the next run succeeds: none has failed since it
    bad.unlink()
    assert tasks.analyze.apply().get() == "done"
    assert operator_client.get("/api/analytics").json()["failures"]["since_run"] == 0
    cache.clear()
    assert value(scrape(client), "mq_analytics_failed_runs") == 0


def test_the_task_may_run_longer_than_other_tasks(settings):
    assert tasks.analyze.soft_time_limit > settings.CELERY_TASK_TIME_LIMIT
    assert tasks.analyze.time_limit > tasks.analyze.soft_time_limit


@pytest.mark.parametrize(
    "master, cores",
    [
        ("local", 1),
        ("local[3]", 3),
        ("local[*]", os.cpu_count()),
        ("local[2,4]", 2),  # 4 is the failures allowed per task
        ("local[*,4]", os.cpu_count()),
        ("local-cluster[2,3,1024]", 6),
        ("spark://host:7077", None),
        ("yarn", None),
        (None, None),
    ],
)
def test_it_sizes_the_shuffle_for_the_cores_of_a_master_on_this_machine(master, cores):
    assert job._local_cores(master) == cores


def test_spark_settings_become_the_sessions_arguments(settings):
    settings.SPARK_REMOTE = ""
    settings.SPARK_MASTER = "local[2]"
    settings.MQ_SPARK_DRIVER_MEMORY = "1g"
    settings.MQ_SPARK_EVENT_LOG_DIR = ""
    settings.MQ_SPARK_CLASS_ARCHIVE = "/srv/mq/spark.jsa"
    settings.MQ_SPARK_CONF = {"spark.executor.memory": "4g"}
    assert spark_settings.session_options() == {
        "master": "local[2]",
        "remote": None,
        "driver_memory": "1g",
        "event_log_dir": None,
        "class_archive": "/srv/mq/spark.jsa",
        "conf": {"spark.executor.memory": "4g"},
    }
    settings.MQ_SPARK_CLASS_ARCHIVE = ""
    assert spark_settings.session_options()["class_archive"] is None
    assert spark_settings.session_options("local[1]")["master"] == "local[1]"
    # A Spark Connect server has its own master: SPARK_MASTER is not used then
    settings.SPARK_REMOTE = "sc://spark:15002"
    settings.MQ_SPARK_EVENT_LOG_DIR = "/var/log/spark"
    options = spark_settings.session_options("local[1]")
    assert (options["master"], options["remote"], options["event_log_dir"], options["conf"]) == (
        None,
        "sc://spark:15002",
        "/var/log/spark",
        None,  # the server's settings are its own
    )


def test_the_operators_settings_win_over_the_projects_own_defaults(spark):
    """build_session's `conf` (MQ_SPARK_CONF, through session_options) is applied last: the
    suite's session asks for 1 shuffle partition where local[2] alone would make it 4."""
    assert spark.conf.get("spark.sql.shuffle.partitions") == "1"
    assert spark.conf.get("spark.ui.enabled") == "false"


@pytest.mark.parametrize(
    "master, tuned",
    [("local[2]", True), ("local", True), ("local-cluster[2,1,1024]", True), ("spark://h:7077", False),
     ("yarn", False), ("k8s://https://h:6443", False), (None, False)],
)  # fmt: skip
def test_the_local_tuning_applies_on_a_local_master_only(master, tuned):
    conf = job.run_conf(master)
    assert conf["spark.sql.session.timeZone"] == "UTC"  # every master: the figures are in UTC
    assert ("spark.sql.files.openCostInBytes" in conf) is tuned
    assert ("spark.sql.sources.parallelPartitionDiscovery.threshold" in conf) is tuned


def test_the_session_in_use_gets_the_tuning_of_its_own_master(spark):
    job.configure(spark)
    assert spark.conf.get("spark.sql.files.openCostInBytes") == str(64 * 1024)


@pytest.mark.parametrize(
    "path, given",
    [
        ("/srv/mq/archive", "file:///srv/mq/archive"),
        ("var/archive", "file://" + os.path.abspath("var/archive")),
        ("file:///srv/mq/archive", "file:///srv/mq/archive"),
        ("s3a://bucket/mq", "s3a://bucket/mq"),
        ("hdfs://nn:8020/mq", "hdfs://nn:8020/mq"),
    ],
)
def test_spark_is_given_every_local_path_with_its_scheme(path, given):
    assert job.uri(path) == given


def test_a_local_driver_makes_its_class_archive_once_then_uses_it(tmp_path):
    """The first JVM writes Spark's classes' archive as it exits; the next ones map it."""
    path = tmp_path / "var" / "spark.jsa"
    assert "-XX:ArchiveClassesAtExit=" + str(path) in job._class_sharing(str(path))
    assert path.parent.is_dir()
    path.write_bytes(b"made by the first run")
    assert "-XX:SharedArchiveFile=" + str(path) in job._class_sharing(str(path))
    assert job._class_sharing(None) == ""


# The first four bytes of a dynamic class archive (HotSpot's CDS_DYNAMIC_ARCHIVE_MAGIC).
DYNAMIC_ARCHIVE_MAGIC = (0xF00BABA8).to_bytes(4, "little")


@pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="a JVM for half a minute, with no database in it: the SQLite pass of make test runs it",
)
def test_make_install_leaves_a_whole_class_archive_and_sparkclasses_keeps_it(settings):
    """`make install` runs `manage.py sparkclasses --force` (best effort: it goes on when that
    fails), so its archive is checked here rather than made again, a JVM's half minute per
    run; a checkout installed without Java has none, and this makes it."""
    archive = settings.MQ_SPARK_CLASS_ARCHIVE
    if not os.path.exists(archive):
        out = io.StringIO()
        call_command("sparkclasses", stdout=out)
        assert out.getvalue().startswith("made the class archive")

    # The JVM it ran wrote a whole class archive there (a dynamic CDS archive)
    with open(archive, "rb") as f:
        assert f.read(4) == DYNAMIC_ARCHIVE_MAGIC
    assert os.path.getsize(archive) > 10_000_000

    # ... and run again it keeps it
    out = io.StringIO()
    call_command("sparkclasses", stdout=out)
    assert out.getvalue().startswith("kept the class archive")


@pytest.mark.parametrize(
    "setting, value, says",
    [
        ("MQ_SPARK_CLASS_ARCHIVE", "", "MQ_SPARK_CLASS_ARCHIVE is empty"),
        ("SPARK_REMOTE", "sc://spark:15002", "has its own JVM"),
    ],
)
def test_sparkclasses_makes_none_where_no_local_driver_would_use_it(settings, tmp_path, setting, value, says):
    settings.MQ_SPARK_CLASS_ARCHIVE = str(tmp_path / "spark.jsa")
    setattr(settings, setting, value)
    out = io.StringIO()
    call_command("sparkclasses", stdout=out)
    assert says in out.getvalue() and not (tmp_path / "spark.jsa").exists()


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("SPARK_REMOTE", "http://spark:15002", "Spark Connect URL"),
        ("MQ_SPARK_DRIVER_MEMORY", "2 GB", "JVM memory size"),
        ("MQ_ANALYZE_EVERY_SECS", "0", "positive"),
        ("MQ_ANALYTICS_LOCAL_BYTES", "-1", "0 or a positive"),
        ("MQ_SPARK_CONF", "spark.executor.memory=4g", "JSON object"),
        ("MQ_SPARK_CONF", '["spark.executor.memory"]', "JSON object"),
        ("MQ_SPARK_CONF", '{"executor.memory": "4g"}', "not a Spark setting"),
        ("MQ_SPARK_CONF", '{"spark.executor.memory": {"size": "4g"}}', "not a Spark setting"),
    ],
)
def test_a_malformed_spark_setting_stops_start_up(name, value, says):
    env = {**os.environ, name: value}
    env.pop("DATABASE_URL", None)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='mqsite.settings'; django.setup()",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and name in done.stderr and says in done.stderr


SESSION_SCRIPT = """
import os, sys
from analytics import job
log_dir = sys.argv[1]
with job.session("local[1]", driver_memory="700m", event_log_dir="file://" + log_dir,
                 conf={"spark.ui.enabled": "false"}) as spark:
    assert spark.conf.get("spark.driver.memory") == "700m"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
    assert spark.range(10).count() == 10
    app_id = spark.sparkContext.applicationId
    jvm = spark.sparkContext._gateway.proc
# Its JVM ends with the session (job.end_driver_jvm), and a session after starts another
jvm.wait(60)
with job.session("local[1]", conf={"spark.ui.enabled": "false"}) as spark:
    assert spark.range(3).count() == 3 and spark.sparkContext.applicationId != app_id
print(app_id)
"""


def test_a_local_session_gets_its_driver_memory_writes_its_event_log_and_ends_its_jvm(tmp_path):
    # A process of its own: the driver's memory is read when the JVM starts, and the tests'
    # shared session has started one already.
    done = subprocess.run(
        [sys.executable, "-c", SESSION_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    app_id = done.stdout.strip().splitlines()[-1]
    # Spark 4 writes a folder per application (rolling event logs): eventlog_v2_<app id>
    assert any(app_id in name for name in os.listdir(tmp_path)), os.listdir(tmp_path)
