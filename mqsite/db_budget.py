"""How many PostgreSQL connections the processes `make run` starts may open (its programs, as
mqsite/supervisord.conf runs them), and the web processes' share of what is left of the server's
max_connections (docs/operations/index.md, "PostgreSQL connections").

A process opens connections only as its threads need them, each thread at most one at a time
(Django's pool, DB_POOL_MAX_SIZE, opened MIN_OPEN at once), so a Celery worker's need is known
from its thread count. A web process's is not: Daphne runs each request's Django code in a
thread of its own, and the socket's operations run on an async pool (mqsite/adb.py), so its two
pools' caps are what bounds it, and they take what the workers leave.
"""

from mqsite import run_programs

# Django's pool opens this many connections as the process starts (OPTIONS["pool"]["min_size"]).
MIN_OPEN = 2

# Besides the task threads, a worker's main thread (its start-up and shutdown handlers) and its
# liveness thread (delivery.liveness) each use one.
WORKER_OVERHEAD = 2

# Queues whose tasks hold the archive's lock, on a connection of its own while the task runs
# (analytics.archive.exclusive: the archive run, compaction, the analysis).
LOCKING_QUEUES = {"maintenance", "analytics"}

# The default number of web processes (the CPU count) stops here: 8 of them fit PostgreSQL's
# default max_connections with their pools at 3 + 4 connections; 16 would not, at 2 + 2.
MAX_DEFAULT_WEB_PROCESSES = 8

# What a web process's two pools are never given more than (the defaults measured in
# bench/PROFILE.md: fewer async connections starved a fan-out to socket subscribers).
WEB_POOL_CAP = 20


def _option(args, flag, default=None):
    return args[args.index(flag) + 1] if flag in args else default


def worker_connections(args):
    """The most connections a Celery program (its argv) opens at once, its pool children's
    included; 0 for a program that is not Celery."""
    if "celery" not in args[0]:
        return 0
    if "beat" in args:
        return MIN_OPEN  # one thread, the scheduler's
    threads = int(_option(args, "-c", "1"))
    locking = bool(LOCKING_QUEUES & set(_option(args, "-Q", "celery").split(",")))
    if _option(args, "-P", "prefork") == "prefork":
        # The parent runs no task; each child one at a time (its thread, and the lock's).
        child = max(MIN_OPEN, 1 + locking)
        return max(MIN_OPEN, WORKER_OVERHEAD) + threads * child
    return max(MIN_OPEN, threads + WORKER_OVERHEAD + locking)


def workers(programs=None):
    """{program: connections} of the workers and beat `make run` starts (the demo traffic, off
    unless asked for, talks to the API and is not counted)."""
    programs = run_programs.programs() if programs is None else programs
    return {
        name: need for name, args in programs.items() if name != "demo" and (need := worker_connections(args))
    }


def web_share(usable, web_processes, programs=None):
    """(sync pool cap, async pool cap) of each web process: what the workers leave of `usable`
    connections, split evenly between the processes and, in each, between its two pools (the
    async one gets the odd one), at most WEB_POOL_CAP each and at least MIN_OPEN."""
    each = (usable - sum(workers(programs).values())) // web_processes
    sync = min(WEB_POOL_CAP, max(MIN_OPEN, each // 2))
    return sync, min(WEB_POOL_CAP, max(MIN_OPEN, each - sync))


def table(web_processes, web_sync, web_async, programs=None):
    """[(process, count, connections each)] for the whole of `make run`, and the total."""
    rows = [("web (Daphne)", web_processes, web_sync + web_async)]
    rows += [(name, 1, need) for name, need in workers(programs).items()]
    return rows, sum(count * each for _, count, each in rows)


def size_web_pool():
    """Give this process, a web process, its sync pool cap (MQ_WEB_DB_POOL_MAX_SIZE) in place
    of every process's DB_POOL_MAX_SIZE: called by mqsite/asgi.py under Daphne, before anything
    connects (Django makes its pool at the first connection)."""
    from django.conf import settings

    pool = settings.DATABASES["default"].get("OPTIONS", {}).get("pool")
    if isinstance(pool, dict):
        pool["max_size"] = settings.MQ_WEB_DB_POOL_MAX_SIZE
