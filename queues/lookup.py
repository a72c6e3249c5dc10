"""Finding a queue by its name, from rows kept in the process (mqsite.rows): every API call and
frame names its queue, so the lookup is asked far more often than a queue changes."""

from mqsite import adb, rows
from mqsite.names import BadName, clean_name

from .models import Queue

# Queues by name, forgotten in every process at any change of a queue (delivery.revocation).
_by_name = rows.Cached(Queue, "name = %s")


def find_queue(name):
    """The queue of that name (any case), or None. Names that are not valid find nothing.
    Its last_seq is not current (publish takes the next seq in the database)."""
    try:
        return _by_name.first(clean_name(name, "queue"))
    except BadName:
        return None


@adb.twin(find_queue)
async def afind_queue(name):
    """find_queue() from the event loop."""
    try:
        return await _by_name.afirst(clean_name(name, "queue"))
    except BadName:
        return None


def forget_queues():
    """A queue was made, changed or deleted (here or in another process): look names up again."""
    _by_name.forget()
