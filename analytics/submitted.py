"""The figures of what a spark-submitted analytics/job.py wrote (`manage.py analyze --parts DIR`).

    spark-submit analytics/job.py --archive ROOT --files LIST --out DIR   (on a cluster)
    manage.py analyze --parts DIR --json                                   (here)

The job writes the parts of the archive files it was given (message_hours/, delivery_cells/,
latency_sketches/, subscriber_latency_sketches/ under DIR, Spark's Parquet folders); they are reduced to
hour rows and figures exactly as a run's own parts are (analytics.analysis). They cover those
files alone: not the hot tables, nor anything kept by earlier runs, and nothing is stored.
"""

import pyarrow.parquet as pq
from pyarrow import fs as pafs

from . import analysis, figures, hours, layout, stored


class NoParts(ValueError):
    """DIR does not hold the job's output."""


def read_parts(parts_dir):
    """{name: Arrow table} of the job's parts under `parts_dir` (local path or URI)."""
    fs, base = layout.filesystem(parts_dir)
    parts = {}
    for name in hours.PART_SCHEMAS:
        folder = f"{base.rstrip('/')}/{name}"
        if fs.get_file_info(folder).type != pafs.FileType.Directory:
            raise NoParts(f"{parts_dir} holds no {name}/: not the output of analytics/job.py (--out)")
        # Spark's _SUCCESS and .crc files are skipped: pyarrow ignores names starting _ or .
        parts[name] = pq.read_table(folder, filesystem=fs)
    return parts


def figures_of(parts_dir, *, now):
    """The figures of the job's output under `parts_dir`, as `analyze --json` prints them."""
    rows = analysis._derived(read_parts(parts_dir))
    event_stats, _ = figures.event_figures(rows["events"])
    subscriber_stats, _ = figures.subscriber_figures(rows["subscribers"], now=now)
    return stored.as_json(event_stats, subscriber_stats)
