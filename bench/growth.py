"""W5's 10 million delivery rows, made on PostgreSQL directly with INSERT ... SELECT generate_series.

The app's database (`mqsite_cmp_growth`) gets a queue `history` with HISTORY_SUBS subscribers
subscribed to it, rows // HISTORY_SUBS messages of 200 bytes and one delivery per message and
subscription: 90 % acked (history), 10 % pending (a backlog of subscribers that are away). The
measured runs use queues and subscribers of their own in the same tables. The ceiling gets the
same mix in its table `ceiling_growth`.

Both are kept between runs (they take minutes to make) and made again only when they hold
fewer rows than asked for. Secondary indexes are dropped during the bulk insert and built
again after it (the same definitions, read from the catalog), with triggers off
(session_replication_role = replica): the rows are consistent by construction, and the kept
counts are counted from them afterwards (`manage.py recounttallies`).
"""

import json
import subprocess
import sys
import time

import psycopg
from harness import PG_SERVER, ROOT, manage

HISTORY_SUBS = 10
PAYLOAD_SQL = """'{"i":' || g || ',"host":"bench-01.example.net","path":"/srv/bench/' || lpad(g::text, 8, '0')
    || '.dat","pad":"' || repeat('x', 120) || '"}'"""


def _server():
    return psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5)


def _exists(db):
    with _server() as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone() is not None


def _history_rows(url):
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT id FROM queues_queue WHERE name = 'history'").fetchone()
        if row is None:
            return 0
        return conn.execute(
            "SELECT count(*) FROM delivery_delivery WHERE queue_id = %s", [row[0]]
        ).fetchone()[0]


def _rebuild_indexes(conn, table, build):
    """Drop the secondary indexes and unique constraints of `table`, run build(), make them again."""
    rows = conn.execute(
        """
        SELECT i.relname, pg_get_indexdef(i.oid), c.conname, pg_get_constraintdef(c.oid)
        FROM pg_index x
        JOIN pg_class i ON i.oid = x.indexrelid
        LEFT JOIN pg_constraint c ON c.conindid = x.indexrelid AND c.conrelid = x.indrelid
        WHERE x.indrelid = %s::regclass AND NOT x.indisprimary
        """,
        [table],
    ).fetchall()
    for index, _, constraint, _ in rows:
        if constraint:
            conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{constraint}"')
        else:
            conn.execute(f'DROP INDEX "{index}"')
    build()
    started = time.monotonic()
    for _, indexdef, constraint, condef in rows:
        if constraint:
            conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{constraint}" {condef}')
        else:
            conn.execute(indexdef)
    return len(rows), time.monotonic() - started


