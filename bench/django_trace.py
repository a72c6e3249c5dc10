"""Round trips and query plans of the hot paths, inside the app's own Django.

Run by profile_server.py against a PostgreSQL database (the W5 one, with 10 million delivery
rows): for each operation (a REST publish, a batch of 100, a lease of 100, an ack of 100, the
websocket's publish, lease and ack, an idle socket's recheck, a websocket connect) it counts
the round trips to PostgreSQL with libpq's protocol trace (every Sync of the extended protocol
and every simple Query, BEGIN and COMMIT included), keeps the SQL, and then runs
EXPLAIN (ANALYZE, BUFFERS) on each statement inside a transaction that is rolled back.

To count one connection's round trips, the pool is left out here (one persistent connection,
CONN_MAX_AGE=None); the statements are the app's own. Prints one JSON object.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
os.environ["MQ_THROTTLE_RATE"] = "1000000/s"

from django.conf import settings  # noqa: E402

settings.DATABASES["default"].get("OPTIONS", {}).pop("pool", None)
settings.DATABASES["default"]["CONN_MAX_AGE"] = None

import django  # noqa: E402

django.setup()

from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402
from psycopg.pq import Trace as TraceFlags  # noqa: E402

from delivery import ledger, presence, publishing, subscribing  # noqa: E402
from queues import lookup  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.auth import subscriber_for_token  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402

PAYLOAD = {"i": 1, "host": "bench-01.example.net", "path": "/srv/bench/00000001.dat", "pad": "x" * 120}


class Trace:
    """libpq's trace of the Django connection while the block runs: the round trips."""

    def __enter__(self):
        connection.ensure_connection()
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".pqtrace")
        self.pgconn = connection.connection.pgconn
        self.pgconn.trace(self.file.fileno())
        self.pgconn.set_trace_flags(TraceFlags.SUPPRESS_TIMESTAMPS | TraceFlags.REGRESS_MODE)
        self.queries = CaptureQueriesContext(connection)
        self.queries.__enter__()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        self.queries.__exit__(*exc)
        self.pgconn.untrace()
        self.file.seek(0)
        lines = [ln.split("\t") for ln in self.file.read().splitlines()]
        self.file.close()
        sent = [ln[2].split(" ")[0] if len(ln) > 2 else "" for ln in lines if len(ln) > 1 and ln[0] == "F"]
        self.syncs = sent.count("Sync")
        self.simple = [
            ln[3] if len(ln) > 3 else ""
            for ln in lines
            if len(ln) > 2 and ln[0] == "F" and ln[2].startswith("Query")
        ]
        self.round_trips = self.syncs + len(self.simple)
        return False

    def report(self):
        return {
            "round_trips": self.round_trips,
            "statements": [q["sql"] for q in self.queries.captured_queries],
            "simple_queries": [s[:60] for s in self.simple],
            "ms": round(self.seconds * 1000, 2),
        }


DML = ("SELECT", "UPDATE", "INSERT", "DELETE", "WITH")


class _Rollback(Exception):
    def __init__(self, value):
        self.value = value


def captured_rolled_back(fn):
    """The statements `fn` runs, inside a transaction that is then rolled back."""
    try:
        with transaction.atomic():
            with CaptureQueriesContext(connection) as q:
                fn()
            raise _Rollback([x["sql"] for x in q.captured_queries])
    except _Rollback as rb:
        return rb.value


def explain_all(statements):
    """EXPLAIN (ANALYZE, BUFFERS) of each statement in order, in one transaction rolled back at
    the end: each runs for real (an UPDATE updates), so the later ones see what the earlier did."""
    plans = []
    try:
        with transaction.atomic():
            for sql in statements:
                if sql.lstrip().split(None, 1)[0].upper() not in DML:
                    continue
                try:
                    with transaction.atomic(), connection.cursor() as cursor:
                        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}")
                        plan = "\n".join(r[0] for r in cursor.fetchall())
                except Exception as exc:
                    plan = f"(could not explain: {exc})"
                plans.append({"sql": sql, "plan": plan})
            raise _Rollback(plans)
    except _Rollback as rb:
        return rb.value


