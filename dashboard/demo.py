"""The demo: what a newcomer's first `make run` holds, and traffic to watch on the dashboard.

`seed_if_fresh()` (run by `manage.py bootstrap`, only while no queue exists) makes the
seeds' use case: the queues db, filesystem and network, and three subscribers:
logger (every event of db and filesystem), dashboard (db/create) and monitor (db/create and
network/error). `DemoTraffic` (run by `manage.py demo`) publishes a few realistic messages a
second to those queues and, as those subscribers, takes, acks and now and then nacks what they
get, so that counters move, deliveries flow and the odd malformed report ends up dead.

Beside a running server (`make run`) the demo subscribers are its real clients, with the
tokens bootstrap kept in var/demo_tokens: the dashboard and the monitor keep a websocket open
to /ws/ (so the dashboard's connected clients, the admin's "Connected now" and
/api/connections show them), the logger pulls over REST, and messages are published over REST.
Only a subscriber the server cannot be used for (no server answers, no token, a token it
refuses) is served in this process, through the ledger, as the API would.
"""

import json
import os
import random
import secrets
import threading
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import quote

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from delivery import ledger
from delivery.models import Delivery, Status
from queues import publishing
from queues.models import Queue
from subscribers import subscribing
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber

# network keeps 3 attempts: a malformed error report (which the monitor refuses) is dead
# within seconds, so the dead letters and their redeliver button have something to show.
QUEUES = {"db": {}, "filesystem": {}, "network": {"max_attempts": 3}}
# name: [(queue, event or None for every event)]
SUBSCRIBERS = {
    "logger": [("db", None), ("filesystem", None)],
    "dashboard": [("db", "create")],
    "monitor": [("db", "create"), ("network", "error")],
}
# How long each demo subscriber "works" on a message before it acks it, in seconds: gives
# the latency chart and the in-flight counts something real to show.
WORK_SECS = {"logger": (0.05, 0.4), "dashboard": (0.1, 0.8), "monitor": (0.5, 3.0)}


def tokens_file():
    return Path(settings.VAR_DIR) / "demo_tokens"


def seed_if_fresh():
    """Seed the demo queues, subscribers and subscriptions if no queue exists yet.

    Returns {subscriber: token} for the subscribers it made (their tokens are written to
    var/demo_tokens, readable by its owner only), or None when there was something already.
    """
    with transaction.atomic():
        if Queue.objects.exists():
            return None
        queues = {name: Queue.objects.create(name=name, **fields) for name, fields in QUEUES.items()}
        tokens = {}
        for name, wants in SUBSCRIBERS.items():
            names = sorted({q for q, _ in wants})
            subscriber = Subscriber.objects.filter(name=name).first()
            if subscriber is None:
                subscriber, tokens[name] = create_subscriber(name, publish=names, subscribe=names)
            else:  # one of that name was made by hand before any queue: keep its token
                subscriber.subscribe_queues.add(*(queues[q] for q in names))
            for queue, event in wants:
                subscribing.subscribe(subscriber, queues[queue], event)
    if tokens:
        _write_private(tokens_file(), "".join(f"{name} {token}\n" for name, token in tokens.items()))
    return tokens


