"""The PostgreSQL connection budget (mqsite/db_budget.py; docs/operations/index.md, "PostgreSQL
connections"): what `make run`'s processes may open fits PostgreSQL's default max_connections
(100) with the documented processes, and a web process under load opens no more than its two
pools' caps."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from django.db import connection
from websockets.sync.client import connect

from mqsite import db_budget, run_programs
from subscribers.provisioning import create_subscriber
from tests.support import servers
from tests.support.http import publish_over_http
from tests.support.personas import subscribed_owner
from tests.support.servers import ROOT, start_daphne

POSTGRES_MAX_CONNECTIONS = 100  # PostgreSQL's default


def settings_of(**env):
    """The settings a process of `make run` in the services mode gets with `env`."""
    code = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps([s.MQ_WEB_PROCESSES, s.MQ_WEB_DB_POOL_MAX_SIZE, s.MQ_ASYNC_DB_POOL_MAX_SIZE]))"
    )
    base = {
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/unused",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "DJANGO_SETTINGS_MODULE": "mqsite.settings",
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_workers_need_what_their_threads_use_as_supervisord_conf_runs_them():
    programs = run_programs.programs()
    # the webhook worker's 16 threads, its main and liveness threads
    assert db_budget.worker_connections(programs["worker"]) == 16 + 2
    # the sweeper's 2 threads, the same two, and the archive's lock
    assert db_budget.worker_connections(programs["maintenance"]) == 2 + 2 + 1
    assert db_budget.worker_connections(programs["analytics"]) == 2 + 2  # the parent, its one child
    assert db_budget.worker_connections(programs["beat"]) == 2
    assert "demo" not in db_budget.workers(programs) and "web" not in db_budget.workers(programs)
    # more threads, more connections
    more = [*programs["worker"]]
    more[more.index("-c") + 1] = "32"
    assert db_budget.worker_connections(more) == 34


@pytest.mark.parametrize("web_processes", [1, 2, 4, 8])
def test_the_defaults_fit_postgresqls_default_max_connections(web_processes):
    web, asynchronous = settings_of(MQ_WEB_PROCESSES=str(web_processes))[1:]
    rows, total = db_budget.table(web_processes, web, asynchronous)
    print(f"{web_processes} web process(es): {rows}, {total} in all")
    assert total <= POSTGRES_MAX_CONNECTIONS - 10  # the reserve: commands, psql, superusers
    assert web <= 20 and asynchronous <= 20


def test_a_larger_server_gives_the_web_processes_more():
    assert settings_of(MQ_WEB_PROCESSES="4")[1:] == [7, 8]
    assert settings_of(MQ_WEB_PROCESSES="4", MQ_DB_MAX_CONNECTIONS="200")[1:] == [20, 20]
    assert settings_of(MQ_WEB_PROCESSES="4", MQ_WEB_DB_POOL_MAX_SIZE="5")[1:] == [5, 8]  # said outright


def test_processes_that_would_not_fit_are_refused_at_start_with_the_figures():
    with pytest.raises(subprocess.CalledProcessError) as refused:
        settings_of(MQ_WEB_PROCESSES="16")  # 16 x (2 + 2) and the workers' 29: 93
    error = refused.value.stderr.strip().splitlines()[-1]
    assert "ImproperlyConfigured: the processes of make run may open 93 PostgreSQL connections" in error
    assert "16 x web (Daphne): 4" in error and "MQ_DB_MAX_CONNECTIONS (100)" in error
    assert settings_of(MQ_WEB_PROCESSES="16", MQ_DB_MAX_CONNECTIONS="200")[0] == 16  # raised: fits
    # behind PgBouncer the connections are its clients: PostgreSQL sees its pool
    assert settings_of(MQ_WEB_PROCESSES="16", MQ_DB_TRANSACTION_POOLER="true")[0] == 16


def test_the_default_number_of_web_processes_fits():
    most = db_budget.MAX_DEFAULT_WEB_PROCESSES
    assert db_budget.table(most, *db_budget.web_share(90, most))[1] <= 90


@pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite has no connections to count")
@pytest.mark.django_db(transaction=True)
def test_a_web_process_under_load_opens_no_more_than_its_pools_caps():
    subscribed_owner()  # a subscriber, so that each publish makes a delivery
    _, token = create_subscriber("publisher", publish=["db"])  # its sockets get only answers
    # its connections named, to be told from others' (the test's own, for one)
    url = f"{servers.test_database_url()}?application_name=web-under-load"
    server = start_daphne(
        {"DATABASE_URL": url, "MQ_WEB_DB_POOL_MAX_SIZE": "3", "MQ_ASYNC_DB_POOL_MAX_SIZE": "4"}
    )
    seen, done, failures = [], threading.Event(), []

    def count():
        with connection.cursor() as cursor:
            while not done.is_set():
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'web-under-load'"
                )
                seen.append(cursor.fetchone()[0])
                time.sleep(0.01)
        connection.close()  # this thread's

    def rest():
        try:
            for i in range(10):
                publish_over_http(server, token, 5, start=i)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    def socket():
        try:
            with connect(f"{server.ws}?token={token}") as ws:
                for n in range(20):
                    ws.send(json.dumps({"type": "publish", "queue": "db", "event": "create", "payload": n}))
                for _ in range(20):
                    assert json.loads(ws.recv(timeout=20))["type"] == "published"
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        # REST requests and sockets at once, each more than the caps, all publishing to one
        # queue: a caller waiting for its group commit gives its connection back
        # (delivery.group_commit), else the leader, a socket's publish with none yet, waited out
        # the pool's 10 s behind the requests holding the pool's three (1 run in 3 here).
        load = [threading.Thread(target=target) for target in [rest] * 12 + [socket] * 8]
        for t in load:
            t.start()
        for t in load:
            t.join(60)
    finally:
        done.set()
        counter.join()
        server.stop()
    print(f"connections of the web process under load: at most {max(seen)} ({len(seen)} samples)")
    assert not failures, failures[:3]
    assert 3 <= max(seen) <= 3 + 4
