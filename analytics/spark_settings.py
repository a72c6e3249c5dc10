"""The Django settings of Spark as analytics.job's session arguments (job.py imports nothing but
PySpark and the standard library, so it cannot read them itself).

    with job.session(**spark_settings.session_options()) as spark: ...
"""

from django.conf import settings


def session_options(master=None):
    """job.session's keyword arguments: SPARK_REMOTE when set (a Spark Connect server, and then
    no master), else `master` or SPARK_MASTER, with the local driver's memory and event log, and
    the operator's MQ_SPARK_CONF (a Connect server has its own)."""
    remote = settings.SPARK_REMOTE or None
    return {
        "master": None if remote else (master or settings.SPARK_MASTER),
        "remote": remote,
        "driver_memory": settings.MQ_SPARK_DRIVER_MEMORY or None,
        "event_log_dir": settings.MQ_SPARK_EVENT_LOG_DIR or None,
        "class_archive": settings.MQ_SPARK_CLASS_ARCHIVE or None,
        "conf": None if remote else dict(settings.MQ_SPARK_CONF),
    }
