"""The processes of a fault run, on loopback: Daphne processes on fixed ports (so that a
restarted one comes back where its clients look), Celery workers with beat, a private Redis
(services mode) and, where it can be made, a private PostgreSQL cluster that may be crashed
without touching the machine's own."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.support.servers import free_port, start_daphne, start_redis, start_worker

PG_BIN = Path(os.environ.get("MQ_FAULTS_PG_BIN", "/usr/lib/postgresql/15/bin"))


class PrivatePostgres:
    """A PostgreSQL cluster of its own in a temporary folder, on a free port, with the
    defaults that make a commit durable (fsync, synchronous_commit). Run as the postgres user
    when we are root (PostgreSQL refuses to run as root)."""

    def __init__(self):
        self.top = Path(tempfile.mkdtemp(prefix="mq-faults-pg-"))
        self.top.chmod(0o755)
        self.data = self.top / "data"
        self.port = free_port()
        self.log = self.top / "postgres.log"
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @staticmethod
    def available():
        return (PG_BIN / "initdb").exists() and (os.geteuid() != 0 or shutil.which("runuser"))

    def _run(self, *args, timeout=120):
        subprocess.run([*self.as_postgres, *args], check=True, capture_output=True, timeout=timeout)

    def start(self):
        if not self.data.exists():
            self.data.mkdir()
            if self.as_postgres:
                shutil.chown(self.data, "postgres", "postgres")
                shutil.chown(self.top, "postgres", "postgres")
            self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                      "--no-locale", "-E", "UTF8")  # fmt: skip
        options = f"-p {self.port} -k {self.top} -c listen_addresses=127.0.0.1 -c max_connections=300"
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                  "-t", "120", "start")  # fmt: skip

    def crash(self):
        """Stop as a power cut would: no checkpoint; the restart replays the WAL."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self):
        try:
            self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.top, ignore_errors=True)

    def url(self, name):
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"

    def create_database(self, name):
        self._run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)


