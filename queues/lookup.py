"""Finding a queue by its name, from rows kept in the process (mqsite.rows): every API call and
frame names its queue, so the lookup is asked far more often than a queue changes."""

from mqsite import adb, rows
from mqsite.names import BadName, clean_name

from .models import SYSTEM_QUEUE, Queue

# Queues by name, forgotten in every process at any change of a queue (delivery.revocation).
_by_name = rows.Cached(Queue, "name = %s")


def find_queue(name):
    """The queue of that name (any case), or None. Names that are not valid find nothing.
    Its last_seq is not current (publish takes the next seq in the database). The server's own
    queue (SYSTEM_QUEUE) is always found: made here when first named (system_queue())."""
    try:
        name = clean_name(name, "queue")
    except BadName:
        return None
    found = _by_name.first(name)
    if found is None and name == SYSTEM_QUEUE:
        return system_queue()
    return found


@adb.twin(find_queue)
async def afind_queue(name):
    """find_queue() from the event loop."""
    try:
        name = clean_name(name, "queue")
    except BadName:
        return None
    found = await _by_name.afirst(name)
    if found is None and name == SYSTEM_QUEUE:
        return await adb.thread(system_queue)()
    return found


def system_queue():
    """The queue the server publishes its operational events to (delivery.operational), made
    by the server on first use: when first named (a subscribe, a right granted to it, a
    refused publish) or when it first has an event to publish. Made then rather than by a
    migration, so that an install that never uses it has no queue it did not make."""
    queue = _by_name.first(SYSTEM_QUEUE)
    if queue is None:
        queue, created = Queue.objects.get_or_create(name=SYSTEM_QUEUE)
        if created:
            forget_queues()
    return queue


def forget_queues():
    """A queue was made, changed or deleted (here or in another process): look names up again."""
    _by_name.forget()
