"""A delivery: one message owed to one of the caller's subscriptions."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol


class _Settler(Protocol):
    """Who settles a delivery: the client over REST (a pulled one) or the listener over its
    socket (one handed to a handler)."""

    def settle_ack(self, delivery: Delivery) -> Any: ...

    def settle_nack(self, delivery: Delivery, retry_in: float | None, error: str | None) -> Any: ...


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class Delivery:
    """The contract's delivery fields as attributes (`published_at`, `ack_deadline`,
    `deliver_at` and `expires_at` as aware datetimes or None; `ack_deadline` is None on the
    socket), `headers` ({} when the message has none), `group` (its message group, None when
    none) and `raw`, the fields as the server sent them."""

    __slots__ = (
        "id",
        "message_id",
        "queue",
        "event",
        "seq",
        "payload",
        "attempt",
        "published_at",
        "ack_deadline",
        "deliver_at",
        "expires_at",
        "headers",
        "group",
        "raw",
        "_settler",
        "settled",
    )

    def __init__(self, fields: dict[str, Any], settler: _Settler | None = None) -> None:
        self.id: int = fields["id"]
        self.message_id: int = fields.get("message_id")  # type: ignore[assignment]
        self.queue: str = fields.get("queue")  # type: ignore[assignment]
        self.event: str = fields.get("event")  # type: ignore[assignment]
        self.seq: int = fields.get("seq")  # type: ignore[assignment]
        self.payload: Any = fields.get("payload")
        self.attempt: int = fields.get("attempt")  # type: ignore[assignment]
        self.published_at: datetime | None = _time(fields.get("published_at"))
        self.ack_deadline: datetime | None = _time(fields.get("ack_deadline"))
        self.deliver_at: datetime | None = _time(fields.get("deliver_at"))  # a delayed message's
        self.expires_at: datetime | None = _time(fields.get("expires_at"))
        self.headers: dict[str, str] = dict(fields.get("headers") or {})
        self.group: str | None = fields.get("group")
        self.raw = {k: v for k, v in fields.items() if k != "type"}
        self._settler = settler
        # None until ack() or nack() is called: the listener then leaves the delivery as the
        # handler settled it.
        self.settled: str | None = None

    def ack(self) -> Any:
        """Acknowledge it (done by itself when a listen handler returns)."""
        self.settled = "acked"
        return self._need_settler().settle_ack(self)

    def nack(self, retry_in: float | None = None, error: str | None = None) -> Any:
        """Give it back: pending again after `retry_in` seconds or the server's backoff, with
        `error` kept as its last error."""
        self.settled = "nacked"
        return self._need_settler().settle_nack(self, retry_in, error)

    def _need_settler(self) -> _Settler:
        if self._settler is None:
            raise RuntimeError("this delivery belongs to no client")
        return self._settler

    def __repr__(self) -> str:
        return (
            f"<Delivery {self.id} {self.queue}/{self.event} seq={self.seq} attempt={self.attempt} "
            f"payload={self.payload!r:.60}>"
        )


class AsyncDelivery(Delivery):
    """A delivery of AsyncClient: `await delivery.ack()`, `await delivery.nack(...)`."""

    __slots__ = ()

    async def ack(self) -> Any:  # type: ignore[override]
        self.settled = "acked"
        result = self._need_settler().settle_ack(self)
        return await result if hasattr(result, "__await__") else result

    async def nack(self, retry_in: float | None = None, error: str | None = None) -> Any:  # type: ignore[override]
        self.settled = "nacked"
        result = self._need_settler().settle_nack(self, retry_in, error)
        return await result if hasattr(result, "__await__") else result
