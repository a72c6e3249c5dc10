"""Beat as `make run` runs it, a program of its own beside the maintenance worker
(mqsite/supervisord.conf): its sweeps reach the worker, and the sweeps it sent while the worker
was away are dropped when the worker comes back (delivery.tasks.SWEEP_EXPIRES_SECS), not run one
after the other."""

import re
import tempfile
import time

import pytest

from delivery.tasks import SWEEP_EXPIRES_SECS
from subscribers.models import Heartbeat
from tests.support.servers import eventually, start_as_make_run

pytestmark = pytest.mark.django_db(transaction=True)

AWAY_SECS = SWEEP_EXPIRES_SECS + 3


def test_sweeps_sent_while_the_worker_was_away_are_dropped_then_it_sweeps_every_second():
    # the embedded mode's broker (files), in a folder of this test's own
    env = {"REDIS_URL": "", "MQ_CELERY_DIR": tempfile.mkdtemp(prefix="celery-")}
    beat = start_as_make_run("beat", env)
    worker = None
    try:
        time.sleep(AWAY_SECS)  # a sweep a second, and no worker to take them
        assert beat.proc.poll() is None, beat.output()
        worker = start_as_make_run("maintenance", env)
        assert eventually(lambda: " ready." in worker.output(), 60, 0.1), worker.output()[-2000:]
        ready = time.monotonic()
        time.sleep(3)
        log = worker.output()
        ran = len(re.findall(r"Task delivery\.tasks\.sweep\[[^\]]+\] succeeded", log))
        dropped = len(re.findall(r"Discarding revoked task: delivery\.tasks\.sweep\[", log))
        print(f"the worker's first {time.monotonic() - ready:.1f} s: {dropped} sweeps dropped, {ran} run")
        # those sent over SWEEP_EXPIRES_SECS before it came are dropped; the rest, and a sweep a
        # second since, run
        assert dropped >= 1 and 1 <= ran <= SWEEP_EXPIRES_SECS + 4, log[-3000:]
        assert Heartbeat.objects.filter(name="sweep").exists()  # a sweep ran, on this database
    finally:
        if worker is not None:
            worker.stop()
        beat.stop()
