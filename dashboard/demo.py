"""The demo: what a newcomer's first `make run` holds, and traffic to watch on the dashboard.

`seed_if_fresh()` (run by `manage.py bootstrap`, only while no queue exists) makes the
seeds' use case: the queues db, filesystem and network, and three subscribers:
logger (every event of db and filesystem), dashboard (db/create) and monitor (db/create and
network/error). `DemoTraffic` (run by `manage.py demo`) publishes a few realistic messages a
second to those queues and, as those subscribers, takes, acks and now and then nacks what they
get, so that counters move, deliveries flow and the odd malformed report ends up dead.

Beside a running server (`make run`) the demo subscribers are its real clients, through the
client library mqclient (clients/python), with the tokens bootstrap kept in var/demo_tokens:
the dashboard and the monitor listen() on websockets to /ws/ (so the dashboard's connected
clients, the admin's "Connected now" and /api/connections show them), the logger pulls over
REST, and messages are published over REST.
Only a subscriber the server cannot be used for (no server answers, no token, a token it
refuses) is served in this process, through the ledger, as the API would.
"""

import contextlib
import random
import secrets
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import mqclient
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery
from mqsite.private_files import write_private
from queues.models import Queue
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
        write_private(tokens_file(), "".join(f"{name} {token}\n" for name, token in tokens.items()))
    return tokens


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

    By default it publishes through delivery.publishing and serves every demo subscriber here,
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
            for _ in range(WORKERS.get(subscriber.name, 1) if client.transport == "websocket" else 1):
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
                try:
                    publishing.publish(
                        self.queues[queue],
                        [publishing.prepare(e, p, headers=trace_headers()) for e, p in messages],
                    )
                except publishing.SchemaMismatch as exc:  # an operator gave a demo event a schema
                    self.publish_error = f"publishing to {queue}: {exc}"
                    continue
            elif not self._publish_over_rest(queue, token, messages):
                continue  # lost: the demo goes on, and says why in its report
            published += len(messages)
        self.published += published
        return published

    def _publish_over_rest(self, queue, token, messages):
        items = [{"event": e, "payload": p, "headers": trace_headers()} for e, p in messages]
        try:
            self.server.publish(queue, token, items)
        except mqclient.MQError as exc:
            self.publish_error = f"publishing to {queue}: {exc}"
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
        return Delivery.objects.filter(subscriber__in=self.subscribers).open().count()

    def troubles(self):
        """What keeps the demo from the server now, in words: one line each ([] when none)."""
        found = [self.publish_error] if self.publish_error else []
        return found + sorted({f"{c.subscriber_name}: {c.trouble}" for c in self.clients if c.trouble})

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
# monitor listen on websockets (they show as connected), the logger pulls over REST. All of it
# through the client library, mqclient (clients/python), as a user's program would.
TRANSPORTS = {"dashboard": "websocket", "monitor": "websocket", "logger": "pull"}
# Sockets per listening subscriber: a handler works on one delivery at a time, so the monitor,
# which works longest, runs two workers that share its stream (as a service scales out).
WORKERS = {"monitor": 2}
# Deliveries a listening worker holds at once (the socket's window): no more than it works on
# soon, so that the other worker and the dashboard's in-flight counts see a fair share.
PREFETCH = 5
# How long the puller sleeps before it tries again after the server went away.
RECONNECT_SECS = 1.0
# The longest the puller waits in one long poll: how soon it notices it is to stop.
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

    def unreachable(self):
        """Why the server cannot be used now, in words; "" when its /healthz answers ok."""
        try:
            # No proxy from the environment: the demo talks to a server beside it.
            r = httpx.get(f"{self.http}/healthz", timeout=3, trust_env=False)
        except httpx.HTTPError as exc:
            return f"nothing answers at {self.http} ({exc or type(exc).__name__})"
        if r.status_code != 200:
            return f"{self.http}/healthz answers {r.status_code}"
        return ""

    def client(self, token):
        return mqclient.Client(self.http, token)

    def takes_token(self, token):
        with self.client(token) as client:
            try:
                client.ack([])  # acks nothing; a token the server refuses is a 401
            except mqclient.MQAuthError:
                return False
        return True

    def publish(self, queue, token, messages):
        """Publish [{"event", "payload", "headers"}] to `queue` as the subscriber of `token`."""
        with self.client(token) as client:
            return client.publish_many(queue, messages)


