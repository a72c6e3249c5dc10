"""The nemesis: one fault at a time, at random intervals, each fault type at least once.

Every fault ends with the cluster whole again (the killed process restarted), so that the
next fault starts from a working system; what a fault costs is then only what it broke while
it lasted, which is what the checker counts.
"""

import logging
import random
import signal
import threading
import time
from collections import Counter

log = logging.getLogger(__name__)

SERVICES_FAULTS = (
    "kill_worker",
    "term_worker",
    "kill_web",
    "term_web",
    "restart_redis",
    "wipe_redis",
    "drop_connections",
)
EMBEDDED_FAULTS = ("kill_worker", "term_worker", "kill_web", "term_web", "drop_connections")
ONCE = {"wipe_redis"}  # the brief: Redis restarted once with its data wiped


class Nemesis(threading.Thread):
    def __init__(self, cluster, workload, history, faults, interval_secs=(3, 8), seed=0):
        super().__init__(name="nemesis", daemon=True)
        self.cluster, self.workload, self.history = cluster, workload, history
        self.faults = list(faults)
        self.interval_secs = interval_secs
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.round_done = threading.Event()  # every fault has happened once
        self.done = Counter()
        self.errors = []  # faults that could not be carried out
        # Processes that exited by themselves: restarted, as a process manager would (make
        # run's supervisord does), and reported; they count against the run only through what
        # they lose, which the checker sees.
        self.exits = []

    def schedule(self):
        """Each fault once in a random order, then at random (the once-only ones not again)."""
        first = self.faults[:]
        self.rng.shuffle(first)
        yield from first
        again = [f for f in self.faults if f not in ONCE]
        while True:
            yield self.rng.choice(again)

    def run(self):
        if not self.faults:
            self.round_done.set()
            return
        for n, fault in enumerate(self.schedule()):
            if n == len(self.faults):
                self.round_done.set()
            if self.halt.wait(self.rng.uniform(*self.interval_secs)):
                return
            started = time.monotonic()
            self.history.note(f"nemesis: {fault}")
            try:
                getattr(self, fault)()
                self.done[fault] += 1
            except Exception as exc:  # a fault that failed to run is a finding, not a crash
                log.exception("fault %s failed", fault)
                self.errors.append(f"{fault}: {exc!r}")
                self.history.note(f"nemesis: {fault} failed: {exc!r}")
            self.heal()
            self.history.note(f"nemesis: {fault} over in {time.monotonic() - started:.1f} s")

    def stop(self):
        self.halt.set()
        self.join(timeout=300)
        self.heal()

    def heal(self):
        """Restart whatever is down, the nemesis's doing or not (a process that died by itself
        is noted: that is a finding)."""
        for kind, i in self.cluster.dead():
            self.history.note(f"nemesis: found {kind} {i} dead; restarting it")
            self.exits.append(f"{kind} {i}")
            self.cluster.keep_log_of(kind, i)
            if kind == "web":
                self.cluster.start_web(i)
            elif kind == "worker":
                self.cluster.start_worker(i)
            elif kind == "redis":
                self.cluster.restart_redis()

    def pause(self):
        return self.rng.uniform(0, 2)

    # --- the faults ---

    def kill_worker(self):
        i = self.rng.randrange(len(self.cluster.workers))
        self.cluster.kill_worker(i, signal.SIGKILL)
        time.sleep(self.pause())
        self.cluster.start_worker(i)

    def term_worker(self):
        i = self.rng.randrange(len(self.cluster.workers))
        self.cluster.kill_worker(i, signal.SIGTERM)
        self.cluster.start_worker(i)

    def kill_web(self):
        i = self.rng.randrange(len(self.cluster.webs))
        self.cluster.kill_web(i, signal.SIGKILL)
        time.sleep(self.pause())
        self.cluster.start_web(i)

    def term_web(self):
        i = self.rng.randrange(len(self.cluster.webs))
        took = self.cluster.kill_web(i, signal.SIGTERM)
        self.history.note(f"nemesis: web {i} stopped in {took:.1f} s after SIGTERM")
        self.cluster.start_web(i)

    def restart_redis(self):
        self.cluster.restart_redis(wipe=False)

    def wipe_redis(self):
        self.cluster.restart_redis(wipe=True)

    def restart_postgres(self):
        self.cluster.crash_postgres()
        time.sleep(self.pause())
        self.cluster.start_postgres()

    def drop_connections(self):
        self.workload.drop_connections()
