"""Which serving processes /metrics shows process_* for, from a multiprocess folder
(mqsite.prometheus): the live ones, each labelled with its pid and role; a process killed
outright (no exit hook ran) is taken off at the next scrape, and what it counted stays."""

import os
import subprocess
import sys

from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from mqsite import prometheus


def register(folder, pid, role):
    """What register_process() writes in a process `pid` of the folder."""
    values = MmapedDict(str(folder / f"gauge_liveall_{pid}.db"))
    key = mmap_key(
        prometheus.SERVING, prometheus.SERVING, ["role"], [role], "A serving process of this machine."
    )
    values.write_value(key, 1.0, 0.0)
    values.close()


def count(folder, pid, n):
    """A histogram-free counter file of process `pid`, as a process's counts are kept."""
    values = MmapedDict(str(folder / f"counter_{pid}.db"))
    values.write_value(mmap_key("mq_things_total", "mq_things_total", [], [], "Things."), n, 0.0)
    values.close()


def gone_pid():
    """The pid of a process that has exited."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_a_killed_process_goes_from_the_figures_and_its_counts_stay(tmp_path):
    dead = gone_pid()
    register(tmp_path, os.getpid(), "web")
    register(tmp_path, dead, "webhooks")
    count(tmp_path, dead, 7)

    assert prometheus.serving_processes(str(tmp_path)) == [(os.getpid(), "web")]

    assert not (tmp_path / f"gauge_liveall_{dead}.db").exists()
    totals = {
        s.name: s.value
        for f in MultiProcessCollector.merge([str(tmp_path / f"counter_{dead}.db")])
        for s in f.samples
    }
    assert totals["mq_things_total"] == 7


def test_each_process_has_the_standard_figures_labelled_with_its_pid_and_role():
    families = {
        f.name: f for f in prometheus.process_families([(os.getpid(), "web"), (os.getppid(), "worker")])
    }
    assert {
        "process_cpu_seconds",  # a counter: its sample is process_cpu_seconds_total
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_start_time_seconds",
        "process_open_fds",
        "process_max_fds",
    } <= set(families)
    rss = {
        (s.labels["pid"], s.labels["role"]): s.value
        for s in families["process_resident_memory_bytes"].samples
    }
    assert set(rss) == {(str(os.getpid()), "web"), (str(os.getppid()), "worker")}
    assert all(v > 1_000_000 for v in rss.values())
    assert families["process_cpu_seconds"].type == "counter"
