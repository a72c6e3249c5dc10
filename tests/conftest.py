"""Personas and helpers shared by the tests.

The personas: `logger` (subscribes to db, publishes to db), `peer` (another subscriber of db,
who must never see the logger's deliveries), `outsider` (may use no queue at all), and an
operator (a staff user).
"""

from pathlib import Path
from unittest import mock

import pytest
from django.db import close_old_connections
from django.test import Client
from rest_framework.test import APIClient

from delivery import publishing
from queues import lookup, schemas
from queues.models import Queue
from subscribers import auth
from subscribers.models import forget_publish_grants, forget_webhookless
from subscribers.provisioning import create_subscriber


@pytest.fixture(autouse=True)
def archives_go_to_spark(settings):
    """The suite's archives are tiny, and would all be reduced in the analysing process
    (MQ_ANALYTICS_LOCAL_BYTES): Spark reduces them, as it does a big archive, so that its job
    stays tested; the tests of the in-process path set the setting back."""
    settings.MQ_ANALYTICS_LOCAL_BYTES = 0


@pytest.fixture
def make_queue(db):
    def make(name="db", **fields):
        return Queue.objects.create(name=name, **fields)

    return make


@pytest.fixture
def make_subscriber(db):
    def make(name, publish=("*",), subscribe=("*",), **kw):
        subscriber, token = create_subscriber(name, publish=publish, subscribe=subscribe, **kw)
        subscriber.token = token
        return subscriber

    return make


def client_for(subscriber=None):
    client = APIClient()
    if subscriber is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {subscriber.token}")
    return client


@pytest.fixture
def db_queue(make_queue):
    return make_queue("db")


@pytest.fixture
def logger(make_subscriber, db_queue):
    return make_subscriber("logger", publish=("db",), subscribe=("db",))


@pytest.fixture
def peer(make_subscriber, db_queue):
    return make_subscriber("peer", publish=("db",), subscribe=("db",))


@pytest.fixture
def owner(logger, db_queue):
    """The logger, subscribed to every event of db."""
    from delivery import subscribing

    subscribing.subscribe(logger, db_queue)
    return logger


@pytest.fixture
def outsider(make_subscriber):
    return make_subscriber("outsider", publish=(), subscribe=())


@pytest.fixture
def announcing(settings):
    """This process announces changes over the end-to-end servers' Redis, as a server or
    worker would (delivery.revocation.announce)."""
    from mqsite import bus
    from tests.support.servers import E2E_REDIS

    settings.REDIS_URL = E2E_REDIS
    bus.client.cache_clear()
    yield
    bus.client.cache_clear()


@pytest.fixture
def operator(django_user_model):
    return django_user_model.objects.create_user(
        "op", password="op-password-1", is_staff=True, is_superuser=True
    )


@pytest.fixture
def staff(operator):
    """A browser logged in to the admin as the operator (Django's test client)."""
    client = Client()
    client.force_login(operator)
    return client


@pytest.fixture
def operator_client(operator):
    client = APIClient(enforce_csrf_checks=False)
    client.force_login(operator)
    return client


@pytest.fixture(scope="session", autouse=True)
def _consumers_return_their_connections():
    """Channels' WebsocketCommunicator turns `channels.db.close_old_connections` into a no-op
    while a test awaits it, so that a TestCase's one shared connection survives. Our consumer
    tests are transactional and each consumer thread has a connection of its own: with the
    no-op those are never returned, and on PostgreSQL psycopg's pool (20) ran dry after
    twenty websocket tests. Keep the real cleanup, as in production."""
    with mock.patch("channels.testing.application.no_op", close_old_connections):
        yield


@pytest.fixture(autouse=True)
def _forget_remembered_events():
    """Each test starts from an empty database, whose ids the next test uses again: events
    remembered by publishing (after a commit) must not outlive the test that made them, nor
    the queues, subscribers, publish grants and webhookless subscribers kept for requests and
    wake-ups (a rollback announces nothing). A server's database never goes back like this."""
    yield
    publishing.forget_all_events()
    lookup.forget_queues()
    schemas.forget()
    auth.forget_subscribers()
    forget_publish_grants()
    forget_webhookless()


