"""Another transaction holding a queue's row lock, for tests of what waits on it."""

import threading

from django.db import connection, transaction

from queues.models import Queue


class QueueLock(threading.Thread):
    """Another transaction holding the queue's row lock (on SQLite: the write lock) until told."""

    def __init__(self, queue):
        super().__init__()
        self.queue, self.held, self.release = queue, threading.Event(), threading.Event()

    def run(self):
        try:
            with transaction.atomic():
                Queue.objects.select_for_update().filter(pk=self.queue.pk).update(paused=False)
                self.held.set()
                self.release.wait(30)
        finally:
            connection.close()
