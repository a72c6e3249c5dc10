"""The web unit's command (deploy/systemd/mqsite-web@.service) serves from the socket systemd
hands it: systemd's own socket activator (systemd-socket-activate, systemd's protocol: fd 3 and
LISTEN_FDS) runs the unit's ExecStart as written, on this checkout and the test database, and it
stops on the unit's KillSignal within its TimeoutStopSec. No systemd runs here (docs/deploy.md):
this is the part of the unit that can run without it."""

import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.support import servers
from tests.support.servers import ROOT, eventually, free_port

UNIT = ROOT / "deploy" / "systemd" / "mqsite-web@.service"
# No skip when it is missing: `make test` installs Debian's systemd package (the Makefile's
# test tools), so a missing one is a broken setup, which a skip would hide.
ACTIVATE = shutil.which("systemd-socket-activate") or "systemd-socket-activate"


def unit_setting(name):
    (line,) = [x for x in UNIT.read_text().splitlines() if x.startswith(f"{name}=")]
    return line.removeprefix(f"{name}=")


def healthz(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.django_db(transaction=True)
def test_the_web_units_command_serves_from_systemds_socket_and_stops_on_its_signal():
    command = shlex.split(unit_setting("ExecStart").replace("/opt/mqsite", str(ROOT)))
    assert "--fd" in command and command[command.index("--fd") + 1] == "3"  # systemd's first fd
    port = free_port()
    # The activator passes a child only the variables it is given (as EnvironmentFile= does)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(DATABASE_URL=servers.test_database_url(), MQ_HEALTH_WORKERS="false")
    proc = subprocess.Popen(
        [ACTIVATE, "-l", f"127.0.0.1:{port}", *(f"-E{k}={v}" for k, v in env.items()), *command],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # the first connection starts the server, which then answers it from the socket
        assert eventually(lambda: healthz(port) or proc.poll() is not None, timeout=30)
        assert proc.poll() is None and healthz(port)
        proc.send_signal(getattr(signal, unit_setting("KillSignal")))
        started = time.monotonic()
        proc.wait(timeout=int(unit_setting("TimeoutStopSec")))
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
