"""Group commit: publishes to one queue that arrive together share one transaction.

A publish is answered only after its transaction commits, and a commit waits for the disk
(fsync). Publishes of one queue are serialised by the queue's row lock (it is what makes `seq`
follow commit order), so one by one they could never go faster than one fsync each, however
many clients publish at once. Here, the publishes that arrive while a transaction of their
queue is committing wait for it, then go together in the next one: one lock, one fsync, the
same answers, each still sent only after the commit that holds its message. Nothing waits at
low load: the first caller leads at once.

The leader is whichever caller finds no transaction of its queue under way; it runs one batch
(itself first, then those that waited, in order of arrival) and hands the lead to the first
caller still waiting. A batch that fails is run again one publish at a time, so that each
caller gets its own answer or its own error and no caller's publish fails for another's.
"""

import logging
import threading
from dataclasses import replace

from django.db import connection

from . import publishing

log = logging.getLogger(__name__)


class _Job:
    __slots__ = ("outgoing", "result", "error", "done", "lead")

    def __init__(self, outgoing):
        self.outgoing = outgoing
        self.result = self.error = None
        self.done = threading.Event()
        self.lead = False  # set with `done` when this caller is to lead the next batch


_lock = threading.Lock()
_waiting = {}  # queue id -> [_Job], in order of arrival
_busy = set()  # queue ids whose batch is being committed


def publish(queue, outgoing, publisher=None):
    """As publishing.publish(), sharing its transaction with concurrent callers.

    Inside a transaction of the caller's own, publishing.publish() runs in it, alone: the
    message must exist if and only if the caller's transaction commits.
    """
    if connection.in_atomic_block or not outgoing:
        return publishing.publish(queue, outgoing, publisher=publisher)
    if publisher is not None:
        outgoing = [o if o.publisher is not None else replace(o, publisher=publisher) for o in outgoing]
    job = _Job(outgoing)
    with _lock:
        _waiting.setdefault(queue.pk, []).append(job)
        lead = queue.pk not in _busy
        _busy.add(queue.pk)
    if not lead:
        job.done.wait()
        lead = job.lead
    if lead:
        _lead(queue)
    if job.error is not None:
        raise job.error
    return job.result


def _lead(queue):
    with _lock:
        batch = _take(_waiting[queue.pk])
    try:
        _run(queue, batch)
    finally:
        with _lock:
            rest = _waiting[queue.pk]
            if rest:
                rest[0].lead = True
                rest[0].done.set()
            else:
                del _waiting[queue.pk]
                _busy.discard(queue.pk)
        for job in batch:
            job.done.set()


def _take(waiting):
    """The oldest jobs, together at most MAX_BATCH messages (always at least one job)."""
    count, total = 0, 0
    for job in waiting:
        if count and total + len(job.outgoing) > publishing.MAX_BATCH:
            break
        count, total = count + 1, total + len(job.outgoing)
    batch = waiting[:count]
    del waiting[:count]
    return batch


def _run(queue, batch):
    if len(batch) > 1:
        try:
            answers = publishing.publish(queue, [o for job in batch for o in job.outgoing])
        except Exception:  # one at a time below, so that each caller gets its own answer or error
            log.info("%s publishes to %s failed together; each again alone", len(batch), queue, exc_info=True)
        else:
            start = 0
            for job in batch:
                job.result = answers[start : start + len(job.outgoing)]
                start += len(job.outgoing)
            return
    for job in batch:
        try:
            job.result = publishing.publish(queue, job.outgoing)
        except Exception as exc:  # the caller's thread raises it
            job.error = exc
