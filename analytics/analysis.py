"""The analytics run behind `manage.py analyze`: extract, the Spark job, load.

    hot tables --extract--> <out>/recent-<run>/   (Parquet, the archive's layout)
    archive + recent --job (Spark)--> <out>/event_stats/, event_rates_*/, subscriber_stats/
    results --load--> EventStats, EventRate, SubscriberStats (the admin's)

`<out>` defaults to `<MQ_ARCHIVE_DIR>/_analytics`: beside the archive, so that wherever Spark
runs (local[*], or a cluster named by SPARK_MASTER) it reads and writes the same storage. The
leading underscore keeps it out of Spark's and DuckDB's way when they read the archive root.
"""

import os
import uuid

from django.conf import settings
from django.utils import timezone

from . import extract, job, layout, load


def default_out():
    return f"{str(settings.MQ_ARCHIVE_DIR).rstrip('/')}/_analytics"


def run_analysis(*, now=None, out=None, master=None):
    """Compute and store the statistics; returns load.results_json() of them."""
    now = now or timezone.now()
    out = _spark_path(out or default_out())
    recent = f"{out}/recent-{uuid.uuid4().hex[:12]}"
    try:
        extract.extract_recent(recent)
        with job.session(master or settings.SPARK_MASTER) as spark:
            job.run(spark, archive=_spark_path(settings.MQ_ARCHIVE_DIR), recent=recent, out=out, now=now)
    finally:
        layout.remove_tree(recent)
    load.load_results(out, computed_at=now)
    return load.results_json()


def _spark_path(path):
    """A local path made absolute (Spark would resolve it against its own working directory)."""
    path = str(path).rstrip("/")
    return path if "://" in path else os.path.abspath(path)


class AnalysisBusy(RuntimeError):
    """Another run of the analysis holds the run (it is still going): this one did nothing."""
