"""The operators' benchmark's database: a backlog of pending deliveries made THROUGH THE API in
the services mode, kept as a PostgreSQL template database and copied for each run.

What it holds (the names operators.py relies on):

- queues `ops-a`, `ops-b`, `ops-c` (events `create`, `update`, `delete`), each subscribed (all
  events) by SUBSCRIBERS subscribers `ops-sub-0` .. `ops-sub-9` that never connect: `rows`
  deliveries, all pending, rows / SUBSCRIBERS messages published by `ops-pub` in REST batches
  of 1000;
- queue `ops-dead` (max_attempts 1): DEAD messages that `ops-deadsub` pulled and nacked, so
  they are dead letters;
- queue `ops-live` for `ops-watch`, the subscriber whose open socket makes a Connection row;
- a superuser ADMIN (password ADMIN_PASSWORD) for the admin pages and the dashboard.

Making 2 million deliveries takes minutes, so the result is kept as the template database
`mq_bench_operators_<size>` (with `--on-w5`: `mq_bench_operators_w5_<size>`, made on top of a
copy of W5's 10 million rows, growth.py) and reused while the migrations it has applied are
the tree's; otherwise (or with --rebuild) it is made again. It is built under another name and
renamed when done, so an interrupted build never leaves a half-made template. A run works on
a copy (CREATE DATABASE ... TEMPLATE ...), which it drops at the end.
"""

import json
import re
import threading
import time
from datetime import UTC, datetime

import growth
import psycopg
from harness import PG_SERVER, Client, git, manage, message, services_server

QUEUES = ("ops-a", "ops-b", "ops-c")
EVENTS = ("create", "update", "delete")
SUBSCRIBERS = 10
BATCH = 1000  # the contract's largest REST batch
PUBLISHERS = 2  # REST clients publishing at once (one per Daphne process on 2 CPUs)
DEAD = 20
ADMIN, ADMIN_PASSWORD = "ops-admin", "ops-bench-password"
PUBLISHER = ("ops-pub", ["--publish", "*"])
BACKLOG_SUBSCRIBER = ("ops-sub-0", ["--subscribe", *QUEUES])
WATCHER = ("ops-watch", ["--subscribe", "ops-live"])
DEAD_SUBSCRIBER = ("ops-deadsub", ["--subscribe", "ops-dead"])


def template_name(rows, on_w5=False):
    size = f"{rows // 1_000_000}m" if rows % 1_000_000 == 0 else str(rows)
    return f"mq_bench_operators_{'w5_' if on_w5 else ''}{size}"


def _server():
    return psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5)


def _info(db):
    """The template's build description (its database comment), or None if it does not exist."""
    with _server() as conn:
        row = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", [db]
        ).fetchone()
    if row is None:
        return None
    try:
        return json.loads(row[0] or "{}")
    except ValueError:
        return {}


def _drop(conn, db):
    if _exists(conn, db):
        conn.execute(f'ALTER DATABASE "{db}" IS_TEMPLATE false')  # a template cannot be dropped
        conn.execute(f'DROP DATABASE "{db}" WITH (FORCE)')


def _exists(conn, db):
    return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone() is not None


def migrations_match(env, db):
    """Whether `db` has applied exactly the tree's migrations: none of the tree's unapplied
    (`showmigrations --list`), and none applied that the tree does not have."""
    out = manage({**env, "DATABASE_URL": f"{PG_SERVER}/{db}"}, "showmigrations", "--list")
    on_disk, app = set(), None
    for line in out.splitlines():
        if line and not line.startswith(" "):
            app = line.strip()
            continue
        found = re.match(r"\s*\[( |X|-)\]\s+(\S+)", line)
        if found is None:
            continue
        if found[1] != "X":
            return False
        on_disk.add((app, found[2]))
    with psycopg.connect(f"{PG_SERVER}/{db}") as conn:
        applied = set(conn.execute("SELECT app, name FROM django_migrations").fetchall())
    return applied <= on_disk


