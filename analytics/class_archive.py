"""The local Spark driver's class archive (MQ_SPARK_CLASS_ARCHIVE), made ahead of the first run.

A driver JVM started with it maps Spark's classes already parsed and verified (the JVM's
AppCDS, analytics.job._class_sharing): measured on 2 vCPUs, a session's start 4.9 s -> 2.4 s.
A run that finds no archive has its JVM write one as it exits, but that first run then pays
about 3 s more, and it is the run an operator times right after an install. So `make install`
runs `manage.py sparkclasses`, which runs the real job once over a tiny archive in a child
process and waits for its JVM to exit and write the archive:

    python -m analytics.class_archive PATH [MASTER]     (the child; no Django)

The archive holds the classes that run loaded, which are those of any run (the same plan
shapes); the classes Spark generates for a query are made anew by every JVM anyway.
"""

import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta

from . import job, layout

# The child's time to start a JVM, run the tiny job and write the archive (about 20 s here).
CHILD_TIMEOUT_SECS = 300


def make(path, master="local[2]", *, force=False):
    """Make the class archive at `path` unless it exists (or with `force`, again). Returns
    whether it made one; raises RuntimeError when the child failed to."""
    if os.path.exists(path):
        if not force:
            return False
        os.remove(path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # This interpreter on this module, with arguments from the settings: nothing untrusted.
    try:
        done = subprocess.run(  # noqa: S603
            [sys.executable, "-m", "analytics.class_archive", os.path.abspath(path), master],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_SECS,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"no class archive was made at {path} in {CHILD_TIMEOUT_SECS} s") from exc
    if done.returncode or not os.path.exists(path):
        raise RuntimeError(f"no class archive was made at {path}: {done.stderr.strip()[-2000:]}")
    return True


def _tiny_history(root):
    """Two messages of two events, acked, pending and dead deliveries, in the archive's layout;
    returns the files written by kind."""
    at = datetime(2026, 1, 1, 12, tzinfo=UTC)
    messages = [
        (1, "create", 1, at, "{}", "", "warmup", "{}"),
        (2, "delete", 2, at + timedelta(minutes=1), "{}", "", "warmup", "{}"),
    ]
    deliveries = [
        (1, 1, "create", "a", 1, "acked", 1, at, at, at + timedelta(seconds=1), ""),
        (2, 1, "create", "b", 1, "dead", 5, at, at, None, "boom"),
        (3, 2, "delete", "a", 2, "pending", 0, at + timedelta(minutes=1), None, None, ""),
    ]
    written = layout.write_history(root, "warmup", messages, deliveries, durable=False)
    return {kind: [p for p in written if f"/{kind}/" in p] for kind in (layout.MESSAGES, layout.DELIVERIES)}


def _run_once(path, master):
    with tempfile.TemporaryDirectory() as root:
        files = _tiny_history(root)
        spark = job.build_session(master, app_name="mqsite-class-archive", class_archive=path, quick_jit=True)
        job.compute_parts(
            spark,
            job.extract_archive(spark, root, layout.MESSAGES, files[layout.MESSAGES]),
            job.extract_archive(spark, root, layout.DELIVERIES, files[layout.DELIVERIES]),
        )
        spark.stop()
        job.end_driver_jvm(timeout=CHILD_TIMEOUT_SECS)


if __name__ == "__main__":
    _run_once(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "local[2]")
