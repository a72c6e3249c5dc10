"""The one overlap between the archive and the hot tables' snapshot, removed from the snapshot:
the archive's copy wins.

A message is in both when a crash came between the archive's write and its delete (the next
archive run finishes that batch, analytics.archive's journal), or when it was archived after
the snapshot read it. Its copy in the snapshot may be older (a delivery still pending there,
acked in the archive), so the snapshot's copy goes, with all its deliveries: the archive always
holds a message together with all of its deliveries.

Only the archive's (queue, day) partitions that the snapshot's messages fall in are read, and
of them only the ids within the snapshot's range: in proportion to the hot tables, not to the
archive. It is a hash anti-join on this side, against the few archived ids it finds, instead
of the global dedupe of every row the job did before.
"""

import dataclasses

import pyarrow as pa
import pyarrow.compute as pc

from . import layout


def drop_archived(snapshot, listing):
    """(snapshot without the messages the archive holds, how many were dropped).

    `listing` is analytics.partitions.list_archive() of the archive, taken under its lock; the
    snapshot's rows have their archive day (layout.partition_days).
    """
    messages = snapshot.messages
    if not messages.num_rows or not listing:
        return snapshot, 0
    spans = (
        messages.group_by(["queue", layout.DAY_FIELD.name], use_threads=False)
        .aggregate([("id", "min"), ("id", "max")])
        .to_pylist()
    )
    archived = [
        _archived_ids(listing[(s["queue"], s["day"])], s["id_min"], s["id_max"])
        for s in spans
        if (s["queue"], s["day"]) in listing
    ]
    archived = pa.chunked_array(archived, pa.int64()) if archived else pa.chunked_array([], pa.int64())
    if not len(archived):
        return snapshot, 0
    kept_messages = messages.filter(pc.invert(pc.is_in(messages["id"], value_set=archived)))
    deliveries = snapshot.deliveries
    kept_deliveries = deliveries.filter(pc.invert(pc.is_in(deliveries["message_id"], value_set=archived)))
    dropped = messages.num_rows - kept_messages.num_rows
    return dataclasses.replace(snapshot, messages=kept_messages, deliveries=kept_deliveries), dropped


def _archived_ids(partition, low, high):
    """The ids in `partition`'s message files between low and high (the id column alone is
    read: a day's is a few hundred kilobytes)."""
    paths = partition.paths(layout.MESSAGES)
    if not paths:
        return pa.array([], pa.int64())
    fs, _ = layout.filesystem(paths[0])
    ids = pa.concat_arrays(
        [layout.read_file(fs, layout.filesystem(p)[1], columns=["id"])["id"].combine_chunks() for p in paths]
    )
    return ids.filter(pc.and_(pc.greater_equal(ids, low), pc.less_equal(ids, high)))
