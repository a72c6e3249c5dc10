"""A local Spark driver's JVM dies with the Python process that started it, even while it starts.

PySpark 4.3 starts the JVM (spark-submit, which execs java) with a pipe on its stdin, and the
JVM exits when the pipe closes: but it watches the pipe only once its gateway is up, seconds
after it started (3 s on an idle machine, 15 s on a loaded one). A Python process that ends
before that leaves a JVM that never exits: its start then fails (the file it would write its
port to went with the Python process) and its threads keep it alive. `make run` stopped while
an analysis starts does it (the Celery pool child running the analysis is terminated), and so
does a pool child killed for its time limit.

Here the kernel sends the JVM SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG,
which exec keeps): the JVM runs its shutdown hooks (Spark's temporary files go) and exits. A
session is built on a process's main thread (the pool child's task, `manage.py analyze`), so
the thread ends with the process.

Its test: tests/analytics/test_driver_jvm.py. It can go when PySpark lets a caller add to what
its child does before exec (launch_gateway replaces any preexec_fn given in popen_kwargs), or
ends the JVM it starts on its own.
"""

import os
import signal
import subprocess

from billiard.util import set_pdeathsig
from pyspark import java_gateway


class _DiesWithItsParent(subprocess.Popen):
    def __init__(self, args, *, preexec_fn=None, **kwargs):
        parent = os.getpid()

        def preexec():
            if preexec_fn is not None:
                preexec_fn()
            set_pdeathsig(signal.SIGTERM)
            if os.getppid() != parent:  # it died before the kernel was told to say so
                os._exit(1)

        super().__init__(args, preexec_fn=preexec, **kwargs)


def install():
    """The JVMs PySpark starts from now on die with the thread that started them."""
    java_gateway.Popen = _DiesWithItsParent
