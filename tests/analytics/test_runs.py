"""analytics.runs: run ids, the CURRENT pointer, and pruning old run folders, on a local folder
and on a pyarrow filesystem that is not local (where there is no rename)."""

import os
from datetime import UTC, datetime, timedelta

import pytest
from pyarrow import fs as pafs

from analytics import layout, runs
from tests.support.run_folders import write_run


@pytest.fixture(params=["local", "uri"])
def out(request, tmp_path, monkeypatch):
    if request.param == "local":
        return str(tmp_path / "_analytics")
    # An object-store-like filesystem: pyarrow's in-memory mock, one for the whole test.
    mock, _ = pafs.FileSystem.from_uri("mock:///")
    real = layout.filesystem

    def filesystem(root):
        if root.startswith("mock://"):
            return mock, root[len("mock://") :]
        return real(root)

    monkeypatch.setattr(layout, "filesystem", filesystem)
    return "mock://bucket/_analytics"


def test_it_makes_run_ids_that_sort_as_their_start_times():
    t = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    ids = [runs.new_run_id(t + timedelta(microseconds=i)) for i in (0, 1, 999_999, 10**6)]
    assert ids == sorted(ids) and len(set(ids)) == 4
    assert all(runs.RUN_ID_RE.match(i) for i in ids)
    assert runs.new_run_id(t) != runs.new_run_id(t)  # two hosts in one instant


def test_it_refuses_what_is_not_a_run_id(out):
    for bad in ("../etc", "x", "", None, "20261125T120000000000Z-abc/../x"):
        with pytest.raises(runs.BadRun):
            runs.run_path(out, bad)


def test_it_switches_to_a_finished_run_and_reads_its_manifest(out):
    # Given no run yet
    assert runs.current(out) is None
    # When a run is written and switched to
    first = write_run(out, manifest={"duration_s": 7.0})
    # Then it is current, with its manifest
    assert runs.current(out) == first
    assert runs.read_manifest(out, first)["duration_s"] == 7.0
    # ... and a newer one replaces it
    second = write_run(out)
    assert runs.current(out) == second and second > first


def test_it_refuses_to_switch_to_an_unfinished_run(out):
    done = write_run(out)
    unfinished = write_run(out, finished=False)
    with pytest.raises(runs.BadRun):
        runs.switch(out, unfinished)
    assert runs.current(out) == done


def test_it_leaves_no_temporary_file_beside_current(tmp_path):
    out = str(tmp_path / "_analytics")
    for _ in range(3):
        write_run(out)
    assert sorted(os.listdir(out)) == ["CURRENT", "runs"]


def test_prune_keeps_the_newest_runs_up_to_the_current_and_any_newer(out):
    # Given five finished runs, the fourth current, and a fifth still writing
    ids = [write_run(out, switch=False) for _ in range(4)]
    runs.switch(out, ids[3])
    writing = write_run(out, finished=False)
    # When
    deleted = runs.prune(out, keep=2)
    # Then the two oldest are gone; the current, the one before it and the one writing stay
    assert deleted == ids[:2]
    assert runs.run_ids(out) == [ids[2], ids[3], writing]
    assert runs.read_manifest(out, ids[2])["run_id"] == ids[2]
    # ... and pruning again deletes nothing more
    assert runs.prune(out, keep=2) == []


def test_prune_before_any_switch_deletes_nothing(out):
    write_run(out, switch=False)
    write_run(out, finished=False)
    assert runs.prune(out, keep=1) == [] and len(runs.run_ids(out)) == 2
