"""The one local SparkSession of the test run. Import the fixture into a test module:

    from tests.support.spark import spark  # noqa: F401

Small and quick to start: local[2], one shuffle partition (the data are tiny), no UI, and the
JVM's quick compiler only (most of a tiny job's time is JIT warm-up, not work).
"""

import pytest

SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "1",
    "spark.default.parallelism": "2",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.extraJavaOptions": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1",
    "spark.sql.warehouse.dir": "/tmp/mqsite-spark-warehouse",
}


@pytest.fixture(scope="session")
def spark():
    from analytics import job

    session = job.build_session("local[2]", app_name="mqsite-tests", conf=SPARK_CONF)
    yield session
    session.stop()
