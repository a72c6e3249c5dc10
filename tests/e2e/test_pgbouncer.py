"""Behind PgBouncer in transaction mode (docs/operations/index.md, "PgBouncer"): with
MQ_DB_TRANSACTION_POOLER on, a Daphne serves publishes, pulls and acks over REST and a socket,
and the archive runs and keeps its lock, through a PgBouncer (Debian's) whose few server
connections every client shares, one transaction at a time. Nothing may rely on a server session
lasting between two transactions: a prepared statement, a session lock, a startup option."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.db import connection
from websockets.sync.client import connect

from delivery import subscribing
from delivery.models import Delivery, Status
from tests.support import servers
from tests.support.history_rows import days_ago, publish_at, settle
from tests.support.http import publish_over_http, request
from tests.support.personas import subscribed_owner
from tests.support.servers import ROOT, Process, eventually, free_port, start_daphne

PGBOUNCER = "/usr/sbin/pgbouncer"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="PgBouncer pools PostgreSQL: the PostgreSQL pass runs it"
    ),
]


@pytest.fixture
def bouncer():
    """A private PgBouncer in transaction mode in front of the test database, with two server
    connections for every client: what one transaction left in a session, the next client's
    finds. Yields the DATABASE_URL that goes through it."""
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    folder.chmod(0o755)  # read by the user it runs as (it refuses to run as root)
    server = urlsplit(servers.test_database_url())
    (folder / "users.txt").write_text(f'"{server.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={server.hostname} port={server.port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/users.txt
pool_mode = transaction
default_pool_size = 2
max_client_conn = 200
"""
    )
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    proc = Process([PGBOUNCER, *as_user, str(folder / "pgbouncer.ini")], dict(os.environ), "pgbouncer")
    assert eventually(lambda: _accepts(port), 10), proc.output()
    yield urlunsplit(server._replace(netloc=f"{server.username}@127.0.0.1:{port}")), proc
    proc.stop()


def _accepts(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def manage(url, archive_dir, *args, **popen):
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "MQ_DB_TRANSACTION_POOLER": "true",
        "MQ_ARCHIVE_DIR": archive_dir,
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=env, text=True, **popen)


def test_publishes_pulls_and_acks_over_rest_and_a_socket_through_it(bouncer):
    url, pgbouncer = bouncer
    _, _, token, _ = subscribed_owner()
    server = start_daphne({"DATABASE_URL": url, "MQ_DB_TRANSACTION_POOLER": "true"})
    try:
        # REST: publish, pull, ack, several times (a statement prepared on one server
        # connection and run again on another is what fails)
        for round_ in range(5):
            publish_over_http(server, token, 2, start=2 * round_)
            status, pulled = request(server, token, "GET", "/api/deliveries?limit=10")
            ids = [d["id"] for d in pulled["deliveries"]]
            assert status == 200 and len(ids) == 2
            assert request(server, token, "POST", "/api/deliveries/ack", {"ids": ids}) == (
                200,
                {"acked": 2, "unknown": []},
            )
        # a socket: its publishes, deliveries and acks go through the async pool
        with connect(f"{server.ws}?token={token}") as ws:
            for n in range(10):
                ws.send(json.dumps({"type": "publish", "queue": "db", "event": "create", "payload": n}))
            got, published = [], 0
            while len(got) < 10 or published < 10:  # every frame read: the close waits for them
                frame = json.loads(ws.recv(timeout=10))
                if frame["type"] == "message":
                    got.append(frame["payload"])
                    ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
                else:
                    assert frame["type"] == "published", frame
                    published += 1
            assert sorted(got) == list(range(10))
            assert eventually(lambda: Delivery.objects.filter(status=Status.ACKED).count() == 20, 10)
    finally:
        server.stop()
    log = Path(server.log.name).read_text(errors="replace")
    assert "Traceback" not in log and "prepared statement" not in log, log[-3000:]


def test_the_archive_runs_and_keeps_its_lock_through_it(bouncer, db_queue, logger, tmp_path):
    url, _ = bouncer
    archive_dir = str(tmp_path / "archive")
    subscribing.subscribe(logger, db_queue)
    old = publish_at(db_queue, "create", days_ago(10))
    settle(old, {logger: Status.ACKED})
    # Another run holds the archive's lock, through the same two server connections
    holder = manage(
        url,
        archive_dir,
        "shell",
        "-v",
        "0",
        "-c",
        "import sys; from analytics import archive\n"
        "with archive.exclusive(None):\n    print('held', flush=True); sys.stdin.read()",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        # ... so that ten tries, each a transaction on either server connection, all find it held
        tries = manage(
            url,
            archive_dir,
            "shell",
            "-v",
            "0",
            "-c",
            "from analytics import archive\ntaken = 0\nfor _ in range(10):\n"
            "    try:\n        with archive.exclusive(None):\n            taken += 1\n"
            "    except archive.ArchiveBusy:\n        pass\nprint(taken)",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = tries.communicate(timeout=60)
        assert (tries.returncode, out.strip()) == (0, "0"), err
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # ... let go: the run moves the acked message
    run = manage(url, archive_dir, "archive", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0 and json.loads(out) == {"messages": 1, "deliveries": 1}, (out, err)
    assert not Delivery.objects.filter(message_id=old).exists()
