"""The test database going away under a running server (PostgreSQL), as in a failover."""

import contextlib

import psycopg
from django.db import connection

from tests.support.servers import SERVER_APPLICATION_NAME


@contextlib.contextmanager
def database_refusing_connections():
    """The server's database refuses new connections and drops the open ones of the servers
    start_daphne started, as in a failover, until the block ends (the test process's own
    connections stay: other tests still use them)."""
    name = connection.settings_dict["NAME"]
    # a database's connections are switched off from another database
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND application_name = %s",
            (name, SERVER_APPLICATION_NAME),
        )
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
