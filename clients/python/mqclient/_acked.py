"""The delivery ids a client's handlers got through (acked), each with its queue and event.

A redelivery of one of them (its ack was lost with the connection) is acked again without
calling the handler. A seek, though, hands out acked deliveries again with the SAME ids (new
attempts), and the handler must see those: a seek through the client forgets the ids of the
subscription's queue and event before its request goes (the server may push the reopened ones
down the socket before the HTTP answer is back). So the subscription's queue and event must be
known before the answer: they are remembered by subscription id from the socket's `subscribed`
frames and from subscribe()'s answers.

One per client, shared by its listen() calls: the blocking Client's listener runs its event
loop in a thread of its own while seek() is called from the caller's, hence the lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

# Ids remembered: the oldest is dropped past this many.
REMEMBERED_IDS = 100_000

QueueEvent = tuple[str, str | None]


class AckedIds:
    def __init__(self, limit: int = REMEMBERED_IDS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ids: collections.OrderedDict[int, QueueEvent] = collections.OrderedDict()
        self._subscriptions: dict[int, QueueEvent] = {}

    def add(self, delivery_id: int, queue: str, event: str | None) -> None:
        with self._lock:
            self._ids[delivery_id] = (queue, event)
            self._ids.move_to_end(delivery_id)
            while len(self._ids) > self.limit:
                self._ids.popitem(last=False)

    def __contains__(self, delivery_id: object) -> bool:
        with self._lock:
            return delivery_id in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def forget(self, queue: str, event: str | None = None) -> int:
        """Forget the ids of `queue`'s deliveries of `event` (None: of every event); how many."""
        with self._lock:
            gone = [i for i, (q, e) in self._ids.items() if q == queue and (event is None or e == event)]
            for delivery_id in gone:
                del self._ids[delivery_id]
            return len(gone)

    def subscribed(self, subscription_id: Any, queue: Any, event: Any) -> None:
        """Remember the queue and event of a subscription (a `subscribed` frame, an answer)."""
        if type(subscription_id) is not int or not isinstance(queue, str):
            return
        if event is None or isinstance(event, str):
            with self._lock:
                self._subscriptions[subscription_id] = (queue, event)

    def of_subscription(self, subscription: int | dict[str, Any]) -> QueueEvent | None:
        """(queue, event) of a subscription given by id, or by an answer that carries them
        (subscribe()'s); None when this client has not seen it."""
        if isinstance(subscription, dict):
            if isinstance(subscription.get("queue"), str):
                return subscription["queue"], subscription.get("event")
            subscription = subscription.get("id")  # type: ignore[assignment]
        if isinstance(subscription, str) and subscription.isdigit():
            subscription = int(subscription)  # as _protocol.seek takes it: "7" is 7
        with self._lock:
            return self._subscriptions.get(subscription)  # type: ignore[arg-type]
