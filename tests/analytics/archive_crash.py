"""What the archive's crash tests share: its files as a reader lists them, and an archive run
that dies after a given batch's Parquet write, before its delete."""

import os

from analytics import archive


def files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)


def crash_on_batch(monkeypatch, n):
    """Make the archive die after the n-th batch's Parquet write, before its delete."""
    real_delete = archive.delete_archived
    calls = []

    def delete(message_ids, delivery_ids):
        calls.append(message_ids)
        if len(calls) == n:
            raise RuntimeError("killed after the Parquet write, before the delete")
        return real_delete(message_ids, delivery_ids)

    monkeypatch.setattr(archive, "delete_archived", delete)
    return lambda: monkeypatch.setattr(archive, "delete_archived", real_delete)
