"""Publishing n messages in the test's own process, as a publisher's batch: message i of the
batch carries the payload {"n": start + i}, so that a test can tell them apart and read their
order back. `apublish` is the same from an async test (Channels' database_sync_to_async)."""

from channels.db import database_sync_to_async

from delivery import publishing


def publish(queue, n=1, event="create", start=0, publisher=None):
    batch = [publishing.prepare(event, {"n": start + i}) for i in range(n)]
    return publishing.publish(queue, batch, publisher)


apublish = database_sync_to_async(publish)
