"""The archive's partitions as they are on storage: one (queue, day) with its files of both
kinds, and a fingerprint that changes whenever one of them does.

A run keeps the hour rows of every partition whose fingerprint it has seen (analytics.analysis)
and recomputes the others: a batch archived into an old day, a compaction, or a file removed by
hand each change the fingerprint of exactly the partitions they touch. Listing is one recursive
walk of the archive's folders (no file is opened), in proportion to its files.
"""

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyarrow import fs as pafs

from . import layout

KINDS = (layout.MESSAGES, layout.DELIVERIES)


@dataclass(frozen=True)
class Partition:
    queue: str
    day: str
    files: tuple  # (kind, path) of every data file, sorted
    fingerprint: str
    bytes: int

    def paths(self, kind):
        return [path for k, path in self.files if k == kind]


def list_archive(root):
    """{(queue, day): Partition} of the archive under `root` (local path or URI)."""
    fs, base = layout.filesystem(root)
    found = {}
    for kind in KINDS:
        folder = f"{base}/{kind}"
        if fs.get_file_info(folder).type == pafs.FileType.NotFound:
            continue
        for info in fs.get_file_info(pafs.FileSelector(folder, recursive=True)):
            key = _partition_of(info, folder)
            if key is not None:
                found.setdefault(key, []).append((kind, info))
    return {key: _partition(key, entries, base, root) for key, entries in found.items()}


def _partition_of(info, folder):
    """(queue, day) of a data file of the layout, or None for anything else (folders,
    temporary files, hidden staging)."""
    if info.type != pafs.FileType.File or not info.base_name.endswith(".parquet"):
        return None
    if info.base_name.startswith((".", "_")):
        return None
    parts = info.path[len(folder) + 1 :].split("/")
    if len(parts) != 3 or not parts[0].startswith("queue=") or not parts[1].startswith("day="):
        return None
    return parts[0][len("queue=") :], parts[1][len("day=") :]


def _partition(key, entries, base, root):
    entries.sort(key=lambda e: (e[0], e[1].path))
    digest = hashlib.sha256(f"{key[0]}\0{key[1]}".encode())
    for kind, info in entries:
        digest.update(f"\0{kind}\0{info.path}\0{info.size}\0{info.mtime_ns}".encode())
    # Paths as Spark reads them: under the root as the caller named it (a URI keeps its scheme).
    prefix = str(root).rstrip("/")
    files = tuple((kind, prefix + info.path[len(base) :]) for kind, info in entries)
    return Partition(key[0], key[1], files, digest.hexdigest()[:32], sum(info.size for _, info in entries))


def read_rows(root, partition, kind):
    """The rows of one partition's files of one kind, in the columns analytics.hours reduces
    (those of the hot tables' snapshot, layout.HOT_MESSAGE_SCHEMA or HOT_DELIVERY_SCHEMA, less
    the ids; the queue from the folder) and the partition's day (layout.DAY_FIELD, from the
    folder too: a delivery a replay made days later still has its message's). The strings come
    dictionary-encoded, as Parquet keeps them: a few distinct names over millions of rows, which
    hours.parts groups by their codes. Each file's schema version is checked as it is read."""
    schema = layout.HOT_MESSAGE_SCHEMA if kind == layout.MESSAGES else layout.HOT_DELIVERY_SCHEMA
    columns = [name for name in schema.names if name not in ("id", "message_id", "queue")]
    strings = [name for name in columns if schema.field(name).type == pa.string()]
    fs, base = layout.filesystem(root)
    prefix = str(root).rstrip("/")
    tables = []
    for path in partition.paths(kind):
        table = layout.read_file(fs, base + path[len(prefix) :], columns=columns, read_dictionary=strings)
        layout.check_version(table.schema.metadata, path)
        tables.append(table)
    if tables:
        table = pa.concat_tables(tables)  # the strings' dictionaries are unified where grouped
    else:
        # None of this kind (a day whose messages had no subscriber): empty columns of the types
        # a file's would have, so that it joins the other partitions of its batch.
        table = pa.table(
            {
                name: pa.array(
                    [], pa.dictionary(pa.int32(), pa.string()) if name in strings else schema.field(name).type
                )
                for name in columns
            }
        )
    # The folder's queue and day, one value each: a dictionary of one over codes all 0.
    zeros = pa.array(np.zeros(table.num_rows, dtype=np.int32))
    for field, value in ((layout.QUEUE_FIELD, partition.queue), (layout.DAY_FIELD, partition.day)):
        table = table.append_column(field.name, pa.DictionaryArray.from_arrays(zeros, pa.array([value])))
    return table
