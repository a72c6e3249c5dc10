"""The start-up heap, kept out of the garbage collector's way in the server processes.

A Daphne process holds about 170,000 objects once Django, DRF, the admin, pyarrow and numpy
are imported, and nearly all of them live as long as the process. Python's collector walks
every one of them at each full collection: measured, a 103-111 ms stall of the event loop,
every socket and request of the process waiting (W3's and W6's p99). gc.freeze() moves them to
a generation the collector never walks: the stall is gone, and the collector still finds the
cycles made afterwards. What start-up left as garbage is collected first, so nothing but live
objects is frozen (frozen garbage would never be freed).

Called once a process has started: Daphne's (mqsite/asgi.py, when its reactor runs) and each
Celery worker's (mqsite/celery.py, when the worker is ready). Never in a test process, where
neither happens.
"""

import gc
import logging

log = logging.getLogger(__name__)


def freeze(web=False):
    """Collect once, then freeze what survived. `web`: import the URL configuration and its
    views first, which the first request would otherwise import after the freeze."""
    if web:
        from django.urls import get_resolver

        get_resolver().url_patterns  # noqa: B018 - the property imports every view
    gc.collect()
    gc.freeze()
    # The count read from the collector itself: what a test of a started process checks.
    log.info("start-up heap frozen: %d objects the garbage collector no longer walks", gc.get_freeze_count())
