"""The server's answers as typed objects that stay the dicts they were: `answer.seq` (typed,
for an editor and mypy) and `answer["seq"]` alike, equal to the dict the server sent, so code
written against the dicts keeps working. A field the server did not send reads as None."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .delivery import _time


def _field(name: str, read: Any = None) -> Any:
    """A read-only attribute for the answer's `name` (through `read`, if given)."""

    def get(self: dict[str, Any]) -> Any:
        value = self.get(name)
        return read(value) if read is not None and value is not None else value

    return property(get, doc=f"the answer's {name!r}")


class Answer(dict[str, Any]):
    """An answer of the server: a dict, with its fields as attributes too."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"


class Published(Answer):
    """publish()'s answer (one of publish_many()'s)."""

    id: int = _field("id")
    queue: str = _field("queue")
    event: str = _field("event")
    seq: int = _field("seq")
    deliveries: int = _field("deliveries")  # how many subscriptions it fanned out to
    created_at: datetime | None = _field("created_at", _time)


class Subscription(Answer):
    """subscribe(), set_filter(), pause(), resume() and seek()'s answer."""

    id: int = _field("id")
    queue: str = _field("queue")
    event: str | None = _field("event")
    created_at: datetime | None = _field("created_at", _time)
    paused: bool = _field("paused")
    filter: dict[str, list[Any]] | None = _field("filter")
    replay: dict[str, int] | None = _field("replay")  # {"from_seq", "deliveries"}: from_ or seek


class Acked(Answer):
    """ack()'s answer."""

    acked: int = _field("acked")  # newly acked
    unknown: list[int] = _field("unknown")


class Extended(Answer):
    """extend()'s answer."""

    extended: int = _field("extended")
    unknown: list[int] = _field("unknown")  # not in flight, or not the caller's


class Receipt(Answer):
    """receipt()'s answer: the message, its deliveries counted by state."""

    id: int = _field("id")
    queue: str = _field("queue")
    event: str = _field("event")
    seq: int = _field("seq")
    created_at: datetime | None = _field("created_at", _time)
    deliveries: dict[str, int] = _field("deliveries")  # {"pending", "inflight", "acked", "dead"}

    @property
    def settled(self) -> bool:
        """Everyone got it (or it died): nothing pending or in flight."""
        counts = self.deliveries or {}
        return not counts.get("pending") and not counts.get("inflight")
