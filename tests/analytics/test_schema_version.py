"""The archive files' schema version (analytics.layout.SCHEMA_VERSION): written into every
file's Parquet metadata, by the archive and by compaction, and checked by whatever reads the
files: a file of a newer version is refused with an error that says so, never misread."""

import pyarrow.parquet as pq
import pytest

from analytics import analysis, compaction, layout, partitions
from tests.analytics import history


@pytest.fixture
def archive_root(tmp_path):
    h = history.generate()
    snapshot = history.write(h, tmp_path / "archive")
    return tmp_path / "archive", snapshot


def data_files(root):
    return sorted(p for p in root.rglob("*.parquet"))


def rewrite_as_version(path, version):
    """The file as a release writing `version` would leave it: same rows, that version."""
    table = pq.read_table(path)
    metadata = {**(table.schema.metadata or {}), layout.VERSION_KEY: str(version).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), path)


def test_every_archived_file_carries_the_schema_version(archive_root):
    root, _ = archive_root
    found = data_files(root)
    assert found
    for path in found:
        assert pq.read_schema(path).metadata[layout.VERSION_KEY] == str(layout.SCHEMA_VERSION).encode()


def test_a_file_without_a_version_is_read_as_version_1():
    # Files archived before the version was written carry no key: the layout they follow is 1's.
    assert layout.check_version(None, "old.parquet") == 1
    assert layout.check_version({b"other": b"x"}, "old.parquet") == 1


def test_a_newer_file_is_refused_by_the_in_process_reader(archive_root):
    root, _ = archive_root
    newer = data_files(root / layout.DELIVERIES)[0]
    rewrite_as_version(newer, layout.SCHEMA_VERSION + 1)
    listing = partitions.list_archive(root)
    (chosen,) = [p for p in listing.values() if any(path.endswith(newer.name) for _, path in p.files)]
    with pytest.raises(layout.UnknownSchemaVersion, match="newer than this release's"):
        partitions.read_rows(root, chosen, layout.DELIVERIES)


def test_an_analysis_refuses_a_newer_file_before_spark_reads_it(archive_root, tmp_path, settings):
    # A run that sends the partitions to Spark (here all of them: nothing is reduced in process)
    # would have it read the file by its own schema: refused before any JVM starts (the test has
    # no Spark fixture; a start would take seconds, not fail).
    settings.MQ_ANALYTICS_LOCAL_BYTES = 0
    root, snapshot = archive_root
    rewrite_as_version(data_files(root / layout.MESSAGES)[-1], layout.SCHEMA_VERSION + 1)
    with pytest.raises(layout.UnknownSchemaVersion, match=r"archive schema version 2, newer"):
        analysis.compute(str(root), str(tmp_path / "out"), snapshot, now=history.NOW)


def test_an_analysis_in_process_refuses_a_newer_file(archive_root, tmp_path):
    # A small archive's first run is reduced in this process (MQ_ANALYTICS_LOCAL_BYTES), whose
    # reader checks each file it opens.
    root, snapshot = archive_root
    rewrite_as_version(data_files(root / layout.DELIVERIES)[-1], layout.SCHEMA_VERSION + 1)
    with pytest.raises(layout.UnknownSchemaVersion, match=r"archive schema version 2, newer"):
        analysis.compute(str(root), str(tmp_path / "out"), snapshot, now=history.NOW)


def test_an_unreadable_version_is_refused(archive_root):
    root, _ = archive_root
    path = data_files(root)[0]
    rewrite_as_version(path, "two")
    with pytest.raises(layout.UnknownSchemaVersion, match="unreadable archive schema version"):
        layout.check_files(root, [str(path)])


def test_compaction_stamps_its_file_and_leaves_a_newer_partition_alone(archive_root):
    root, _ = archive_root
    parts = {}
    for path in data_files(root):
        parts.setdefault(path.parent, []).append(path)
    folder, names = next((f, n) for f, n in sorted(parts.items()) if len(n) > 1)
    kind = folder.parent.parent.name
    queue = folder.parent.name[len("queue=") :]
    day = folder.name[len("day=") :]
    fs, base = layout.filesystem(root)

    # A partition of this release's files becomes one file, of this release's version
    assert compaction.compact_partition(fs, base, kind, queue, day, [p.name for p in names])
    (merged,) = folder.glob("*.parquet")
    assert pq.read_schema(merged).metadata[layout.VERSION_KEY] == str(layout.SCHEMA_VERSION).encode()

    # A partition holding a newer release's file is refused, its files untouched
    other, other_names = next((f, n) for f, n in sorted(parts.items()) if len(n) > 1 and f != folder)
    rewrite_as_version(other_names[0], layout.SCHEMA_VERSION + 1)
    before = sorted(p.name for p in other.glob("*.parquet"))
    with pytest.raises(layout.UnknownSchemaVersion):
        compaction.compact_partition(
            fs,
            base,
            other.parent.parent.name,
            other.parent.name[len("queue=") :],
            other.name[len("day=") :],
            [p.name for p in other_names],
        )
    assert sorted(p.name for p in other.glob("*.parquet")) == before
