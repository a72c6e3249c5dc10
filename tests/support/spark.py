"""The one local SparkSession of the test run: how it is built. The `spark` fixture that hands
it to tests is in tests/analytics/conftest.py (session-scoped: one JVM for the whole run).

Small and quick to start: local[2], one shuffle partition (the data are tiny), no UI, and the
JVM's quick compiler only (most of a tiny job's time is JIT warm-up, not work).
"""

SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "1",
    "spark.default.parallelism": "2",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.extraJavaOptions": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1",
    "spark.sql.warehouse.dir": "/tmp/mqsite-spark-warehouse",
}


def new_session():
    """A new SparkSession for the tests (stop it when done)."""
    from analytics import job

    return job.build_session("local[2]", app_name="mqsite-tests", conf=SPARK_CONF)