def _write_private(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# --- traffic -------------------------------------------------------------------------------------

TABLES = ["users", "orders", "invoices", "sessions"]
NAMES = ["Ann", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun"]
FOLDERS = ["/var/www/uploads", "/srv/backups", "/home/ann/reports", "/data/exports"]
HOSTS = ["api.internal", "db-1.internal", "cache-2.internal", "10.0.3.17", "mail.internal"]
ERRORS = ["ECONNRESET", "ETIMEDOUT", "ECONNREFUSED", "TLS handshake failed", "502 from upstream"]


# Why the monitor refuses a report: the reason its nacks give (the `error` of a nack), which the
# dead letter shows.
POISON_ERROR = "monitor: malformed error report"


def is_poison(payload):
    return isinstance(payload, dict) and payload.get("malformed") is True


def trace_headers():
    """A W3C trace context, as a traced service would send beside its payload (the feed shows
    it). Not from the demo's rng: the traffic stays the same for a seed."""
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}


class DemoTraffic:
    """Publishes and consumes the demo's messages. Not thread-safe: one loop drives it.

    By default it publishes through queues.publishing and serves every demo subscriber here,
    through the ledger. `use_server()` moves publishing and the subscribers to a running
    server, as its clients."""

    def __init__(self, rate=4.0, poison_every=25, rng=None):
        self.rate = rate
        self.poison_every = poison_every
        self.rng = rng or random.Random()
        self.queues = {q.name: q for q in Queue.objects.filter(name__in=QUEUES)}
        self.subscribers = list(Subscriber.objects.filter(name__in=SUBSCRIBERS, is_active=True))
        self.local = list(self.subscribers)  # those served here, through the ledger
        self.clients = []  # those served by the running server (RemoteSubscriber threads)
        self.server = None
        self.publish_tokens = {}  # queue name -> the token it is published with, over REST
        self.publish_error = ""
        self.held = []  # (due monotonic time, subscriber, delivery id, poison)
        self.credit = 0.0
        self.published = self.acked = self.nacked = 0
        self.ids = defaultdict(int)

    def use_server(self, server, tokens):
        """Let the running server carry the demo: each demo subscriber whose token it takes
        becomes its client (TRANSPORTS says how), and each queue one of them may publish to
        is published to over REST. Returns notes on what stays here, and why."""
        notes = []
        self.server, self.local = server, []
        for subscriber in self.subscribers:
            token = tokens.get(subscriber.name)
            why = "" if token else f"no token for it in {tokens_file()}"
            if token and not server.takes_token(token):
                why = f"the server refuses its token in {tokens_file()} (was a new one issued?)"
            if why:
                notes.append(f"{subscriber.name} is served here, through the ledger: {why}")
                self.local.append(subscriber)
                continue
            client = CLIENTS[TRANSPORTS.get(subscriber.name, "websocket")]
            self.clients.append(client(subscriber.name, server, token, random.Random(self.rng.random())))
            for name, queue in self.queues.items():
                if name not in self.publish_tokens and subscriber.may_publish(queue):
                    self.publish_tokens[name] = token
        for client in self.clients:
            client.start()
        return notes

    def transports(self):
        """{subscriber name: how it takes its deliveries}."""
        found = {s.name: "ledger" for s in self.local}
        found.update({c.subscriber_name: c.transport for c in self.clients})
        return dict(sorted(found.items()))

    # What happened, in the words each queue's services would use.
    def _message(self):
        rng = self.rng
        self.ids["n"] += 1
        n = self.ids["n"]
        kind = rng.random()
        if kind < 0.55 and "db" in self.queues:
            event = rng.choices(["create", "update", "delete"], weights=[5, 3, 1])[0]
            table = rng.choice(TABLES)
            payload = {"table": table, "id": 1000 + n, "by": rng.choice(NAMES)}
            if event != "delete":
                payload["fields"] = rng.sample(["name", "email", "status", "total", "address"], k=2)
            return "db", event, payload
        if kind < 0.8 and "filesystem" in self.queues:
            event = rng.choices(["create", "modify", "delete"], weights=[3, 4, 1])[0]
            path = f"{rng.choice(FOLDERS)}/file-{n:05d}.{rng.choice(['csv', 'pdf', 'json', 'png'])}"
            return "filesystem", event, {"path": path, "bytes": rng.randint(200, 5_000_000)}
        if "network" in self.queues:
            if rng.random() < 0.5:
                return (
                    "network",
                    "connect",
                    {"host": rng.choice(HOSTS), "port": rng.choice([443, 5432, 6379])},
                )
            payload = {"host": rng.choice(HOSTS), "error": rng.choice(ERRORS), "retries": rng.randint(0, 3)}
            if self.poison_every and n % self.poison_every == 0:
                payload = {"host": rng.choice(HOSTS), "error": None, "malformed": True}
            return "network", "error", payload
        return None

    def publish(self, count):
        """Publish `count` messages (fewer if the demo queues are gone, or the server does not
        take them), one batch per queue. Returns how many were published."""
        batches = defaultdict(list)
        for _ in range(count):
            made = self._message()
            if made is not None:
                queue, event, payload = made
                batches[queue].append((event, payload))
        published = 0
        for queue, messages in batches.items():
            token = self.publish_tokens.get(queue)
            if token is None:
                publishing.publish(
                    self.queues[queue],
                    [publishing.prepare(e, p, headers=trace_headers()) for e, p in messages],
                )
            elif not self._publish_over_rest(queue, token, messages):
                continue  # lost: the demo goes on, and says why in its report
            published += len(messages)
        self.published += published
        return published

    def _publish_over_rest(self, queue, token, messages):
        body = {"messages": [{"event": e, "payload": p, "headers": trace_headers()} for e, p in messages]}
        try:
            r = self.server.post(f"/api/queues/{queue}/messages", token, body)
        except httpx.HTTPError as exc:
            self.publish_error = f"publishing to {queue}: {exc or type(exc).__name__}"
            return False
        if r.status_code != 201:
            self.publish_error = f"publishing to {queue}: the server answered {r.status_code} {r.text[:200]}"
            return False
        self.publish_error = ""
        return True

    def publish_due(self, elapsed_secs, limit=None):
        """Publish what the rate owes for `elapsed_secs` (at most `limit`)."""
        self.credit += self.rate * elapsed_secs
        count = int(self.credit)
        if limit is not None:
            count = min(count, limit)
        self.credit -= count
        return self.publish(count) if count else 0

    def consume(self, now=None):
        """Each demo subscriber served here leases what is ready, works on it a moment, then
        acks it (the monitor nacks a malformed report: it is retried and, after the queue's
        last attempt, dead). Returns how many were acked in this call."""
        now = time.monotonic() if now is None else now
        for subscriber in self.local:
            leased = ledger.lease_deliveries(subscriber, limit=50, holder=f"demo:{subscriber.name}")
            low, high = WORK_SECS.get(subscriber.name, (0.1, 0.5))
            for d in leased:
                due = now + self.rng.uniform(low, high)
                self.held.append((due, subscriber, d["id"], is_poison(d["payload"])))
        return self._settle(lambda due: due <= now)

    def settle_all(self):
        """The demo is stopping: ack (or nack) everything held now, here and by the clients
        of the server, which then close."""
        for client in self.clients:
            client.stop()
        for client in self.clients:
            client.join(timeout=15)
        return self._settle(lambda due: True)

    def _settle(self, is_due):
        due = [h for h in self.held if is_due(h[0])]
        self.held = [h for h in self.held if not is_due(h[0])]
        acks = defaultdict(list)
        for _, subscriber, delivery_id, poison in due:
            if poison:
                try:
                    ledger.nack_delivery(subscriber, delivery_id, error=POISON_ERROR)
                    self.nacked += 1
                except (ledger.NotOwned, ledger.AlreadySettled):
                    pass
            else:
                acks[subscriber].append(delivery_id)
        acked = 0
        for subscriber, ids in acks.items():
            acked += ledger.ack_deliveries(subscriber, ids)[0]
        self.acked += acked
        return acked

    def owed(self):
        """Deliveries of the demo subscribers not settled yet (pending or in flight), wherever
        they are served."""
        return Delivery.objects.filter(
            subscriber__in=self.subscribers, status__in=(Status.PENDING, Status.INFLIGHT)
        ).count()

    def troubles(self):
        """What keeps the demo from the server now, in words: one line each ([] when none)."""
        found = [self.publish_error] if self.publish_error else []
        return found + [f"{c.subscriber_name}: {c.trouble}" for c in self.clients if c.trouble]

    def summary(self):
        return {
            "published": self.published,
            "acked": self.acked + sum(c.acked for c in self.clients),
            "nacked": self.nacked + sum(c.nacked for c in self.clients),
            "via": self.transports(),
            "at": timezone.now(),
        }


# --- the demo subscribers as clients of the running server ---------------------------------------

# How each demo subscriber takes its deliveries from a running server: the dashboard and the
# monitor keep a websocket open (they show as connected), the logger pulls over REST.
TRANSPORTS = {"dashboard": "websocket", "monitor": "websocket", "logger": "pull"}
# How long a client sleeps before it tries again after the server went away.
RECONNECT_SECS = 1.0
# The longest a client waits in one recv or long poll: how soon it notices it is to stop.
POLL_SECS = 0.5


def read_tokens():
    """{subscriber name: token}, as bootstrap wrote them to var/demo_tokens ({} without it)."""
    try:
        text = tokens_file().read_text()
    except FileNotFoundError:
        return {}
    return dict(line.split(maxsplit=1) for line in text.splitlines() if len(line.split()) == 2)


class DemoServer:
    """The running server at `url` (http://127.0.0.1:$PORT beside `make run`)."""

    def __init__(self, url):
        self.http = url.rstrip("/")
        self.ws = "ws" + self.http.removeprefix("http") + "/ws/"
        # No proxy from the environment: the demo talks to a server beside it.
        self.client = httpx.Client(base_url=self.http, timeout=10, trust_env=False)

    def unreachable(self):
        """Why the server cannot be used now, in words; "" when its /healthz answers ok."""
        try:
            r = self.client.get("/healthz", timeout=3)
        except httpx.HTTPError as exc:
            return f"nothing answers at {self.http} ({exc or type(exc).__name__})"
        if r.status_code != 200:
            return f"{self.http}/healthz answers {r.status_code}"
        return ""

    def takes_token(self, token):
        return self.get("/api/subscriptions", token).status_code == 200

    def get(self, path, token, **params):
        return self.client.get(path, params=params, headers=self._auth(token))

    def post(self, path, token, body, timeout=10):
        return self.client.post(path, json=body, headers=self._auth(token), timeout=timeout)

    @staticmethod
    def _auth(token):
        return {"Authorization": f"Bearer {token}"}


class Refused(Exception):
    """The server refuses the client's token: trying again would not help."""


class RemoteSubscriber(threading.Thread):
    """A demo subscriber as a real client of the server, in a thread of its own: it takes its
    deliveries, "works" on each a moment (WORK_SECS), then acks it, or nacks a malformed
    report. When the server goes away it tries again every RECONNECT_SECS; `stop()` settles
    what it holds and ends it. It touches no database: only the server does."""

    transport = ""

    def __init__(self, name, server, token, rng):
        super().__init__(name=f"demo-{name}", daemon=True)
        self.subscriber_name, self.server, self.token, self.rng = name, server, token, rng
        self.work_secs = WORK_SECS.get(name, (0.1, 0.5))
        self.held = []  # (due monotonic time, delivery id, poison)
        self.acked = self.nacked = 0
        self.trouble = ""  # what went wrong last, until it works again
        self.stopping = threading.Event()

    def stop(self):
        self.stopping.set()

    def run(self):
        while not self.stopping.is_set():
            try:
                self.serve()
            except Refused as exc:
                self.trouble = str(exc)
                return
            except Exception as exc:  # the server went away, or answered what it should not
                self.trouble = f"{type(exc).__name__}: {exc}"
                self.stopping.wait(RECONNECT_SECS)

    def take(self, deliveries):
        now = time.monotonic()
        for d in deliveries:
            self.held.append((now + self.rng.uniform(*self.work_secs), d["id"], is_poison(d["payload"])))

    def due(self, everything=False):
        """(ids to ack, ids to nack) among those held whose work is done, no longer held."""
        now = time.monotonic()
        done = [h for h in self.held if everything or h[0] <= now]
        self.held = [h for h in self.held if not (everything or h[0] <= now)]
        return [i for _, i, poison in done if not poison], [i for _, i, poison in done if poison]

    def next_due_in(self, most):
        """Seconds until the next held delivery is done, at most `most`."""
        if not self.held:
            return most
        return min(max(min(h[0] for h in self.held) - time.monotonic(), 0.0), most)


class WebsocketSubscriber(RemoteSubscriber):
    """On a websocket to /ws/: every subscription of the subscriber resumes on connect, and
    what the socket held unacked goes back to pending when it closes."""

    transport = "websocket"

    def serve(self):
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        url = f"{self.server.ws}?token={quote(self.token)}"
        try:
            with connect(url, proxy=None, open_timeout=5, close_timeout=2) as ws:
                self.held = []  # a new socket: what an old one held went back when it closed
                self.trouble = ""
                while not self.stopping.is_set():
                    self.settle(ws, *self.due())
                    try:
                        frame = json.loads(ws.recv(timeout=self.next_due_in(POLL_SECS)))
                    except TimeoutError:
                        continue
                    if frame.get("type") == "message":
                        self.take([frame])
                    elif frame.get("type") == "error":
                        self.trouble = f"the server said {frame.get('code')}: {frame.get('detail')}"
                self.settle(ws, *self.due(everything=True))
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == 4401:
                raise Refused("the server refuses its token") from None
            raise

    def settle(self, ws, acks, nacks):
        if acks:
            ws.send(json.dumps({"type": "ack", "ids": acks}))
            self.acked += len(acks)
        if nacks:
            ws.send(json.dumps({"type": "nack", "ids": nacks, "error": POISON_ERROR}))
            self.nacked += len(nacks)


class PullingSubscriber(RemoteSubscriber):
    """Over REST: long-polls GET /api/deliveries, acks with POST /api/deliveries/ack."""

    transport = "pull"

    def serve(self):
        while not self.stopping.is_set():
            self.settle(*self.due())
            r = self.server.get(
                "/api/deliveries", self.token, limit=50, wait=round(self.next_due_in(POLL_SECS), 2)
            )
            self.check(r, "GET /api/deliveries")
            self.trouble = ""
            self.take(r.json()["deliveries"])
        self.settle(*self.due(everything=True))

    def settle(self, acks, nacks):
        if acks:
            r = self.server.post("/api/deliveries/ack", self.token, {"ids": acks})
            self.check(r, "POST /api/deliveries/ack")
            self.acked += r.json()["acked"]
        for delivery_id in nacks:
            r = self.server.post(f"/api/deliveries/{delivery_id}/nack", self.token, {"error": POISON_ERROR})
            if r.status_code not in (404, 409):  # gone, or settled since: nothing to give back
                self.check(r, "POST /api/deliveries/{id}/nack")
                self.nacked += 1

    @staticmethod
    def check(r, call):
        if r.status_code == 401:
            raise Refused("the server refuses its token")
        if r.status_code != 200:
            raise RuntimeError(f"{call} answered {r.status_code} {r.text[:200]}")


CLIENTS = {"websocket": WebsocketSubscriber, "pull": PullingSubscriber}