class Cluster:
    """Daphne processes and Celery workers on one database; in the services mode a private
    Redis carries the channel layer, the cache and Celery's jobs (kept in an append-only file,
    so a restart finds them unless the nemesis wipes it)."""

    def __init__(self, services, daphnes=2, workers=2, env=None, postgres=None):
        self.services = services
        self.postgres = postgres  # a PrivatePostgres the nemesis may crash, or None
        self.workdir = Path(tempfile.mkdtemp(prefix="mq-faults-"))
        self.redis = None
        self.redis_dir = self.workdir / "redis"
        self.env = {
            "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
            # Retries come back quickly: the run tests that they come back, not how late.
            "MQ_BACKOFF_BASE_SECS": "0.2",
            "MQ_BACKOFF_MAX_SECS": "2",
            # The run counts losses, not refusals: no REST rate limit (as tests/support/servers.py).
            "MQ_THROTTLE_RATE": "1000000/s",
            "LOG_LEVEL": "WARNING",
            "PYTHONFAULTHANDLER": "1",
            **(env or {}),
        }
        self.ports = [free_port() for _ in range(daphnes if services else 1)]
        self.webs = [None] * len(self.ports)
        self.workers = [None] * (workers if services else 1)
        self.server_errors = Counter()  # what the processes' logs said went wrong
        self.stuck = []  # the logs of a process that would not stop, or died by itself

    # --- start and stop ---

    def start(self):
        if self.services:
            self.redis_dir.mkdir()
            self.redis = start_redis(data_dir=self.redis_dir)
            self.env["REDIS_URL"] = self.redis.url
        for i in range(len(self.webs)):
            self.start_web(i)
        for i in range(len(self.workers)):
            self.start_worker(i)

    def start_web(self, i):
        for attempt in range(5):
            try:
                self.webs[i] = start_daphne(self.env, port=self.ports[i])
                return
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(1)

    def start_worker(self, i):
        self.workers[i] = start_worker({**self.env, "LOG_LEVEL": "WARNING"})

    def stop(self):
        for worker in self.workers:
            if worker is not None:
                worker.stop(signal.SIGKILL)  # its process group: the embedded beat too
                self.retire(worker)
        for web in self.webs:
            if web is not None:
                web.proc.kill()
                web.proc.wait()
                self.retire(web)
        if self.redis is not None:
            self.redis.stop(signal.SIGKILL)
            self.retire(self.redis)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def retire(self, proc):
        """A process is gone: keep what went wrong in its log (tracebacks, errors), drop the rest."""
        path = Path(proc.log.name)
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                # The exception, and the last line of ours (or any) it went through.
                end = next(
                    (j for j in range(i + 1, min(i + 200, len(lines))) if not lines[j].startswith(" ")), i
                )
                frames = [t.strip() for t in lines[i + 1 : end] if t.strip().startswith("File ")]
                ours = [f for f in frames if "/.venv/" not in f] or frames
                where = ours[-1] if ours else ""
                self.server_errors[f"{lines[end][:200]} (at {where[-120:]})"] += 1
        path.unlink(missing_ok=True)

    @property
    def http_urls(self):
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    @property
    def ws_urls(self):
        return [f"ws://127.0.0.1:{p}/ws/" for p in self.ports]

    # --- faults ---

    def kill_worker(self, i, sig=signal.SIGKILL):
        worker = self.workers[i]
        # Its process group: a SIGKILL takes the embedded beat too. SIGTERM: a warm shutdown
        # finishes the job under way.
        worker.stop(sig, timeout=60)
        self.retire(worker)

    def kill_web(self, i, sig=signal.SIGKILL, grace_secs=20):
        """Stop a Daphne process; returns the seconds it took. SIGTERM gets the grace a process
        manager gives (supervisord's stopwaitsecs), then SIGKILL, which is noted."""
        web = self.webs[i]
        started = time.monotonic()
        web.proc.send_signal(sig)
        try:
            web.proc.wait(timeout=grace_secs)
        except subprocess.TimeoutExpired:
            # SIGABRT: faulthandler (PYTHONFAULTHANDLER) writes every thread's stack to the log.
            self.server_errors[f"web did not stop within {grace_secs} s of {sig.name}"] += 1
            web.proc.send_signal(signal.SIGABRT)
            try:
                web.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                web.proc.kill()
                web.proc.wait()
            self.stuck.append(Path(web.log.name).read_text(errors="replace")[-20000:])
        self.retire(web)
        return time.monotonic() - started

    def restart_redis(self, wipe=False):
        """Stop Redis and start it again on its port. SIGTERM lets it write its append-only
        file (it comes back with its jobs); `wipe` kills it and deletes its data."""
        self.redis.stop(signal.SIGKILL if wipe else signal.SIGTERM)
        self.retire(self.redis)
        if wipe:
            shutil.rmtree(self.redis_dir)
            self.redis_dir.mkdir()
        self.redis = start_redis(self.redis.port, data_dir=self.redis_dir)

    def crash_postgres(self):
        self.postgres.crash()

    def start_postgres(self):
        self.postgres.start()

    def keep_log_of(self, kind, i):
        """Keep the end of a log that explains a death, before the process is replaced."""
        proc = {"web": self.webs, "worker": self.workers}.get(kind, [self.redis])[i]
        lines = Path(proc.log.name).read_text(errors="replace").splitlines()
        why = [line for line in lines if "CRITICAL" in line or "Unrecoverable" in line or "ERROR" in line]
        tail = "\n".join(lines[-60:])
        self.stuck.append(
            f"{kind} {i} exited with {proc.proc.returncode}:\n" + "\n".join(why[-20:]) + f"\n...\n{tail}"
        )

    def dead(self):
        """Processes that exited on their own (not by the nemesis): (kind, index)."""
        found = [("web", i) for i, w in enumerate(self.webs) if w is not None and w.proc.poll() is not None]
        found += [
            ("worker", i) for i, w in enumerate(self.workers) if w is not None and w.proc.poll() is not None
        ]
        if self.redis is not None and self.redis.proc.poll() is not None:
            found.append(("redis", 0))
        return found
