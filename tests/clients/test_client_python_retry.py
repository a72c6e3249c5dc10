"""A keyed publish is tried again on a connection error or a 503, with backoff; one without a
key is tried once (its answer lost, it may be stored: again would store it twice). Against a
real Daphne that starts while the client is already publishing."""

import json
import logging
import threading
import time

import pytest
from django.db import connection
from mqclient import Client, MQConnectionError, MQError, MQThrottled
from mqclient._retry import is_transient

from queues.models import Message
from tests.support.outage import database_refusing_connections
from tests.support.servers import free_port, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)
# The client, whatever the server's database: the SQLite pass of make test runs these.
on_sqlite = pytest.mark.skipif(
    connection.vendor != "sqlite",
    reason="the client, whatever the server's database: the SQLite pass of make test runs it",
)


@on_sqlite
def test_a_keyed_publish_made_while_the_server_is_down_goes_through_once_it_is_up(logger, caplog):
    caplog.set_level(logging.INFO, logger="mqclient")
    port = free_port()
    servers = []
    with Client(f"http://127.0.0.1:{port}", logger.token, publish_attempts=8) as mq:
        started = time.monotonic()
        with pytest.raises(MQConnectionError):
            mq.publish("db", "create", {"n": 1})  # no key: tried once, at once
        assert time.monotonic() - started < 1
        starting = threading.Thread(target=lambda: servers.append(start_daphne(port=port)))
        starting.start()
        try:
            first = mq.publish("db", "create", {"order": 7}, key="order-7")
            again = mq.publish("db", "create", {"order": 7}, key="order-7")
        finally:
            starting.join(40)
            for server in servers:
                server.stop()
    assert "Retrying" in caplog.text and "MQConnectionError" in caplog.text
    assert first["id"] == again["id"]
    assert Message.objects.filter(key="order-7").count() == 1
    assert not Message.objects.exclude(key="order-7").exists()


@on_sqlite
def test_a_keyed_publish_gives_up_after_its_attempts_with_the_connection_error(logger):
    with Client(f"http://127.0.0.1:{free_port()}", logger.token, publish_attempts=2) as mq:
        with pytest.raises(MQConnectionError):
            mq.publish("db", "create", {}, key="k")
    with pytest.raises(ValueError, match="publish_attempts"):
        Client("http://127.0.0.1:1", "t", publish_attempts=0)


@on_sqlite
def test_only_no_answer_and_503_are_worth_another_attempt():
    assert is_transient(MQConnectionError(None, "connection_error", "refused"))
    assert is_transient(MQError(503, "unavailable", "restarting"))
    assert not is_transient(MQError(500, "server_error", "a bug: again would not mend it"))
    assert not is_transient(MQThrottled(429, "rate_limited", "slow down", 1.0))
    assert not is_transient(MQError(400, "bad_request", "no"))


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="a database failing over under the server: the PostgreSQL pass of make test runs it",
)
def test_a_keyed_publish_answered_503_while_the_database_is_away_is_stored_once_when_it_is_back(
    logger, caplog
):
    caplog.set_level(logging.INFO, logger="mqclient")
    web = start_daphne()
    try:
        with Client(web.http, logger.token, publish_attempts=6) as mq:
            mq.publish("db", "create", {"warm": 1})  # the server's connections are open
            with database_refusing_connections():
                # the server answers 503 unavailable: nothing stored, try again
                with pytest.raises(MQError) as refused:
                    mq.publish("db", "create", {"order": 8})  # no key: tried once
                assert (refused.value.status, refused.value.code) == (503, "unavailable")
                # a keyed publish keeps trying (0.5, 1, 2 s...) while the database is away
                publishing = threading.Thread(
                    target=lambda: answers.append(mq.publish("db", "create", {"order": 7}, key="order-7"))
                )
                answers = []
                publishing.start()
                time.sleep(1.5)
            publishing.join(30)
        assert len(answers) == 1
        assert "Retrying" in caplog.text and "503" in caplog.text
        # stored once; the unkeyed publish refused was not stored at all
        stored = [(m.key, json.loads(m.payload_json)) for m in Message.objects.order_by("seq")]
        assert stored == [(None, {"warm": 1}), ("order-7", {"order": 7})]
    finally:
        web.stop()
