"""What the serving processes count themselves for /metrics (the latency histograms of
delivery.observe) and their process_* figures, beside the snapshot's gauges (dashboard.metrics).

prometheus-client's multiprocess mode, when PROMETHEUS_MULTIPROC_DIR names a folder (`make run`
gives one, emptied at each start): each process writes its counts to files of its own there,
and whichever process answers a scrape adds up every process's. Chosen over per-process series
because a scrape cannot choose its process: the MQ_WEB_PROCESSES Daphne processes accept on one
socket and the kernel hands the scrape to any of them, and the webhook worker, which acks what
it posts, serves no HTTP at all. Per-process series would jump from one process's counts to
another's at each scrape. The folder is one machine's (one pid namespace): a deployment of
several machines has each scraped by its own address.

process_* are read at each scrape from /proc for every serving process of the folder (those
that called register_process(), each labelled with its `pid` and `role`), since
prometheus-client's own process collector sees only the process it runs in. Without the folder,
the one process counts alone and /metrics shows its own counts and figures (`manage.py
runserver`, the tests' in-process client).

A process that exits marks itself dead (its `live` files go; its counts stay, as counters
must); one killed outright is marked dead by the next scrape that finds its pid gone.
"""

import atexit
import glob
import os

from django.conf import settings
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.process_collector import ProcessCollector

# The counts kept in this process's memory when there is no folder (delivery.observe's
# histograms register here).
LOCAL = CollectorRegistry(auto_describe=True)

# Which processes of the folder serve: one `live` file each, removed when it exits
# (prometheus-client labels each sample with its pid). Bookkeeping, not shown on /metrics.
SERVING = "mq_serving_process"
_serving = Gauge(
    SERVING, "A serving process of this machine.", ["role"], multiprocess_mode="liveall", registry=None
)
_role = "python"


def directory():
    """The multiprocess folder, or None (the setting: the variable prometheus-client reads)."""
    return settings.PROMETHEUS_MULTIPROC_DIR or None


def register_process(role):
    """This process serves (`role`: web, or a Celery worker's name): its process_* figures are
    shown from now on, labelled so, until it exits (exiting(), at exit; a process that leaves
    by os._exit, as Daphne does, calls it itself)."""
    global _role, _registered
    _role = role
    if directory():
        _serving.labels(role).set(1)
        _registered = os.getpid()
        atexit.register(exiting)


_registered = None  # the pid that registered (a forked child inherits the atexit hook, not the role)


def exiting():
    """This process stops serving: its process_* go from /metrics (its counts stay)."""
    if directory() and os.getpid() == _registered:
        mark_process_dead(_registered)


def _alive(pid):
    return os.path.exists(f"/proc/{pid}")


def serving_processes(folder):
    """[(pid, role)] of the live serving processes of the folder; the dead ones' live files go."""
    files = glob.glob(os.path.join(folder, "gauge_liveall_*.db"))
    found = []
    for family in MultiProcessCollector.merge(files, accumulate=False):
        if family.name != SERVING:
            continue
        for sample in family.samples:
            pid = sample.labels["pid"]
            if _alive(pid):
                found.append((int(pid), sample.labels["role"]))
            else:  # killed outright (no atexit): what it counted stays, its liveness goes
                mark_process_dead(pid, folder)
    return sorted(found)


def process_families(processes):
    """The standard process_* families (prometheus-client's ProcessCollector: CPU, memory, file
    descriptors, start time), one sample per process, labelled `pid` and `role`."""
    merged = {}
    for pid, role in processes:
        reader = ProcessCollector(pid=lambda pid=pid: pid, registry=None)
        for family in reader.collect():
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                into.add_sample(sample.name, {"pid": str(pid), "role": role}, sample.value)
    return list(merged.values())


class _Counted:
    """The histograms added up over the folder's processes (or this process's alone), and each
    serving process's process_* figures."""

    def collect(self):
        folder = directory()
        if folder is None:
            yield from LOCAL.collect()
            yield from process_families([(os.getpid(), _role)])
            return
        processes = serving_processes(folder)
        for family in MultiProcessCollector.merge(glob.glob(os.path.join(folder, "*.db"))):
            if family.name != SERVING:
                yield family
        yield from process_families(processes)


def exposition():
    """The text exposition of what the processes count (read at each scrape: a few small files)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Counted())
    return generate_latest(registry)
