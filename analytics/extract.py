"""Extract: the hot tables to a Parquet snapshot in the archive's layout and schema, so the
analytics job reads Parquet only (and the same code reads both).

Thin on purpose: rows in id order, a chunk at a time, written with analytics.layout. The
snapshot is not a point in time across tables; it need not be. Rows the archive removes while
this runs were written to the archive first, and the job counts each id once, so every
message and delivery is counted (once) whichever side of the move it was read on.
"""

from django.db.models import Max

from delivery.models import Delivery
from queues.models import Message, Queue

from . import layout
from .archive import DELIVERY_FIELDS, MESSAGE_FIELDS

CHUNK_MESSAGES = 20_000


def extract_recent(root, *, chunk=CHUNK_MESSAGES):
    """Write every message and delivery now in the hot tables under `root`; returns
    {"messages": n, "deliveries": n} written."""
    counts = {"messages": 0, "deliveries": 0}
    # Messages published after this are left to the next run, with their deliveries.
    top = Message.objects.aggregate(top=Max("id"))["top"] or 0
    for queue in Queue.objects.order_by("name"):
        after = 0
        while True:
            messages = list(
                Message.objects.filter(queue=queue, id__gt=after, id__lte=top)
                .order_by("id")
                .values_list(*MESSAGE_FIELDS)[:chunk]
            )
            if not messages:
                break
            first, last = messages[0][0], messages[-1][0]
            present = {m[0] for m in messages}
            deliveries = [
                d
                for d in Delivery.objects.filter(queue=queue, message_id__gte=first, message_id__lte=last)
                .order_by("id")
                .values_list(*DELIVERY_FIELDS)
                # Only deliveries of messages read above: one committed in between (ids are
                # taken before commit) is left whole to the next run.
                if d[1] in present
            ]
            layout.write_history(root, queue.name, messages, deliveries, durable=False)
            counts["messages"] += len(messages)
            counts["deliveries"] += len(deliveries)
            after = last
    return counts
