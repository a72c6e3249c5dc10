"""The Parquet layout shared by the archive and the recent-rows snapshot (docs/analytics.md,
"The archive's layout").

    <root>/messages/queue=<q>/day=<YYYY-MM-DD>/part-<first id>-<last id>.parquet
    <root>/deliveries/queue=<q>/day=<YYYY-MM-DD>/part-<first id>-<last id>.parquet

The snapshot of the hot tables (analytics.extract) is smaller and plain: only the columns the
analytics job reads, the queue a column rather than a folder (HOT_*_SCHEMA below):

    <root>/messages/part-0.parquet
    <root>/deliveries/part-0.parquet

Hive partitioning, so Spark, DuckDB and pandas read it as it is. A delivery lives in its
message's day (the fan-out makes them in the same instant; a replay or a seek may make one
days later, and it still goes with its message), and both files of a batch
are named after the first and last message id of the batch (the archive's journaled ids, the
same name in every day the batch touches): writing the same batch again overwrites its files
instead of adding copies beside them. A compacted partition holds one file, named after the
first and last message id in it (analytics.compaction).

Written with pyarrow, not Spark: the archive runs inside a Celery task and a manage.py command
and must not need a JVM. A local root gets each file written under a temporary name, fsynced,
then renamed into place (and the folder fsynced), so a reader or a crash never sees half a
file; another filesystem pyarrow knows (s3://, gs://, hdfs://) gets the file written whole
under a temporary name and then moved.
"""

import os
import shutil
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs

TIMESTAMP = pa.timestamp("us", tz="UTC")

MESSAGE_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("event", pa.string()),
        ("seq", pa.int64()),
        ("created_at", TIMESTAMP),
        ("payload", pa.string()),  # the JSON text as published
        ("key", pa.string()),
        ("publisher", pa.string()),  # subscriber name; null when an operator published it
        ("headers", pa.string()),  # the headers' JSON text as published; null when none
    ]
)

DELIVERY_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("message_id", pa.int64()),
        ("event", pa.string()),
        ("subscriber", pa.string()),
        ("seq", pa.int64()),
        ("status", pa.string()),
        ("attempts", pa.int64()),
        # When it was made: the publish (the fan-out makes it with the message), or later by a
        # replay or a seek; filed under its message's day all the same (write_history).
        ("created_at", TIMESTAMP),
        ("delivered_at", TIMESTAMP),
        ("acked_at", TIMESTAMP),
        ("last_error", pa.string()),
    ]
)

# The snapshot's columns: those of the archive's schemas that the analytics job reads, under
# the same names and types, and the queue, which the archive keeps in its folder names.
QUEUE_FIELD = pa.field("queue", pa.string())


def _hot_schema(archive_schema, names):
    return pa.schema([QUEUE_FIELD if name == "queue" else archive_schema.field(name) for name in names])


HOT_MESSAGE_SCHEMA = _hot_schema(MESSAGE_SCHEMA, ["id", "queue", "event", "created_at"])
HOT_DELIVERY_SCHEMA = _hot_schema(
    DELIVERY_SCHEMA,
    ["id", "message_id", "queue", "event", "subscriber", "status", "attempts", "created_at", "acked_at"],
)

# The day a row is filed under (its partition's, YYYY-MM-DD, UTC): a message's own, and a
# delivery its message's, even when made days later by a replay or a seek. The analytics tag
# their hour rows with it (partition_days below gives the hot rows theirs).
DAY_FIELD = pa.field("day", pa.string())

MESSAGES = "messages"
DELIVERIES = "deliveries"

# The archive files' format, in each file's Parquet key-value metadata under VERSION_KEY: raised
# when a column changes meaning or type, so that this code refuses a file written by a newer
# release (UnknownSchemaVersion) rather than misreading it. A file without the key predates it
# and is version 1, the layout above.
SCHEMA_VERSION = 1
VERSION_KEY = b"mq.archive.schema_version"


class UnknownSchemaVersion(ValueError):
    """An archive file of a format this release does not know (a newer release wrote it)."""


def stamped(table):
    """The table with this release's SCHEMA_VERSION in its metadata (what the file will carry)."""
    return table.replace_schema_metadata(
        {**(table.schema.metadata or {}), VERSION_KEY: str(SCHEMA_VERSION).encode()}
    )


