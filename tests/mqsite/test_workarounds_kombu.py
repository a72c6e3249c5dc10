"""The embedded mode's job folder: a worker reading while a server writes sees whole jobs only
(mqsite/workarounds/kombu_files.py). With kombu's own transport this loop reads most jobs
empty or cut, and the worker dies on the first one."""

import threading

from kombu import Connection
from kombu.transport import filesystem

from mqsite.workarounds.kombu_files import Transport

JOBS = 100


def test_a_reader_racing_the_writer_gets_every_job_whole(tmp_path):
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "control_folder": str(tmp_path),
        "store_processed": False,
    }
    writer = Connection("filesystem://", transport=Transport, transport_options=options).channel()
    reader = Connection("filesystem://", transport=Transport, transport_options=options).channel()
    body = "x" * 1_000_000  # big enough that a write takes a while

    def write():
        for n in range(JOBS):
            writer._put("jobs", {"n": n, "body": body})

    thread = threading.Thread(target=write)
    thread.start()
    seen = []
    while len(seen) < JOBS:
        try:
            job = reader._get("jobs")  # raises ValueError on an empty or cut job
        except filesystem.Empty:
            continue
        assert job["body"] == body
        seen.append(job["n"])
    thread.join()
    assert sorted(seen) == list(range(JOBS))
    assert list(tmp_path.iterdir()) == []  # no partial file left behind
