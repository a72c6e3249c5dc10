"""The demo: what a newcomer's first `make run` holds, and traffic to watch on the dashboard.

`seed_if_fresh()` (run by `manage.py bootstrap`, only while no queue exists) makes the
seeds' use case: the queues db, filesystem and network, and three subscribers:
logger (every event of db and filesystem), dashboard (db/create) and monitor (db/create and
network/error). `DemoTraffic` (run by `manage.py demo`) publishes a few realistic messages a
second to those queues and, for those subscribers, leases, acks and now and then nacks what
they get, through the same publishing and ledger code as the API, so that counters move,
deliveries flow and the odd malformed report ends up dead.
"""

import os
import random
import time
from collections import defaultdict
from pathlib import Path

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


class DemoTraffic:
    """Publishes and consumes the demo's messages. Not thread-safe: one loop drives it."""

    def __init__(self, rate=4.0, poison_every=25, rng=None):
        self.rate = rate
        self.poison_every = poison_every
        self.rng = rng or random.Random()
        self.queues = {q.name: q for q in Queue.objects.filter(name__in=QUEUES)}
        self.subscribers = list(Subscriber.objects.filter(name__in=SUBSCRIBERS, is_active=True))
        self.held = []  # (due monotonic time, subscriber, delivery id, poison)
        self.credit = 0.0
        self.published = self.acked = self.nacked = 0
        self.ids = defaultdict(int)

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
        """Publish `count` messages (fewer if the demo queues are gone), one batch per queue."""
        batches = defaultdict(list)
        for _ in range(count):
            made = self._message()
            if made is not None:
                queue, event, payload = made
                batches[queue].append(publishing.prepare(event, payload))
        for queue, outgoing in batches.items():
            publishing.publish(self.queues[queue], outgoing)
            self.published += len(outgoing)
        return sum(len(b) for b in batches.values())

    def publish_due(self, elapsed_secs, limit=None):
        """Publish what the rate owes for `elapsed_secs` (at most `limit`)."""
        self.credit += self.rate * elapsed_secs
        count = int(self.credit)
        if limit is not None:
            count = min(count, limit)
        self.credit -= count
        return self.publish(count) if count else 0

    def consume(self, now=None):
        """Each demo subscriber leases what is ready, works on it a moment, then acks it (the
        monitor nacks a malformed report: it is retried and, after the queue's last attempt,
        dead). Returns how many were acked in this call."""
        now = time.monotonic() if now is None else now
        for subscriber in self.subscribers:
            leased = ledger.lease_deliveries(subscriber, limit=50, holder=f"demo:{subscriber.name}")
            low, high = WORK_SECS.get(subscriber.name, (0.1, 0.5))
            for d in leased:
                poison = isinstance(d["payload"], dict) and d["payload"].get("malformed") is True
                self.held.append((now + self.rng.uniform(low, high), subscriber, d["id"], poison))
        return self._settle(lambda due: due <= now)

    def settle_all(self):
        """Ack (or nack) everything held now: the demo is stopping."""
        return self._settle(lambda due: True)

    def _settle(self, is_due):
        due = [h for h in self.held if is_due(h[0])]
        self.held = [h for h in self.held if not is_due(h[0])]
        acks = defaultdict(list)
        for _, subscriber, delivery_id, poison in due:
            if poison:
                try:
                    ledger.nack_delivery(subscriber, delivery_id, error="monitor: malformed error report")
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
        """Deliveries of the demo subscribers not settled yet (pending or in flight)."""
        return Delivery.objects.filter(
            subscriber__in=self.subscribers, status__in=(Status.PENDING, Status.INFLIGHT)
        ).count()

    def summary(self):
        return {"published": self.published, "acked": self.acked, "nacked": self.nacked, "at": timezone.now()}