def ensure_ours(db, rows, env):
    """The app's database `db` with at least `rows` history deliveries. Returns (url, info)."""
    url = f"{PG_SERVER}/{db}"
    env = {**env, "DATABASE_URL": url}
    if _exists(db):
        manage(env, "migrate", "--noinput")  # others change the schema while this one is kept
        have = _history_rows(url)
        if have >= rows:
            return url, {"rows": have, "made_now": False}
        with _server() as conn:
            conn.execute(f"DROP DATABASE {db} WITH (FORCE)")
    started = time.monotonic()
    with _server() as conn:
        conn.execute(f"CREATE DATABASE {db}")
    manage(env, "migrate", "--noinput")
    spec = {
        "queues": ["history"],
        "subscribers": [{"name": f"hist-{k}", "subscribe": ["history"]} for k in range(HISTORY_SUBS)],
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "django_setup.py")],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    if done.returncode:
        raise RuntimeError(f"provisioning the history failed:\n{done.stderr[-2000:]}")
    messages = rows // HISTORY_SUBS
    timings = {}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("SET maintenance_work_mem = '512MB'")
        queue_id = conn.execute("SELECT id FROM queues_queue WHERE name = 'history'").fetchone()[0]
        conn.execute(
            "INSERT INTO queues_event (queue_id, name, created_at) VALUES (%s, 'create', now()) "
            "ON CONFLICT DO NOTHING",
            [queue_id],
        )
        event_id = conn.execute(
            "SELECT id FROM queues_event WHERE queue_id = %s AND name = 'create'", [queue_id]
        ).fetchone()[0]
        t = time.monotonic()
        conn.execute(
            f"""
            INSERT INTO queues_message (queue_id, event_id, seq, payload_json, key, publisher_id, created_at)
            SELECT %s, %s, g, {PAYLOAD_SQL}, NULL, NULL,
                   now() - interval '7 days' + g * interval '1 ms'
            FROM generate_series(1, %s) g
            """,
            [queue_id, event_id, messages],
        )
        conn.execute("UPDATE queues_queue SET last_seq = %s WHERE id = %s", [messages, queue_id])
        timings["messages_s"] = round(time.monotonic() - t, 1)

        def insert():
            t = time.monotonic()
            conn.execute(
                """
                INSERT INTO delivery_delivery
                    (subscription_id, subscriber_id, message_id, queue_id, event_id, seq, status,
                     attempt, next_attempt_at, ack_deadline, lease_holder, created_at, delivered_at,
                     acked_at, last_error)
                SELECT s.id, s.subscriber_id, m.id, m.queue_id, m.event_id, m.seq,
                       CASE WHEN m.seq %% 10 = 0 THEN 'pending' ELSE 'acked' END,
                       CASE WHEN m.seq %% 10 = 0 THEN 0 ELSE 1 END,
                       m.created_at, NULL, '', m.created_at,
                       CASE WHEN m.seq %% 10 = 0 THEN NULL ELSE m.created_at + interval '20 ms' END,
                       CASE WHEN m.seq %% 10 = 0 THEN NULL ELSE m.created_at + interval '40 ms' END,
                       ''
                FROM queues_message m
                CROSS JOIN subscribers_subscription s
                WHERE m.queue_id = %s AND s.queue_id = %s
                ORDER BY m.id, s.id
                """,
                [queue_id, queue_id],
            )
            timings["deliveries_s"] = round(time.monotonic() - t, 1)

        count, timings["indexes_s"] = _rebuild_indexes(conn, "delivery_delivery", insert)
        timings["indexes"] = count
        timings["indexes_s"] = round(timings["indexes_s"], 1)
        conn.execute("VACUUM ANALYZE queues_message")
        conn.execute("VACUUM ANALYZE delivery_delivery")
    # The triggers that keep the counts (delivery.tallies) were off with the replica role:
    # count them from the rows, as an operator would after such a load.
    t = time.monotonic()
    manage(env, "recounttallies")
    timings["recount_s"] = round(time.monotonic() - t, 1)
    return url, {
        "rows": _history_rows(url),
        "made_now": True,
        "seconds": round(time.monotonic() - started, 1),
        **timings,
    }


def ensure_ceiling(rows, table="ceiling_growth"):
    """The ceiling's table with at least `rows` history rows (subs -1 .. -HISTORY_SUBS)."""
    from systems import CEILING_DDL, ceiling_url

    url = ceiling_url()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(CEILING_DDL.format(table=table))
        have = conn.execute(f"SELECT count(*) FROM {table} WHERE sub < 0").fetchone()[0]
        if have >= rows:
            return {"rows": have, "made_now": False}
        started = time.monotonic()
        conn.execute(f"DROP TABLE {table}")
        conn.execute(CEILING_DDL.format(table=table))
        conn.execute("SET maintenance_work_mem = '512MB'")

        def insert():
            conn.execute(
                f"""
                INSERT INTO {table} (sub, payload, status, attempt, created_at)
                SELECT -1 - (g %% {HISTORY_SUBS}), {PAYLOAD_SQL},
                       CASE WHEN (g / {HISTORY_SUBS}) %% 10 = 0 THEN 'pending' ELSE 'acked' END, 1,
                       now() - interval '7 days'
                FROM generate_series(1, %s) g
                """,
                [rows],
            )

        _rebuild_indexes(conn, table, insert)
        conn.execute(f"VACUUM ANALYZE {table}")
        return {"rows": rows, "made_now": True, "seconds": round(time.monotonic() - started, 1)}
