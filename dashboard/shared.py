"""One snapshot (dashboard.snapshot.overview) for the whole deployment, at most about a second
old, shared by every open dashboard and every /metrics scrape of every process.

It is kept in Django's cache: Redis in the services mode, so every Daphne process serves the
same one, and the process memory in the embedded mode, which is one process. Whoever finds it
older than it may be computes the next one, one process at a time (a cache.add lock); the
others meanwhile serve the one they have, or, when there is none yet, wait for it. However many
dashboards are open and however often /metrics is scraped, the database computes at most one
snapshot per FRESH_SECS, and the publishers share it with nothing else.
"""

import logging
import os
import time

from django.core.cache import cache

from . import snapshot

log = logging.getLogger(__name__)

KEY = "mq:snapshot"
LOCK_KEY = "mq:snapshot:computing"
# A dashboard ticks every second; a snapshot this old is due for the next tick.
FRESH_SECS = 0.9
LOCK_SECS = 60  # a process that died computing holds the others back at most this long
KEEP_SECS = 3600  # an older snapshot stays, to be served while the next one is computed
WAIT_SECS = 5.0  # with no snapshot at all, how long a reader waits for another's computation


def compute():
    """A new snapshot, (when, data). It folds the kept counts' changes first (the computing
    process does it for everyone, once a second)."""
    return time.time(), snapshot.overview()


def _cached(method, *args):
    """A cache call; None when the cache (Redis) is down: then each reader computes its own,
    rather than fail."""
    try:
        return method(*args)
    except Exception:
        log.warning("snapshot: the cache did not answer; computing this one directly", exc_info=True)
        return None


def current(max_age=FRESH_SECS, fresh=False):
    """(when it was computed, the overview): the shared one while it is at most `max_age`
    seconds old, else the next one. `fresh`: compute a new one now whatever the age (a
    dashboard's first snapshot, which must show what was done just before it opened)."""
    if fresh or max_age <= 0:
        return _store(compute())
    held = _cached(cache.get, KEY)
    if held is not None and time.time() - held[0] <= max_age:
        return held
    if _cached(cache.add, LOCK_KEY, os.getpid(), LOCK_SECS) is not False:
        try:
            # Another process may have stored one between our read and our lock (it computed,
            # stored and let go): serve that one rather than compute a second in that second.
            again = _cached(cache.get, KEY)
            if again is not None and time.time() - again[0] <= max_age:
                return again
            return _store(compute())
        finally:
            _cached(cache.delete, LOCK_KEY)
    if held is not None:
        return held
    deadline = time.monotonic() + WAIT_SECS
    while time.monotonic() < deadline:
        time.sleep(0.05)
        held = _cached(cache.get, KEY)
        if held is not None:
            return held
    return _store(compute())


def _store(taken):
    _cached(cache.set, KEY, taken, KEEP_SECS)
    return taken
