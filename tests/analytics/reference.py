"""The figures the analytics must agree with, computed by DuckDB over the archive's files as
they lie (Hive layout) and the hot rows: none of analytics' code takes part.

    want = duckdb_events(archive_dir, hot)              # hot: .messages, .deliveries (Arrow)
    assert_agrees_with_duckdb(want, run.event_stats)

A hot row whose message the archive also holds is dropped (the archive's copy wins). Each row
has its `day`, the one the archive files it under: a message's own, a delivery its message's
(a replay's delivery is made days later, and stays with its message): `where` may name it.
Latency is from a delivery's own created_at to its ack (docs/analytics.md).
"""

import duckdb

from analytics import partitions

# The quantiles 1 % of rank either side of each one asked for: ours must lie between.
BOUNDS = [0.49, 0.51, 0.94, 0.96, 0.98, 1.0]


def _connect(archive, hot):
    db = duckdb.connect()
    db.execute("SET TimeZone = 'UTC'")
    db.register("hot_messages", hot.messages)
    db.register("hot_deliveries", hot.deliveries)
    files = {
        k: f"read_parquet('{archive}/{k}/**/*.parquet', hive_partitioning = true)" for k in partitions.KINDS
    }
    archived_ids = f"(SELECT id FROM {files['messages']})"
    hot_messages = f"(SELECT * FROM hot_messages WHERE id NOT IN {archived_ids})"
    db.execute(
        f"""CREATE VIEW messages AS
        SELECT id, queue, CAST(day AS VARCHAR) AS day, event, created_at FROM {files["messages"]}
        UNION ALL SELECT id, queue, strftime(created_at, '%Y-%m-%d'), event, created_at FROM {hot_messages}"""
    )
    db.execute(
        f"""CREATE VIEW deliveries AS
        SELECT message_id, CAST(day AS VARCHAR) AS day, queue, event, subscriber, status, created_at,
            acked_at
        FROM {files["deliveries"]}
        UNION ALL SELECT d.message_id, strftime(m.created_at, '%Y-%m-%d'), d.queue, d.event,
            d.subscriber, d.status, d.created_at, d.acked_at
        FROM hot_deliveries d JOIN {hot_messages} m ON m.id = d.message_id"""
    )
    return db


def duckdb_events(archive, hot, where="true"):
    """[(queue, event, messages, deliveries, acked, dead, quantile bounds)], by queue and event."""
    db = _connect(archive, hot)
    return db.execute(
        f"""
        WITH m AS (SELECT queue, event, count(*) AS messages FROM messages WHERE {where} GROUP BY ALL),
        d AS (
            SELECT queue, event, count(*) AS deliveries,
                count(*) FILTER (status = 'acked') AS acked, count(*) FILTER (status = 'dead') AS dead,
                quantile_disc((epoch_us(acked_at) - epoch_us(created_at)) / 1000, {BOUNDS})
                    FILTER (status = 'acked') AS q
            FROM deliveries WHERE {where} GROUP BY ALL)
        SELECT queue, event, messages, deliveries, acked, dead, q FROM m JOIN d USING (queue, event)
        ORDER BY ALL
        """
    ).fetchall()


def duckdb_subscribers(archive, hot, where="true"):
    """{subscriber: (deliveries, pending, acked, dead)}."""
    db = _connect(archive, hot)
    rows = db.execute(
        f"""SELECT subscriber, count(*), count(*) FILTER (status = 'pending'),
            count(*) FILTER (status = 'acked'), count(*) FILTER (status = 'dead')
        FROM deliveries WHERE {where} GROUP BY ALL ORDER BY ALL"""
    ).fetchall()
    return {name: tuple(counts) for name, *counts in rows}


def assert_agrees_with_duckdb(want, stats):
    """Event stats (analyze's, as dicts) have DuckDB's counts, and percentiles within 1 % of
    rank of DuckDB's exact ones."""
    got = {(r["queue"], r["event"]): r for r in stats}
    assert got.keys() == {(w[0], w[1]) for w in want}
    for queue, event, messages, deliveries, acked, dead, q in want:
        row = got[(queue, event)]
        assert (row["messages"], row["deliveries"], row["acked"], row["dead"]) == (
            messages,
            deliveries,
            acked,
            dead,
        ), (queue, event)
        for i, name in enumerate(("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")):
            assert q[2 * i] <= row[name] <= q[2 * i + 1], (queue, event, name, q, row[name])
