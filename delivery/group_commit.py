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

import asyncio
import logging
import threading
import weakref
from dataclasses import replace

from django.db import connection

from mqsite import adb

from . import publishing, spans

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


@spans.published("rest")
def publish(queue, outgoing, publisher=None, checked=False):
    """As publishing.publish(), sharing its transaction with concurrent callers. The payloads
    are checked against their schemas before they join the others (unless `checked`): a
    caller's SchemaMismatch is its own, and fails nobody else's publish.

    Inside a transaction of the caller's own, publishing.publish() runs in it, alone: the
    message must exist if and only if the caller's transaction commits.
    """
    if connection.in_atomic_block or not outgoing:
        return publishing.publish(queue, outgoing, publisher=publisher, checked=checked)
    if not checked:
        publishing.check_schemas(queue, outgoing)
    if publisher is not None:
        outgoing = [o if o.publisher is not None else replace(o, publisher=publisher) for o in outgoing]
    job = _Job(outgoing)
    with _lock:
        _waiting.setdefault(queue.pk, []).append(job)
        lead = queue.pk not in _busy
        _busy.add(queue.pk)
    if not lead:
        _give_back_connection()
        job.done.wait()
        lead = job.lead
    if lead:
        _lead(queue)
    if job.error is not None:
        raise job.error
    return job.result


def _give_back_connection():
    """A caller that waits for the leader holds no pooled connection meanwhile: the leader may
    need the pool's last one (a socket's publish comes in a thread that has none yet, its
    schemas checked on the event loop), and with every other connection held by callers
    waiting for it, it waited out the pool's timeout and failed them all (seen with a web
    process's sync pool of 3 to 7, and of 20 under more load). A SQLite connection stays: there
    is no pool, and opening one costs more than most queries."""
    if connection.settings_dict.get("OPTIONS", {}).get("pool") and connection.connection is not None:
        connection.close()  # back to the pool; taken again if this caller leads or queries


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
            answers = publishing.publish(queue, [o for job in batch for o in job.outgoing], checked=True)
        except Exception:  # one at a time below, so that each caller gets its own answer or error
            _failed_together(queue, batch)
        else:
            return _share(batch, answers)
    for job in batch:
        try:
            job.result = publishing.publish(queue, job.outgoing, checked=True)
        except Exception as exc:  # the caller's thread raises it
            job.error = exc


def _failed_together(queue, batch):
    log.info("%s publishes to %s failed together; each again alone", len(batch), queue, exc_info=True)


def _share(batch, answers):
    start = 0
    for job in batch:
        job.result = answers[start : start + len(job.outgoing)]
        start += len(job.outgoing)


# --- the same on the event loop ---------------------------------------------------------------
#
# The socket's publishes (publishing.apublish(), on the async connection) batch the same way,
# among the publishers of one event loop: the first caller starts a task that commits a batch
# at a time for as long as callers keep arriving; each caller awaits its own answer. A task
# rather than the first caller itself leading, so that a caller that goes away (its socket
# closed) does not take the others' batch with it. (The event loop's publishers and the
# threads' still serialise on the queue's row lock, in two groups.)


class _Waiter:
    __slots__ = ("outgoing", "result", "error", "future")

    def __init__(self, outgoing, future):
        self.outgoing, self.future = outgoing, future
        self.result = self.error = None


_loops = weakref.WeakKeyDictionary()  # event loop -> {queue id: [_Waiter], in order of arrival}
_draining = set()  # the batching tasks (referenced, or they could be collected while running)


@spans.apublished("socket")
@adb.twin(publish)
async def apublish(queue, outgoing, publisher=None, checked=False):
    """publish() from the event loop: publishing.apublish() in batches, each answer after the
    commit that holds it. In the embedded mode, publish() in a thread (it shares its
    transaction with the requests' publishes)."""
    if not outgoing:
        return []
    if not checked:
        await publishing.acheck_schemas(queue, outgoing)
    if publisher is not None:
        outgoing = [o if o.publisher is not None else replace(o, publisher=publisher) for o in outgoing]
    loop = asyncio.get_running_loop()
    waiting = _loops.setdefault(loop, {})
    waiter = _Waiter(outgoing, loop.create_future())
    if queue.pk not in waiting:
        waiting[queue.pk] = []
        task = loop.create_task(_drain(queue, waiting))
        _draining.add(task)
        task.add_done_callback(_draining.discard)
    waiting[queue.pk].append(waiter)
    return await waiter.future


async def _drain(queue, waiting):
    waiters = waiting[queue.pk]
    batch = []
    try:
        while waiters:
            batch = _take(waiters)
            await _arun(queue, batch)
            _answer(batch)
    finally:
        del waiting[queue.pk]
        for waiter in batch + waiters:  # only when this task itself was cancelled (the loop ends)
            if not waiter.future.done():
                waiter.future.cancel()


async def _arun(queue, batch):
    if len(batch) > 1:
        try:
            answers = await publishing.apublish(
                queue, [o for waiter in batch for o in waiter.outgoing], checked=True
            )
        except Exception:
            _failed_together(queue, batch)
        else:
            return _share(batch, answers)
    for waiter in batch:
        try:
            waiter.result = await publishing.apublish(queue, waiter.outgoing, checked=True)
        except Exception as exc:  # the caller raises it
            waiter.error = exc


def _answer(batch):
    for waiter in batch:
        if waiter.future.done():  # its caller went away
            continue
        if waiter.error is not None:
            waiter.future.set_exception(waiter.error)
        else:
            waiter.future.set_result(waiter.result)
