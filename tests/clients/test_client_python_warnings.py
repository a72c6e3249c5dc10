"""The Python client says what goes wrong at WARNING, where a program that configured no logging
still shows it (Python's last-resort handler prints WARNING and above to stderr): a listen() that
cannot connect, and a handler that keeps raising. One failure of either is routine and stays
at INFO (a reconnect after a server restart, one retried delivery)."""

import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from django.db import connection
from mqclient import Client

from tests.support.servers import eventually, free_port

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="the client, whatever the server's database: the SQLite pass of make test runs it",
    ),
]


def test_a_listen_that_cannot_connect_says_so_on_stderr_with_no_logging_configured(tmp_path):
    port = free_port()  # nothing listens there
    program = tmp_path / "consumer.py"
    program.write_text(
        textwrap.dedent(
            f"""
            from mqclient import Client
            Client("http://127.0.0.1:{port}", "a-token").listen(print, [("db", None)])
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL",)}
    consumer = subprocess.Popen([sys.executable, str(program)], env=env, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(20, consumer.kill)  # a consumer that says nothing fails, not hangs
    watchdog.start()
    try:
        line = consumer.stderr.readline()  # the first warning (or "" at its end)
    finally:
        watchdog.cancel()
        consumer.kill()
        consumer.wait(10)
    assert f"cannot connect to ws://127.0.0.1:{port}/ws/" in line
    assert "a-token" not in line


def test_a_handler_that_keeps_failing_is_a_warning_from_its_third_failure_in_a_row(server, logger, caplog):
    caplog.set_level(logging.INFO, logger="mqclient")

    def handler(delivery):
        raise ValueError(f"no such customer {delivery.payload}")

    with Client(server.http, logger.token) as mq:
        mq.subscribe("db", "create")
        thread = threading.Thread(target=mq.listen, args=(handler, [("db", "create")]))
        thread.start()
        try:
            mq.publish_many("db", [("create", n) for n in range(3)])
            assert eventually(lambda: "3 times in a row" in caplog.text)
        finally:
            mq.stop()
            thread.join(20)
    warnings = [r for r in caplog.records if r.name == "mqclient" and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # the first two were INFO, and the next come at most once a minute
    assert "no such customer" in warnings[0].getMessage() and warnings[0].exc_info
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("handler failed on delivery" in m for m in infos) >= 2
