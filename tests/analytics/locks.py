"""The archive's lock held by someone else, as another process would hold it."""

import contextlib
import threading

from django.conf import settings
from django.db import connection

from analytics import archive


@contextlib.contextmanager
def archive_held_elsewhere(root=None):
    """Hold the archive's lock (analytics.archive.exclusive) from another thread, on its own
    database connection, for the block; yields the Event that lets it go early."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        try:
            with archive.exclusive(str(root or settings.MQ_ARCHIVE_DIR)):
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(30), "the other holder never got the lock"
        yield release
    finally:
        release.set()
        thread.join()