def check_version(metadata, path):
    """Raise UnknownSchemaVersion unless this Parquet metadata (a schema's) is of a version this
    release reads: SCHEMA_VERSION or older."""
    raw = (metadata or {}).get(VERSION_KEY)
    try:
        version = 1 if raw is None else int(raw)
    except ValueError:
        raise UnknownSchemaVersion(f"{path}: unreadable archive schema version {raw!r}") from None
    if version > SCHEMA_VERSION:
        raise UnknownSchemaVersion(
            f"{path}: archive schema version {version}, newer than this release's {SCHEMA_VERSION}; "
            "upgrade before reading this archive"
        )
    return version


def check_files(root, paths):
    """check_version of each of these files (paths as partitions.Partition lists them, under
    `root`): a read of each footer, never of its rows. Several at once: each is an open and a
    small read, which waits on the disk or the network (measured on 2,880 hourly files of 1 M
    deliveries, 2 vCPUs under load, files in the page cache: 0.42 s one after another, 0.29 s
    in 8 threads; the first read from disk, 1.6 s one after another). Only what a run hands to
    Spark is checked: after the first run, the partitions that changed."""
    fs, base = filesystem(root)
    prefix = str(root).rstrip("/")

    def check(path):
        check_version(pq.read_schema(base + path[len(prefix) :], filesystem=fs).metadata, path)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in pool.map(check, paths):  # the first refusal is raised here
            pass


def filesystem(root):
    """(pyarrow filesystem, path within it) for a local path or a URI.

    Spark's s3a:// is pyarrow's s3://; a plain path is made absolute.
    """
    root = str(root)
    if "://" not in root:
        return pafs.LocalFileSystem(), os.path.abspath(root)
    if root.startswith("s3a://"):
        root = "s3://" + root[len("s3a://") :]
    return pafs.FileSystem.from_uri(root)


def day_of(ts):
    return ts.astimezone(UTC).strftime("%Y-%m-%d")


def utc_days(timestamps):
    """The UTC day ("YYYY-MM-DD", strings) of each of these timestamps (an Arrow column). The
    few distinct days formatted, not every row: pc.strftime took 0.65 s for a million rows,
    most of a rerun's time beside big hot tables."""
    if isinstance(timestamps, pa.ChunkedArray):
        timestamps = timestamps.combine_chunks()
    naive = pc.cast(timestamps, pa.timestamp("us"))  # the UTC instant, whatever zone it names
    days = pc.dictionary_encode(pc.cast(naive, pa.date32()))
    named = pa.DictionaryArray.from_arrays(days.indices, pc.cast(days.dictionary, pa.string()))
    return named.cast(pa.string())


def partition_days(messages, deliveries):
    """(messages, deliveries), Arrow tables with `id`, `created_at` and `message_id`, each with
    a DAY_FIELD column: the day write_history() files the row under. A delivery whose message
    is not among `messages` keeps its own day (the snapshot holds every delivery's message:
    this is only a guard)."""
    message_days = utc_days(messages["created_at"])
    found = pc.index_in(deliveries["message_id"], value_set=messages["id"])
    delivery_days = pc.take(message_days, found)
    if delivery_days.null_count:
        delivery_days = pc.coalesce(delivery_days, utc_days(deliveries["created_at"]))
    return (
        messages.append_column(DAY_FIELD, message_days),
        deliveries.append_column(DAY_FIELD, delivery_days),
    )


def part_name(first_id, last_id):
    """A data file's name: zero-padded, so names sort as their ids do."""
    return f"part-{first_id:012d}-{last_id:012d}.parquet"


def partition(base, kind, queue, day):
    return f"{base}/{kind}/queue={queue}/day={day}"


def write_history(root, queue, messages, deliveries, *, durable=True, name=None):
    """Write one batch of a queue's history; returns the paths written.

    `messages` are tuples in MESSAGE_SCHEMA's order, `deliveries` tuples in DELIVERY_SCHEMA's
    order whose message is among `messages`. One file of each kind per day, all named `name`
    (default: after the first and last message id of each day). With `durable`, every file
    is on disk before this returns (what the archive needs before it deletes).
    """
    fs, base = filesystem(root)
    day_by_message = {}
    messages_by_day = defaultdict(list)
    for row in messages:
        day = day_of(row[3])
        day_by_message[row[0]] = day
        messages_by_day[day].append(row)
    deliveries_by_day = defaultdict(list)
    for row in deliveries:
        deliveries_by_day[day_by_message[row[1]]].append(row)

    written = []
    for day, rows in sorted(messages_by_day.items()):
        ids = [r[0] for r in rows]
        file_name = name or part_name(min(ids), max(ids))
        for kind, schema, kind_rows in (
            (MESSAGES, MESSAGE_SCHEMA, rows),
            (DELIVERIES, DELIVERY_SCHEMA, deliveries_by_day.get(day, [])),
        ):
            if not kind_rows:
                continue
            folder = partition(base, kind, queue, day)
            write_file(fs, folder, file_name, _table(schema, kind_rows), durable)
            written.append(f"{folder}/{file_name}")
    return written