def ensure(env, rows, on_w5=False, rebuild=False, workdir=None, processes=2):
    """The template for `rows` pending deliveries: reused if it exists and its migrations match
    the tree's, made otherwise. Returns (name, its build description, whether made now)."""
    name = template_name(rows, on_w5)
    info = _info(name)
    if info is not None and not rebuild:
        if migrations_match(env, name):
            print(f"reusing the template database {name} (made {info.get('made_at')})", flush=True)
            return name, info, False
        print(f"{name}: its migrations differ from the tree's: making it again", flush=True)
    build = f"{name}_build"
    with _server() as conn:
        _drop(conn, build)
        if on_w5:
            w5_db, w5_rows = w5()
            growth.ensure_ours(w5_db, w5_rows, env)
            conn.execute(f'CREATE DATABASE "{build}" TEMPLATE "{w5_db}" STRATEGY FILE_COPY')
        else:
            conn.execute(f'CREATE DATABASE "{build}"')
    info = make_backlog({**env, "DATABASE_URL": f"{PG_SERVER}/{build}"}, rows, workdir, processes)
    info["on_w5"] = on_w5
    with _server() as conn:
        _drop(conn, name)
        conn.execute(f'ALTER DATABASE "{build}" RENAME TO "{name}"')
        conn.execute(f'ALTER DATABASE "{name}" IS_TEMPLATE true')
        conn.execute(f"COMMENT ON DATABASE \"{name}\" IS '{json.dumps(info)}'")
    return name, info, True


def w5():
    """W5's database and its size, as compare.py keeps them between runs."""
    from compare import GROWTH_DB, SIZES

    return GROWTH_DB, SIZES["W5"]


def copy(template, db):
    """A new database `db` made from the template (FILE_COPY: a checkpoint and a file copy,
    instead of the whole database through the WAL)."""
    started = time.monotonic()
    with _server() as conn:
        _drop(conn, db)
        conn.execute(f'CREATE DATABASE "{db}" TEMPLATE "{template}" STRATEGY FILE_COPY')
        size = conn.execute("SELECT pg_database_size(%s)", [db]).fetchone()[0]
    return {"seconds": round(time.monotonic() - started, 1), "bytes": size}


def drop(db):
    with _server() as conn:
        _drop(conn, db)


def tokens(env, *subscribers):
    """New tokens for these (name, flags) subscribers (createsubscriber keeps what it has and
    issues a new token: only hashes are stored, so the template's are unknown)."""
    return {
        name: manage(env, "createsubscriber", name, *flags).strip().splitlines()[-1]
        for name, flags in subscribers
    }


