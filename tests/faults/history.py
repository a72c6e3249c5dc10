"""The history of a fault run: every publish the server confirmed and every delivery a
subscriber received, in the order they happened. Thread-safe; optionally also written as JSON
lines for a post-mortem."""

import json
import threading
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Subscription:
    name: str  # "<subscriber>/<queue>"
    subscriber: str
    queue: str
    event: str | None  # None: every event of the queue
    ordered: bool


@dataclass(frozen=True)
class Published:
    """A publish the server confirmed (201, or 200 for a repeated idempotency key)."""

    tag: str  # unique per publish attempt: payload["tag"] and the idempotency key
    queue: str
    event: str
    message_id: int
    seq: int


@dataclass(frozen=True)
class Delivered:
    subscription: str
    delivery_id: int
    message_id: int
    queue: str
    event: str
    seq: int
    tag: str | None
    attempt: int
    via: str  # ws, webhook, pull
    at: float  # monotonic seconds


class History:
    def __init__(self, path=None):
        self.lock = threading.Lock()
        self.subscriptions = {}  # name -> Subscription
        self.attempted = {}  # tag -> queue
        self.published = []
        self.delivered = []
        self.notes = []  # (monotonic seconds, text): faults and other events, for the report
        self._by_route = {}  # (subscriber, queue) -> subscription name
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def _write(self, kind, record):
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, **record}) + "\n")

    def subscription(self, subscriber, queue, event=None, ordered=False):
        sub = Subscription(f"{subscriber}/{queue}", subscriber, queue, event, ordered)
        with self.lock:
            self.subscriptions[sub.name] = sub
            self._by_route[(subscriber, queue)] = sub.name
            self._write("subscription", asdict(sub))
        return sub

    def attempt(self, queue, tags):
        """About to publish these tags: a delivery of one is not unexpected even if the answer
        never came back (the publish may have committed)."""
        with self.lock:
            for tag in tags:
                self.attempted[tag] = queue

    def confirm(self, tag, answer):
        """The server's answer for the message published under `tag`."""
        record = Published(tag, answer["queue"], answer["event"], answer["id"], answer["seq"])
        with self.lock:
            self.published.append(record)
            self._write("published", asdict(record))

    def receive(self, subscriber, frame, via):
        """A delivery as the subscriber got it: a websocket `message` frame, a webhook body or
        an item of GET /api/deliveries."""
        payload = frame.get("payload")
        tag = payload.get("tag") if isinstance(payload, dict) else None
        with self.lock:
            name = self._by_route.get((subscriber, frame["queue"]), f"{subscriber}/{frame['queue']}?")
            record = Delivered(
                name,
                frame["id"],
                frame["message_id"],
                frame["queue"],
                frame["event"],
                frame["seq"],
                tag,
                frame.get("attempt", 0),
                via,
                time.monotonic(),
            )
            self.delivered.append(record)
            self._write("delivered", asdict(record))

    def note(self, text):
        with self.lock:
            self.notes.append((time.monotonic(), text))
            self._write("note", {"at": time.monotonic(), "text": text})

    def snapshot(self):
        """Copies to check while the run goes on: (subscriptions, attempted, published, delivered)."""
        with self.lock:
            return dict(self.subscriptions), dict(self.attempted), list(self.published), list(self.delivered)

    def close(self):
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
