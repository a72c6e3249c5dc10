"""A started server process has frozen its start-up heap (mqsite.heap), so a full garbage
collection no longer walks it and stalls the process's event loop for 100 ms: a real Daphne and
a real webhook worker, as `make run` starts it, each say how many objects the collector froze,
read from the collector in that process."""

import re

import pytest

from tests.support.servers import eventually, start_as_make_run, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)

FROZEN = re.compile(r"start-up heap frozen: (\d+) objects")
# Django, DRF, the admin, pyarrow and numpy alone are far more than this: a freeze made before
# the apps were imported, or of an empty heap, would not reach it.
AT_LEAST = 20_000


def frozen_count(read_log):
    found = []
    eventually(lambda: found.extend(FROZEN.findall(read_log())) or found, timeout=30)
    return [int(n) for n in found]


def test_a_started_daphne_has_frozen_its_start_up_heap():
    server = start_daphne()
    try:
        counts = frozen_count(lambda: open(server.log.name, errors="replace").read())
    finally:
        server.stop()
    assert len(counts) == 1 and counts[0] >= AT_LEAST, counts  # once, after start-up


def test_a_started_webhook_worker_has_frozen_its_start_up_heap(tmp_path):
    worker = start_as_make_run("worker", {"MQ_CELERY_DIR": str(tmp_path)})
    try:
        counts = frozen_count(worker.output)
    finally:
        worker.stop()
    assert len(counts) == 1 and counts[0] >= AT_LEAST, (counts, worker.output()[-2000:])
