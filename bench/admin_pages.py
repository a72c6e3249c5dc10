"""Every admin page against a big backlog: 200,000 messages fanned out to 10 subscribers that
stayed away, so 2 million deliveries owed (issue 18: each page within a second).

    .venv/bin/python bench/admin_pages.py [--db mqsite_admin_big] [--repeat 3] [--only TEXT]

The database is made once (about two minutes) with INSERT ... SELECT generate_series into the
app's own tables after `migrate`, and kept: a later run only migrates it. Three queues (one
ordered), five events, 10 subscribers each subscribed to every queue (30 subscriptions), and
one delivery per message and subscription: of each thousand seqs one dead (with one webhook
attempt) and one in flight, the rest pending. Two of the subscribers have a websocket row.
FK and other triggers are off during the bulk insert (session_replication_role = replica):
the rows are consistent by construction, and the kept counts (delivery.tallies), which
triggers would have made, are counted from them afterwards (`manage.py recounttallies`).

Each page is fetched in this process with Django's test client as a logged-in superuser, once
to warm the caches and then --repeat times; the table gives the median and the worst, the
number of queries and the slowest query of the last fetch.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
import psycopg

ROOT = Path(__file__).resolve().parent.parent
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
QUEUES = [("orders", False, 100_000, ["created", "paid"]), ("audit", False, 60_000, ["login"]),
          ("mail", True, 40_000, ["send", "bounce"])]  # fmt: skip
SUBSCRIBERS = 10
CONNECTED = 2


def _server():
    return psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5)


def _migrate(url):
    env = {**os.environ, "DATABASE_URL": url}
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )


def ensure_backlog(db):
    """The database `db` with the backlog, made if missing. Returns its URL."""
    url = f"{PG_SERVER}/{db}"
    with _server() as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db]).fetchone()
        if not exists:
            conn.execute(f"CREATE DATABASE {db}")
    _migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM queues_queue WHERE name = 'orders'").fetchone():
            return url
        started = time.monotonic()
        fill(conn)
    subprocess.run(
        [sys.executable, "manage.py", "recounttallies"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url},
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"made {db} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return url


def fill(conn):
    conn.execute("SET session_replication_role = replica")
    conn.execute("SET maintenance_work_mem = '512MB'")
    with conn.transaction():  # all or nothing: a half-made backlog would be kept as made
        _insert(conn)
    for table in (
        "queues_message",
        "delivery_delivery",
        "delivery_deliveryattempt",
        "subscribers_subscription",
    ):
        conn.execute(f"VACUUM ANALYZE {table}")


def _insert(conn):
    for name, ordered, n, events in QUEUES:
        queue_id, event_ids = harness.insert_queue(conn, name, events, ordered=ordered, last_seq=n)
        # Spread over the last two days, in seq order; events take turns.
        conn.execute(
            """
            INSERT INTO queues_message (queue_id, event_id, seq, payload_json, headers_json, key,
                                        publisher_id, created_at, receipt_wanted)
            SELECT %(q)s, (%(events)s::bigint[])[1 + g %% %(n_events)s], g,
                   '{"i":' || g || ',"host":"bench-01.example.net","pad":"' || repeat('x', 120) || '"}',
                   CASE WHEN g %% 10 = 0 THEN '{"trace":"t' || g || '"}' END,
                   CASE WHEN g %% 100 = 0 THEN 'key-' || g END,
                   NULL, now() - interval '2 days' + g * interval '400 ms', false
            FROM generate_series(1, %(n)s) g
            """,
            {"q": queue_id, "events": event_ids, "n_events": len(event_ids), "n": n},
        )
    conn.execute(
        """
        INSERT INTO subscribers_subscriber (name, token_hash, token_hint, webhook_url, webhook_secret,
                                            publish_all, subscribe_all, is_active, created_at)
        SELECT 'away-' || k, encode(sha256(('away-' || k)::bytea), 'hex'), 'mq_away' || k, '',
               md5(k::text), false, true, true, now() - interval '3 days'
        FROM generate_series(0, %s) k
        """,
        [SUBSCRIBERS - 1],
    )
    conn.execute(
        "INSERT INTO subscribers_subscription (subscriber_id, queue_id, event_id, created_at)"
        " SELECT s.id, q.id, NULL, now() - interval '3 days'"
        " FROM subscribers_subscriber s CROSS JOIN queues_queue q ORDER BY s.id, q.id"
    )
    conn.execute(
        "INSERT INTO subscribers_connection"
        " (subscriber_id, channel_name, remote_addr, connected_at, last_seen)"
        " SELECT id, 'bench.conn!' || id, '127.0.0.1', now(), now() FROM subscribers_subscriber"
        " ORDER BY id LIMIT %s",
        [CONNECTED],
    )
    conn.execute(
        """
        INSERT INTO delivery_delivery
            (subscription_id, subscriber_id, message_id, queue_id, event_id, seq, status, attempt,
             next_attempt_at, ack_deadline, lease_holder, created_at, delivered_at, acked_at,
             last_error, receipt)
        SELECT s.id, s.subscriber_id, m.id, m.queue_id, m.event_id, m.seq,
               CASE m.seq % 1000 WHEN 0 THEN 'dead' WHEN 1 THEN 'inflight' ELSE 'pending' END,
               CASE m.seq % 1000 WHEN 0 THEN 10 WHEN 1 THEN 1 ELSE 0 END,
               m.created_at,
               CASE WHEN m.seq % 1000 = 1 THEN now() + interval '1 day' END,
               '', m.created_at,
               CASE WHEN m.seq % 1000 IN (0, 1) THEN m.created_at + interval '1 s' END,
               NULL,
               CASE WHEN m.seq % 1000 = 0 THEN 'HTTP 500 from the webhook' ELSE '' END,
               false
        FROM queues_message m JOIN subscribers_subscription s ON s.queue_id = m.queue_id
        ORDER BY m.queue_id, m.seq, s.id
        """
    )
    conn.execute(
        "INSERT INTO delivery_deliveryattempt (delivery_id, number, at, ok, status_code, error,"
        " duration_ms, permanent)"
        " SELECT id, 10, delivered_at, false, 500, 'HTTP 500', 12, false FROM delivery_delivery"
        " WHERE status = 'dead'"
    )


def pages():
    """(label, url) of every changelist and change page, and the filters and sorts they offer."""
    from django.contrib import admin
    from django.urls import reverse

    from delivery.models import DeadLetter, Delivery
    from queues.models import Event, Message, Queue
    from subscribers.models import Connection, Subscriber, Subscription

    found = [
        ("admin index", reverse("admin:index")),
        ("head of line tool", reverse("mq-head-of-line")),
    ]
    samples = {
        Queue: Queue.objects.get(name="orders"),
        Event: Event.objects.filter(queue__name="orders").first(),
        Message: Message.objects.order_by("-id").first(),
        Subscriber: Subscriber.objects.order_by("id").first(),
        Subscription: Subscription.objects.order_by("id").first(),
        Connection: Connection.objects.order_by("id").first(),
        Delivery: Delivery.objects.filter(status="pending").order_by("-id").first(),
        DeadLetter: DeadLetter.objects.filter(status="dead").order_by("-id").first(),
    }
    subscriber = samples[Subscriber]
    queue = samples[Queue]
    found.append(
        ("head of line tool ?subscriber", f"{reverse('mq-head-of-line')}?subscriber={subscriber.pk}")
    )
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        name = opts.model_name
        found.append((f"{name} list", changelist))
        if model in (Delivery, DeadLetter, Message, Subscriber, Subscription, Connection, Queue, Event):
            # Every column the list offers to sort by, both ways.
            request = None
            sortable = model_admin.get_sortable_by(request) if hasattr(model_admin, "get_sortable_by") else ()
            for i, column in enumerate(model_admin.list_display):
                if column not in sortable or column == "action_checkbox":
                    continue
                found.append((f"{name} list sorted by {column}", f"{changelist}?o={i}"))
                found.append((f"{name} list sorted by -{column}", f"{changelist}?o=-{i}"))
        if model in (Delivery, DeadLetter):
            found += [
                (f"{name} list ?subscriber", f"{changelist}?subscriber__id__exact={subscriber.pk}"),
                (f"{name} list ?queue", f"{changelist}?queue__id__exact={queue.pk}"),
                (f"{name} list ?event", f"{changelist}?event={samples[Event].pk}"),
                (f"{name} list page 50", f"{changelist}?p=50"),
                (f"{name} list search message id", f"{changelist}?q={samples[Message].pk}"),
                (f"{name} list search subscriber name", f"{changelist}?q=away-3"),
            ]
        if model is Delivery:
            for status in ("pending", "inflight", "dead", "acked"):
                found.append((f"{name} list ?status={status}", f"{changelist}?status__exact={status}"))
            found.append(
                (
                    f"{name} list ?subscriber&status=pending",
                    f"{changelist}?subscriber__id__exact={subscriber.pk}&status__exact=pending",
                )
            )
        if model is Message:
            found += [
                (f"{name} list ?queue", f"{changelist}?queue__id__exact={queue.pk}"),
                (f"{name} list ?event", f"{changelist}?event={samples[Event].pk}"),
                (f"{name} list ?publisher", f"{changelist}?publisher__id__exact={subscriber.pk}"),
                (f"{name} list page 50", f"{changelist}?p=50"),
                (f"{name} list search key", f"{changelist}?q=key-500"),
                (f"{name} list search header", f"{changelist}?q=trace%3Dt500"),
            ]
        sample = samples.get(model)
        if sample is not None:
            found.append(
                (
                    f"{name} page",
                    reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[sample.pk]),
                )
            )
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="mqsite_admin_big")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="time only pages whose label contains this")
    parser.add_argument("--no-sorts", action="store_true", help="skip the lists sorted by each column")
    args = parser.parse_args()
    url = ensure_backlog(args.db)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    user, _ = get_user_model().objects.get_or_create(
        username="bench-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client(HTTP_HOST="localhost")
    client.force_login(user)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    print(f"{'page':<55} {'median s':>8} {'worst s':>8} {'queries':>7} {'slowest q s':>11}")
    slow = []
    for label, path in pages():
        if (args.only and args.only not in label) or (args.no_sorts and " sorted by " in label):
            continue
        times = []
        for k in range(args.repeat + 1):
            with CaptureQueriesContext(connection) as queries:
                t = time.perf_counter()
                response = client.get(path)
                elapsed = time.perf_counter() - t
            if response.status_code != 200:
                print(f"{label}: HTTP {response.status_code} at {path}")
                break
            if k:
                times.append(elapsed)
        if not times:
            continue
        slowest = max(
            queries.captured_queries, key=lambda q: float(q["time"]), default={"time": "0", "sql": ""}
        )
        median = statistics.median(times)
        flag = " !" if median > 1 else ""
        print(
            f"{label:<55} {median:8.3f} {max(times):8.3f} {len(queries.captured_queries):7d} "
            f"{float(slowest['time']):11.3f}{flag}"
        )
        if float(slowest["time"]) > 0.5:
            slow.append((label, path, slowest))
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for label, path, q in slow:
        print(f"\n--- {label} ({path}): slowest query {q['time']} s\n{q['sql'][:600]}")


if __name__ == "__main__":
    main()