def write_table(root, folder, name, table, *, durable=True):
    """Write one Parquet file `<root>/<folder>/<name>` whole (a reader or a crash never sees
    half of it); returns its path. With `durable`, it is on disk before this returns."""
    fs, base = filesystem(root)
    path = f"{base}/{folder}"
    write_file(fs, path, name, table, durable)
    return f"{path}/{name}"


def _table(schema, rows):
    columns = list(zip(*rows, strict=True))
    return stamped(
        pa.Table.from_arrays(
            [pa.array(col, type=field.type) for col, field in zip(columns, schema, strict=True)],
            schema=schema,
        )
    )


def read_file(fs, path, columns=None, read_dictionary=None):
    """One Parquet file's table (these columns; `read_dictionary`: string columns kept
    dictionary-encoded). By the file reader, not pq.read_table: that goes through
    pyarrow.dataset, whose import imports pandas, a quarter of a CPU second of every
    analysis's start for nothing it uses."""
    with fs.open_input_file(path) as source:
        return pq.ParquetFile(source, read_dictionary=read_dictionary).read(columns=columns)


def write_file(fs, folder, name, table, durable):
    """Write one Parquet file whole: a reader or a crash sees all of it or none."""
    write_whole(fs, folder, name, lambda out: pq.write_table(table, out), durable)


def write_run_file(folder, name, table):
    """Write one Parquet file of a run's folder (local path or URI) whole and durable: once
    CURRENT names the run (after a crash too), its files are whole on disk."""
    fs, base = filesystem(folder)
    write_file(fs, base, name, table, durable=True)


def write_whole(fs, folder, name, write, durable):
    """Write the file `name` in `folder` with write(stream), whole: a reader or a crash sees all
    of it or none (the old file, if there was one). With `durable`, on disk when this returns."""
    # A temporary name that no reader takes for data: dot-files are hidden from Spark, and it
    # does not end in .parquet for DuckDB's and pandas' globs.
    tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
    final = f"{folder}/{name}"
    if isinstance(fs, pafs.LocalFileSystem):
        make_dirs_durable(folder)
        try:
            with open(tmp, "wb") as f:
                write(f)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            _remove_quietly(tmp)
            raise
        if durable:
            fsync_dir(folder)
        return
    # Object stores have no rename, but a move of one object replaces it whole.
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(tmp) as out:
        write(out)
    fs.move(tmp, final)


def share_file(src, folder, name):
    """Put the file `src` (local or URI) into `folder` as `name`, whole and durable, without
    rewriting it: a hard link on a local disk (a run's unchanged hour rows are tens of MB that
    the next run would otherwise write and fsync again), a server-side copy on an object store,
    a plain copy where links are refused (another file system)."""
    fs, base = filesystem(folder)
    _, source = filesystem(src)
    if isinstance(fs, pafs.LocalFileSystem):
        make_dirs_durable(base)
        final = f"{base}/{name}"
        try:
            os.link(source, final)
        except OSError:
            with open(source, "rb") as f:
                write_whole(fs, base, name, lambda out: shutil.copyfileobj(f, out), durable=True)
            return
        fsync_dir(base)
        return
    fs.copy_file(source, f"{base}/{name}")


def make_dirs_durable(folder):
    """makedirs, fsyncing the parent of each folder it makes: a new file's name is durable
    only when every folder above it is."""
    missing = []
    path = folder
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        os.makedirs(path, exist_ok=True)
        fsync_dir(os.path.dirname(path))


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_file(fs, path):
    """Delete a file (local or URI) if it exists; with a local one, durably."""
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return False
    fs.delete_file(path)
    if isinstance(fs, pafs.LocalFileSystem):
        fsync_dir(os.path.dirname(path))
    return True


def remove_tree(root):
    """Delete a folder (local or URI) and everything in it, if it exists."""
    fs, base = filesystem(root)
    if fs.get_file_info(base).type != pafs.FileType.NotFound:
        fs.delete_dir(base)