@pytest.fixture(scope="session", autouse=True)
def _close_connection_pools(django_db_setup, django_db_blocker):
    """Empty psycopg's pools before pytest-django drops the test database: pooled
    connections held open would make the DROP fail and leave the database behind."""
    yield
    from django.db import connections

    with django_db_blocker.unblock():
        for conn in connections.all():
            if hasattr(conn, "close_pool"):
                conn.close_pool()


@pytest.fixture(autouse=True)
def _forget_limit_counts():
    """The hourly counts of new event names (mqsite.limits) live in the cache, which in tests
    is this process's memory: the next test's fresh database gives out the same subscriber
    ids, and must not inherit their counts."""
    yield
    from django.core.cache import caches
    from django.core.cache.backends.locmem import LocMemCache

    if isinstance(caches["default"], LocMemCache):
        caches["default"].clear()


@pytest.fixture(autouse=True)
def _close_async_pools():
    """The async pool of the socket's hot path (mqsite/adb.py) belongs to the event loop of
    the test that opened it: closed after the test, so that no connection outlives its loop
    (nor keeps pytest-django from dropping the test database)."""
    yield
    from mqsite import adb

    adb.close_pools()


@pytest.fixture
def archive_dir(tmp_path, settings):
    """MQ_ARCHIVE_DIR in a fresh folder of the test's own."""
    settings.MQ_ARCHIVE_DIR = str(tmp_path / "archive")
    return tmp_path / "archive"


@pytest.fixture
def subscribed(db_queue, logger, peer):
    """The db queue, with the logger and the peer subscribed to it."""
    from delivery import subscribing

    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    return db_queue


@pytest.fixture
def server():
    """A Daphne process serving the test database, stopped after the test."""
    from tests.support.servers import start_daphne

    s = start_daphne()
    yield s
    s.stop()


@pytest.fixture
def receiver():
    """A webhook receiver on loopback that answers 200 (tests.support.receivers)."""
    from tests.support.receivers import Receiver

    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def elsewhere():
    """Another origin on loopback, which a redirect of the server may point at
    (tests.support.redirects): it records whatever reaches it."""
    from tests.support.redirects import Elsewhere

    other = Elsewhere()
    yield other
    other.close()


@pytest.fixture
def var_dir(settings, tmp_path):
    """The server's var/ folder (VAR_DIR) in a fresh folder of the test's own."""
    settings.VAR_DIR = tmp_path
    settings.PORT = 8123
    return tmp_path


# --- one pass for what no database changes --------------------------------------------------------

# What a test asks for when it reads or writes the database (pytest-django's fixtures).
DATABASE_FIXTURES = {
    "db",
    "transactional_db",
    "django_db_reset_sequences",
    "django_db_serialized_rollback",
    "live_server",
}
# The folders whose tests start servers and clients as processes, which open the database of
# the pass themselves: each of their modules says which pass runs it.
PROCESS_TESTS = ("e2e", "clients", "faults")


def pytest_collection_modifyitems(config, items):
    """On PostgreSQL, skip the tests that touch no database (no django_db mark, no database
    fixture): the SQLite pass of `make test` runs them, and they would do the very same work
    twice (the Spark and Arrow analytics, the figures, the docs, the clients' own logic)."""
    from django.db import connection

    if connection.vendor == "sqlite":
        return
    tests = Path(__file__).resolve().parent
    skip = pytest.mark.skip(reason="no database in it: the SQLite pass of make test runs it")
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(tests) or path.relative_to(tests).parts[0] in PROCESS_TESTS:
            continue
        if item.get_closest_marker("django_db"):
            continue
        if DATABASE_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
            item.add_marker(skip)