class RemoteSubscriber(threading.Thread):
    """A demo subscriber as a real client of the server, in a thread of its own, that "works"
    on each delivery a moment (WORK_SECS), then acks it, or refuses a malformed report (a nack
    with POISON_ERROR). `stop()` lets it settle what it holds and end. It touches no database:
    only the server does."""

    transport = ""

    def __init__(self, name, server, token, rng):
        super().__init__(name=f"demo-{name}", daemon=True)
        self.subscriber_name, self.server, self.token, self.rng = name, server, token, rng
        self.work_secs = WORK_SECS.get(name, (0.1, 0.5))
        self.acked = self.nacked = 0
        self.trouble = ""  # what went wrong last, until it works again
        self.stopping = threading.Event()


class ListeningSubscriber(RemoteSubscriber):
    """mqclient's listen(): it holds the websocket, subscribes, acks after the handler returns
    and nacks with the exception's text, reconnects and resumes, and never handles an acked id
    twice. The handler is only the demo's work."""

    transport = "websocket"

    def __init__(self, *args):
        super().__init__(*args)
        self.client = self.server.client(self.token)

    def handle(self, delivery):
        time.sleep(self.rng.uniform(*self.work_secs))
        if is_poison(delivery.payload):
            self.nacked += 1  # listen() nacks it with these words, kept as its last error
            raise ValueError(POISON_ERROR)
        self.acked += 1  # listen() acks it as this returns

    def run(self):
        try:
            if self.stopping.is_set():
                return
            self.client.listen(self.handle, SUBSCRIBERS[self.subscriber_name], prefetch=PREFETCH)
        except mqclient.MQError as exc:  # what waiting cannot mend: a refused token, a right gone
            self.trouble = str(exc)
        finally:
            self.client.close()

    def stop(self):
        self.stopping.set()
        self.client.stop()
        # A stop that came as listen() was starting (before it could hear it): once more.
        threading.Timer(0.5, self.client.stop).start()


class PullingSubscriber(RemoteSubscriber):
    """mqclient's pull(), ack() and nack() over REST: long-polls GET /api/deliveries, works on
    what it got side by side (each ready at its own time), acks what is done in one call."""

    transport = "pull"

    def run(self):
        self.held = []  # (due monotonic time, Delivery)
        with self.server.client(self.token) as client:
            while not self.stopping.is_set():
                try:
                    self.settle(client, self.due())
                    wait = POLL_SECS if not self.held else min(POLL_SECS, self.next_due_in())
                    now = time.monotonic()
                    for d in client.pull(limit=50, wait=round(wait, 2)):
                        self.held.append((now + self.rng.uniform(*self.work_secs), d))
                    self.trouble = ""
                except mqclient.MQAuthError as exc:
                    self.trouble = str(exc)
                    return
                except mqclient.MQError as exc:  # the server went away, or refused for now
                    self.trouble = str(exc)
                    self.stopping.wait(RECONNECT_SECS)
            with contextlib.suppress(mqclient.MQError):  # unacked, they come back: at least once
                self.settle(client, self.due(everything=True))

    def stop(self):
        self.stopping.set()

    def due(self, everything=False):
        now = time.monotonic()
        done = [d for due, d in self.held if everything or due <= now]
        self.held = [(due, d) for due, d in self.held if not (everything or due <= now)]
        return done

    def next_due_in(self):
        return max(min(due for due, _ in self.held) - time.monotonic(), 0.0)

    def settle(self, client, done):
        ok = [d for d in done if not is_poison(d.payload)]
        if ok:
            self.acked += client.ack(ok)["acked"]
        for d in done:
            if is_poison(d.payload):
                try:
                    d.nack(error=POISON_ERROR)
                    self.nacked += 1
                except (mqclient.MQNotFound, mqclient.MQBadRequest):
                    pass
                except mqclient.MQError as exc:
                    if exc.status != 409:  # settled since: nothing to give back
                        raise


CLIENTS = {"websocket": ListeningSubscriber, "pull": PullingSubscriber}
