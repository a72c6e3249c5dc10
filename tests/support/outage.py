"""The test database going away under a running server (PostgreSQL), as in a failover."""

import contextlib

import psycopg
from django.db import connection


@contextlib.contextmanager
def database_refusing_connections():
    """The server's database refuses new connections and drops the server's open ones, as in
    a failover, until the block ends (this test's own connection stays)."""
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (ours,) = cursor.fetchone()
    # a database's connections are switched off from another database
    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
            (name, ours),
        )
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            # This process's pooled connections other than ours were ended too: a new pool.
            connection.close()
            connection.close_pool()