def make_backlog(env, rows, workdir, processes):
    """Everything the module docstring lists, through manage.py and the REST API of a
    services-mode server. Returns the build's description."""
    started = time.monotonic()
    made_at = datetime.now(UTC).isoformat(timespec="seconds")
    manage(env, "migrate", "--noinput")
    manage(
        {**env, "DJANGO_SUPERUSER_PASSWORD": ADMIN_PASSWORD},
        "createsuperuser",
        "--noinput",
        "--username",
        ADMIN,
        "--email",
        "ops-admin@example.net",
    )
    for queue in (*QUEUES, "ops-live"):
        manage(env, "createqueue", queue)
    manage(env, "createqueue", "ops-dead", "--max-attempts", "1")
    subs = [(f"ops-sub-{k}", ["--subscribe", *QUEUES]) for k in range(SUBSCRIBERS)]
    toks = tokens(env, PUBLISHER, WATCHER, DEAD_SUBSCRIBER, *subs)
    messages = rows // SUBSCRIBERS
    timings = {}
    with services_server(env, workdir, processes) as port:
        for name, _ in subs:
            for queue in QUEUES:
                _expect(Client(port, toks[name]), "POST", "/api/subscriptions", {"queue": queue}, (201, 200))
        _expect(
            Client(port, toks["ops-watch"]), "POST", "/api/subscriptions", {"queue": "ops-live"}, (201, 200)
        )
        _expect(
            Client(port, toks["ops-deadsub"]), "POST", "/api/subscriptions", {"queue": "ops-dead"}, (201, 200)
        )
        t = time.monotonic()
        _publish(port, toks["ops-pub"], messages)
        timings["publish_s"] = round(time.monotonic() - t, 1)
        timings["publish_msgs_per_s"] = round(messages / max(timings["publish_s"], 1e-9), 1)
        _dead_letters(port, toks["ops-pub"], toks["ops-deadsub"])
    t = time.monotonic()
    with psycopg.connect(env["DATABASE_URL"], autocommit=True) as conn:
        # Weeks of running would have let autovacuum do this; a copy made before it would
        # start with fresh statistics missing and the visibility map empty.
        conn.execute("VACUUM ANALYZE")
        counts = dict(
            conn.execute("SELECT status, count(*) FROM delivery_delivery GROUP BY status").fetchall()
        )
    timings["vacuum_s"] = round(time.monotonic() - t, 1)
    return {
        "rows": rows,
        "messages": messages,
        "subscribers": SUBSCRIBERS,
        "queues": list(QUEUES),
        "deliveries_by_status": counts,
        "made_at": made_at,
        "git_commit": git("rev-parse", "HEAD"),
        "build_s": round(time.monotonic() - started, 1),
        **timings,
    }


def _expect(client, method, path, body, ok):
    status, answer = client.request(method, path, body)
    client.close()
    if status not in ok:
        raise RuntimeError(f"{method} {path} answered {status}: {answer[:500]!r}")
    return json.loads(answer) if answer else None


def _publish(port, token, messages):
    """`messages` messages in REST batches of BATCH, spread over QUEUES and EVENTS, from
    PUBLISHERS keep-alive clients at once; progress every tenth."""
    batches = [(k, min(BATCH, messages - k)) for k in range(0, messages, BATCH)]
    lock, done, errors = threading.Lock(), [0], []
    started = time.monotonic()

    def worker(mine):
        client = Client(port, token)
        for first, n in mine:
            queue = QUEUES[(first // BATCH) % len(QUEUES)]
            body = {
                "messages": [
                    {**message(i), "event": EVENTS[i % len(EVENTS)]} for i in range(first, first + n)
                ]
            }
            for attempt in range(3):
                status, answer = client.request("POST", f"/api/queues/{queue}/messages", body)
                if status == 201:
                    break
                time.sleep(1 + attempt)
            else:
                errors.append(f"batch at {first} answered {status}: {answer[:300]!r}")
                return
            with lock:
                before, done[0] = done[0], done[0] + n
                if before * 10 // messages != done[0] * 10 // messages:
                    rate = done[0] / (time.monotonic() - started)
                    print(f"  published {done[0]:,} of {messages:,} ({rate:,.0f} messages/s)", flush=True)
        client.close()

    threads = [threading.Thread(target=worker, args=(batches[k::PUBLISHERS],)) for k in range(PUBLISHERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError("; ".join(errors))


def _dead_letters(port, pub_token, dead_token):
    """DEAD messages on `ops-dead` (max_attempts 1), pulled and nacked: dead at once."""
    _expect(
        Client(port, pub_token),
        "POST",
        "/api/queues/ops-dead/messages",
        {"messages": [message(i) for i in range(DEAD)]},
        (201,),
    )
    client = Client(port, dead_token)
    got = _expect(client, "GET", f"/api/deliveries?queue=ops-dead&limit={DEAD}", None, (200,))
    for d in got["deliveries"]:
        _expect(client, "POST", f"/api/deliveries/{d['id']}/nack", {}, (200,))
    if len(got["deliveries"]) != DEAD:
        raise RuntimeError(f"pulled {len(got['deliveries'])} of the {DEAD} dead-letter messages")