def main():
    stamp = str(int(time.time()))
    queue, _ = Queue.objects.get_or_create(name=f"trace-{stamp}")
    sub, token = create_subscriber(f"trace-{stamp}", publish=["*"], subscribe=["*"])
    subscribing.subscribe(sub, queue)
    idle, _ = create_subscriber(f"trace-idle-{stamp}", subscribe=["*"])
    idle_queue, _ = Queue.objects.get_or_create(name=f"trace-idle-{stamp}")
    subscribing.subscribe(idle, idle_queue)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_HOST="127.0.0.1")
    path = f"/api/queues/{queue.name}/messages"
    # A backlog to lease from, and a warm connection and caches.
    for _ in range(10):
        r = client.post(
            path,
            {"messages": [{"event": "create", "payload": PAYLOAD}] * 100},
            content_type="application/json",
        )
        assert r.status_code == 201, r.content
    ops = {}

    with Trace() as t:
        r = client.post(path, {"event": "create", "payload": PAYLOAD}, content_type="application/json")
    assert r.status_code == 201, r.content
    ops["rest_publish_one"] = t.report()

    with Trace() as t:
        r = client.post(
            path,
            {"messages": [{"event": "create", "payload": PAYLOAD}] * 100},
            content_type="application/json",
        )
    assert r.status_code == 201
    ops["rest_publish_batch_100"] = t.report()

    with Trace() as t:
        r = client.get("/api/deliveries", {"limit": 100})
    assert r.status_code == 200
    ids = [d["id"] for d in r.json()["deliveries"]]
    ops["rest_lease_100"] = t.report() | {"leased": len(ids)}

    with Trace() as t:
        r = client.post("/api/deliveries/ack", {"ids": ids}, content_type="application/json")
    assert r.status_code == 200 and r.json()["acked"] == len(ids), r.content
    ops["rest_ack_100"] = t.report()

    # The websocket consumer's calls, as delivery/consumers.py makes them (one db() call each).
    def ws_publish():
        q = lookup.find_queue(queue.name)
        assert sub.may_publish(q)
        return publishing.publish(q, [publishing.prepare("create", PAYLOAD)], publisher=sub)

    with Trace() as t:
        ws_publish()
    ops["ws_publish_one"] = t.report()

    with Trace() as t:
        leased = ledger.lease_deliveries(sub, limit=100, holder="specific.trace!x")
    ops["ws_lease_100"] = t.report() | {"leased": len(leased)}

    with Trace() as t:
        ledger.ack_deliveries(sub, [d["id"] for d in leased])
    ops["ws_ack_100"] = t.report()

    with Trace() as t:
        leased = ledger.lease_deliveries(sub, limit=1, holder="specific.trace!x")
    ops["ws_lease_1"] = t.report()
    ledger.ack_deliveries(sub, [d["id"] for d in leased])

    with Trace() as t:
        ledger.lease_deliveries(idle, limit=100, holder="specific.trace!idle")
    ops["idle_recheck"] = t.report()

    with Trace() as t:
        s = subscriber_for_token(token)
        presence.open_connection(s, "specific.trace!conn", "127.0.0.1")
        ledger.lease_deliveries(s, limit=0, holder="specific.trace!conn")
    ops["ws_connect"] = t.report()
    presence.close_connection("specific.trace!conn")

    # The plans: each operation again inside a transaction that is rolled back (so that its
    # INSERTs can run once more), then EXPLAIN ANALYZE of its statements in order.
    def rest(method, url, body=None):
        def call():
            if method == "get":
                return client.get(url, body)
            return client.post(url, body, content_type="application/json")

        return call

    one = {"event": "create", "payload": PAYLOAD}
    fresh = [d["id"] for d in ledger.lease_deliveries(sub, limit=100, holder="specific.trace!plans")]
    runs = {
        "rest_publish_one": rest("post", path, one),
        "rest_publish_batch_100": rest("post", path, {"messages": [one] * 100}),
        "rest_lease_100": rest("get", "/api/deliveries", {"limit": 100}),
        "rest_ack_100": rest("post", "/api/deliveries/ack", {"ids": fresh}),
        "idle_recheck": lambda: ledger.lease_deliveries(idle, limit=100, holder="specific.trace!idle"),
    }
    # The same on the W5 history: a queue of a million messages and ten subscribers with a
    # million deliveries each (90 % acked, 10 % pending).
    history = Queue.objects.filter(name="history").first()
    if history is not None:
        hist = history.subscriptions.select_related("subscriber").order_by("id").first().subscriber
        held = [d["id"] for d in ledger.lease_deliveries(hist, limit=100, holder="specific.trace!hist")]
        runs |= {
            "history_publish_one": lambda: publishing.publish(
                history, [publishing.prepare("create", PAYLOAD)]
            ),
            "history_lease_100": lambda: ledger.lease_deliveries(hist, limit=100, holder="specific.trace!h2"),
            "history_ack_100": lambda: ledger.ack_deliveries(hist, held),
            "history_idle_recheck": lambda: ledger._subscriptions(hist, history, None, timezone.now()),
        }
    plans = {name: explain_all(captured_rolled_back(fn)) for name, fn in runs.items()}
    if history is not None:
        ledger.release_held(["specific.trace!hist"])
    ledger.release_held(["specific.trace!plans"])
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM delivery_delivery")
        rows = cursor.fetchone()[0]
        cursor.execute("SELECT pg_size_pretty(pg_total_relation_size('delivery_delivery'))")
        size = cursor.fetchone()[0]
    print(json.dumps({"delivery_rows": rows, "delivery_table_size": size, "ops": ops, "plans": plans}))


if __name__ == "__main__":
    main()
