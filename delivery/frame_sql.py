"""A delivery's `message` frame written by PostgreSQL, from the stored payload and headers text.

Its own module, below both: the ledger's socket leases select it (ledger._FRAMED), and
delivery.frames, which encodes the same frame in Python (message_frame), imports publishing,
which imports the ledger. tests/delivery/test_framed_lease.py holds the two to one text.
"""


def message_frame_sql(d="d", m="m", q="q", e="e"):
    """The SQL of a delivery's `message` frame text, from its row `d`, its message `m`, queue
    `q` and event `e` (PostgreSQL)."""
    return (
        f"""'{{"type":"message","id":' || {d}.id || ',"message_id":' || {d}.message_id"""
        f""" || ',"queue":' || to_json({q}.name)::text || ',"event":' || to_json({e}.name)::text"""
        f""" || ',"seq":' || {d}.seq || ',"payload":' || {m}.payload_json"""
        f""" || ',"attempt":' || {d}.attempt || ',"published_at":' || {_time_json(f"{m}.created_at")}"""
        f""" || ',"deliver_at":' || {_time_json(f"{m}.deliver_at")}"""
        f""" || ',"expires_at":' || {_time_json(f"{d}.expires_at")}"""
        f""" || ',"group":' || COALESCE(to_json({m}.grp)::text, 'null')"""
        f""" || CASE WHEN {m}.headers_json <> '' THEN ',"headers":' || {m}.headers_json ELSE '' END"""
        """ || '}'"""
    )


def _time_json(column):
    """SQL: a timestamptz column as the API's encoder writes it in JSON: a quoted UTC time (ISO
    8601, microseconds only when there are some, "Z"), or null."""
    at = f"({column} AT TIME ZONE 'UTC')"
    text = (
        f"""to_char({at}, 'YYYY-MM-DD"T"HH24:MI:SS') """
        f"""|| CASE WHEN date_trunc('second', {at}) = {at} THEN '' ELSE to_char({at}, '.US') END"""
    )
    return f"""COALESCE('"' || {text} || 'Z"', 'null')"""
