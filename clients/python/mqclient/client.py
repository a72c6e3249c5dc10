"""Client (blocking) and AsyncClient (asyncio): the same methods, over httpx, for the REST calls
of the contract, and listen() over the websocket. What each call sends and how its answer is
read lives once in _protocol; these classes only carry it."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from datetime import datetime
from typing import Any

import httpx

from . import _protocol, _retry
from ._acked import AckedIds, QueueEvent
from ._listener import DEFAULT_EXTEND_SECS, DEFAULT_MAX_EXTENSION_SECS, Listener
from .answers import Acked, Extended, Published, Receipt, Subscription
from .delivery import AsyncDelivery, Delivery
from .errors import InsecureURLWarning, MQConnectionError

Handler = Callable[[Any], Any]


class _Base:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 10,
        publish_attempts: int = _retry.DEFAULT_PUBLISH_ATTEMPTS,
    ) -> None:
        self.url, self.token, self.timeout = url, token, timeout
        # A keyed publish is tried this many times on a connection error or a 503 (_retry).
        self.publish_attempts = _retry.check_attempts(publish_attempts)
        self._rest_url, self._socket_url = _protocol.base_urls(url)
        self._listeners: set[Listener] = set()
        # What its listen() handlers acked, kept across listen() calls (_acked).
        self._acked_ids = AckedIds()
        if _protocol.sends_token_in_clear(self._rest_url):
            warnings.warn(
                f"mqclient: {url} is not https and not loopback: the token and every payload cross "
                "the network in clear text; use https://",
                InsecureURLWarning,
                stacklevel=3,  # the line that made the client
            )

    def _answer(self, call: _protocol.Call, r: httpx.Response) -> Any:
        if r.is_redirect:  # not followed (follow_redirects=False): say why, and where it pointed
            error = _protocol.redirect_error(
                str(r.request.url), r.status_code, r.headers.get("location"), same_origin_ok=False
            )
            assert error is not None
            raise error
        return call.read(_protocol.read_answer(r.status_code, r.content, r.headers.get("retry-after")))

    def _request_args(self, call: _protocol.Call) -> dict[str, Any]:
        args: dict[str, Any] = {"timeout": self.timeout + call.extra_timeout}
        if call.params:
            args["params"] = call.params
        if call.has_body:
            args["content"] = _protocol.encode(call.body)
            args["headers"] = {"Content-Type": "application/json"}
        return args

    def _subscribed(self, answer: Subscription) -> Subscription:
        self._acked_ids.subscribed(answer.id, answer.queue, answer.event)
        return answer

    def _forget_before_seek(self, subscription: int | dict[str, Any]) -> QueueEvent | None:
        """A seek hands acked deliveries out again with the same ids, and the server may push
        them down a listen() socket before the HTTP answer is back: the ids this client
        acked of the subscription's queue and event are forgotten before the request goes, so
        that the handler is called for them (not the silent ack of a lost-ack repeat)."""
        known = self._acked_ids.of_subscription(subscription)
        if known is not None:
            self._acked_ids.forget(*known)
        return known

    def _sought(self, answer: Subscription, forgotten: QueueEvent | None) -> Subscription:
        """After the seek: forget by the answer's queue and event if that was not done before
        (a subscription this client had not seen). Not twice: what a handler acked since the
        first forget is remembered, as any ack."""
        if (answer.queue, answer.event) != forgotten:
            self._acked_ids.forget(answer.queue, answer.event)
        return self._subscribed(answer)

    def _listener(
        self, handler: Handler, subscriptions: Iterable[Any] | None, prefetch: int | None, **kw: Any
    ) -> Listener:
        return Listener(
            socket_url=self._socket_url,
            token=self.token,
            timeout=self.timeout,
            handler=handler,
            subscriptions=subscriptions,
            prefetch=prefetch,
            done=self._acked_ids,
            **kw,
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def _unreachable(exc: httpx.TransportError) -> MQConnectionError:
    return MQConnectionError(None, "connection_error", f"{type(exc).__name__}: {exc}")


class Client(_Base):
    """A blocking client: `with Client("http://127.0.0.1:8000", token) as mq: ...`."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 10,
        publish_attempts: int = _retry.DEFAULT_PUBLISH_ATTEMPTS,
    ) -> None:
        super().__init__(url, token, timeout=timeout, publish_attempts=publish_attempts)
        self._http = httpx.Client(
            base_url=self._rest_url, headers=_protocol.headers(token), follow_redirects=False
        )

    def _do(self, call: _protocol.Call) -> Any:
        try:
            r = self._http.request(call.method, call.path, **self._request_args(call))
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        return self._answer(call, r)

    def publish(
        self,
        queue: str,
        event: str,
        payload: Any,
        key: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        group: str | None = None,
        delay_secs: float | None = None,
        deliver_at: datetime | str | None = None,
        ttl_secs: float | None = None,
        expires_at: datetime | str | None = None,
    ) -> Published:
        """Publish one message; the server's answer (`id`, `seq`, `deliveries`, ...). `group`:
        its message group (in an ordered queue, order holds within each group). A delayed
        message: `delay_secs` or `deliver_at` (at most 7 days ahead); one that expires:
        `ttl_secs` (from when it falls due) or `expires_at`. With a `key`, a connection error
        or a 503 is tried again (publish_attempts in all, with backoff): the key makes it safe."""
        timing = {
            "delay_secs": delay_secs,
            "deliver_at": deliver_at,
            "ttl_secs": ttl_secs,
            "expires_at": expires_at,
        }
        call = _protocol.publish(queue, event, payload, key, headers, group, **timing)
        if key is None:
            return self._do(call)
        return _retry.retrying(self.publish_attempts)(self._do, call)

    def publish_many(self, queue: str, messages: Iterable[Sequence[Any] | dict[str, Any]]) -> list[Published]:
        """Publish [(event, payload), ...] (or (event, payload, key)) at once, all or nothing."""
        return self._do(_protocol.publish_many(queue, messages))

    def subscribe(
        self,
        queue: str,
        event: str | None = None,
        *,
        filter: dict[str, list[Any]] | None = None,  # noqa: A002
        from_: str | int | datetime | dict[str, Any] | None = None,
    ) -> Subscription:
        """Subscribe; with `filter` ({"payload.kind": ["red"], "headers.tenant": ["acme", None]}),
        only the messages that match are owed (an existing subscription's filter is changed).
        Without one, an existing subscription keeps its own. `from_`: a new subscription also
        owes what its queue still holds from "all", a seq (int) or a time (datetime)."""
        return self._subscribed(self._do(_protocol.subscribe(queue, event, filter, from_)))

    def seek(
        self, subscription_id: int | dict[str, Any], to: int | datetime | str | dict[str, Any]
    ) -> Subscription:
        """Owe again what the queue holds from `to` (a seq or a time): the acked and dead
        handed out again, with the same delivery ids, to this client's listen() handler too
        (see _forget_before_seek). The subscription, with its `replay`."""
        call = _protocol.seek(subscription_id, to)
        forgotten = self._forget_before_seek(subscription_id)
        return self._sought(self._do(call), forgotten)

    def receipt(self, message_id: int | dict[str, Any]) -> Receipt:
        """Did everyone get it: the message (an id, or publish()'s answer) with its
        `deliveries` counted by state ({"pending", "inflight", "acked", "dead"})."""
        return self._do(_protocol.receipt(message_id))

    def set_filter(
        self,
        subscription_id: int | dict[str, Any],
        filter: dict[str, list[Any]] | None,  # noqa: A002
    ) -> Subscription:
        """Set a subscription's filter (None: none, every message): the subscription."""
        return self._do(_protocol.set_filter(subscription_id, filter))

    def route(
        self, queue: str, event: str, payload: Any, headers: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Who would receive this message, and why (publishes nothing): [{"id", "subscriber",
        "event", "matches", "reason"}] of the caller's subscriptions of the queue."""
        return self._do(_protocol.route(queue, event, payload, headers))

    def unsubscribe(self, subscription_id: int | dict[str, Any]) -> None:
        self._do(_protocol.unsubscribe(subscription_id))

    def pause(self, subscription_id: int | dict[str, Any]) -> Subscription:
        """Still owed what is published, handed nothing until resume(): the subscription."""
        return self._do(_protocol.pause(subscription_id))

    def resume(self, subscription_id: int | dict[str, Any]) -> Subscription:
        return self._do(_protocol.pause(subscription_id, paused=False))

    def pull(
        self, queue: str | None = None, event: str | None = None, limit: int = 100, wait: float = 0
    ) -> list[Delivery]:
        """Lease the caller's ready deliveries (long-polling up to `wait` seconds)."""
        return [Delivery(d, self) for d in self._do(_protocol.pull(queue, event, limit, wait))]

    def ack(self, ids: Iterable[int | Delivery] | int | Delivery) -> Acked:
        return self._do(_protocol.ack(ids))

    def nack(
        self, delivery_id: int | Delivery, retry_in: float | None = None, error: str | None = None
    ) -> dict[str, Any]:
        return self._do(_protocol.nack(delivery_id, retry_in, error))

    def extend(self, ids: Iterable[int | Delivery] | int | Delivery, seconds: int) -> Extended:
        """Keep pulled deliveries leased: their ack deadline becomes now + `seconds` (1 to
        43200). {"extended": n, "unknown": [ids not in flight or not the caller's]}."""
        return self._do(_protocol.extend(ids, seconds))

    def settle_ack(self, delivery: Delivery) -> dict[str, Any]:
        return self.ack([delivery.id])

    def settle_nack(self, delivery: Delivery, retry_in: float | None, error: str | None) -> dict[str, Any]:
        return self.nack(delivery.id, retry_in, error)

    def listen(
        self,
        handler: Handler,
        subscriptions: Iterable[Any] | None = None,
        *,
        prefetch: int | None = None,
        extend_secs: int = DEFAULT_EXTEND_SECS,
        max_extension_secs: float = DEFAULT_MAX_EXTENSION_SECS,
    ) -> None:
        """Hold the websocket and call `handler(delivery)` for each delivery, in a thread of its
        own, one at a time; ack when it returns, nack with its exception's text when it raises.
        A handler still running keeps its lease: extended by `extend_secs` at a time, for at
        most `max_extension_secs` in all (0: never extended).
        Blocks until stop(), SIGTERM (in the main thread), or a refusal waiting cannot mend
        (raised: MQAuthError, MQForbidden, ...). Reconnects by itself."""

        async def rest_ack(ids: list[int]) -> Any:
            return await asyncio.to_thread(self.ack, ids)

        listener = self._listener(
            handler,
            subscriptions,
            prefetch,
            make_delivery=Delivery,
            rest_ack=rest_ack,
            handler_in_thread=True,
            extend_secs=extend_secs,
            max_extension_secs=max_extension_secs,
        )
        self._listeners.add(listener)
        try:
            asyncio.run(listener.run())
        finally:
            self._listeners.discard(listener)

    def stop(self) -> None:
        """Stop listen() (from any thread, a handler included): the delivery under way finishes
        and is acked, then listen() returns."""
        for listener in list(self._listeners):
            listener.stop()

    def close(self) -> None:
        self.stop()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Stopped:
    """What AsyncClient.stop() returns: nothing to wait for, but `await client.stop()` works."""

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())


class AsyncClient(_Base):
    """The asyncio client: `async with AsyncClient(url, token) as mq: await mq.publish(...)`."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 10,
        publish_attempts: int = _retry.DEFAULT_PUBLISH_ATTEMPTS,
    ) -> None:
        super().__init__(url, token, timeout=timeout, publish_attempts=publish_attempts)
        self._http = httpx.AsyncClient(
            base_url=self._rest_url, headers=_protocol.headers(token), follow_redirects=False
        )

    async def _do(self, call: _protocol.Call) -> Any:
        try:
            r = await self._http.request(call.method, call.path, **self._request_args(call))
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        return self._answer(call, r)

    async def publish(
        self,
        queue: str,
        event: str,
        payload: Any,
        key: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        group: str | None = None,
        delay_secs: float | None = None,
        deliver_at: datetime | str | None = None,
        ttl_secs: float | None = None,
        expires_at: datetime | str | None = None,
    ) -> Published:
        timing = {
            "delay_secs": delay_secs,
            "deliver_at": deliver_at,
            "ttl_secs": ttl_secs,
            "expires_at": expires_at,
        }
        call = _protocol.publish(queue, event, payload, key, headers, group, **timing)
        if key is None:
            return await self._do(call)
        return await _retry.async_retrying(self.publish_attempts)(self._do, call)

    async def publish_many(
        self, queue: str, messages: Iterable[Sequence[Any] | dict[str, Any]]
    ) -> list[Published]:
        return await self._do(_protocol.publish_many(queue, messages))

    async def subscribe(
        self,
        queue: str,
        event: str | None = None,
        *,
        filter: dict[str, list[Any]] | None = None,  # noqa: A002
        from_: str | int | datetime | dict[str, Any] | None = None,
    ) -> Subscription:
        return self._subscribed(await self._do(_protocol.subscribe(queue, event, filter, from_)))

    async def seek(
        self, subscription_id: int | dict[str, Any], to: int | datetime | str | dict[str, Any]
    ) -> Subscription:
        call = _protocol.seek(subscription_id, to)
        forgotten = self._forget_before_seek(subscription_id)
        return self._sought(await self._do(call), forgotten)

    async def receipt(self, message_id: int | dict[str, Any]) -> Receipt:
        return await self._do(_protocol.receipt(message_id))

    async def set_filter(
        self,
        subscription_id: int | dict[str, Any],
        filter: dict[str, list[Any]] | None,  # noqa: A002
    ) -> Subscription:
        return await self._do(_protocol.set_filter(subscription_id, filter))

    async def route(
        self, queue: str, event: str, payload: Any, headers: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        return await self._do(_protocol.route(queue, event, payload, headers))

    async def unsubscribe(self, subscription_id: int | dict[str, Any]) -> None:
        await self._do(_protocol.unsubscribe(subscription_id))

    async def pause(self, subscription_id: int | dict[str, Any]) -> Subscription:
        return await self._do(_protocol.pause(subscription_id))

    async def resume(self, subscription_id: int | dict[str, Any]) -> Subscription:
        return await self._do(_protocol.pause(subscription_id, paused=False))

    async def pull(
        self, queue: str | None = None, event: str | None = None, limit: int = 100, wait: float = 0
    ) -> list[AsyncDelivery]:
        return [AsyncDelivery(d, self) for d in await self._do(_protocol.pull(queue, event, limit, wait))]

    async def ack(self, ids: Iterable[int | Delivery] | int | Delivery) -> Acked:
        return await self._do(_protocol.ack(ids))

    async def nack(
        self, delivery_id: int | Delivery, retry_in: float | None = None, error: str | None = None
    ) -> dict[str, Any]:
        return await self._do(_protocol.nack(delivery_id, retry_in, error))

    async def extend(self, ids: Iterable[int | Delivery] | int | Delivery, seconds: int) -> Extended:
        return await self._do(_protocol.extend(ids, seconds))

    def settle_ack(self, delivery: Delivery) -> Awaitable[dict[str, Any]]:
        return self.ack([delivery.id])

    def settle_nack(self, delivery: Delivery, retry_in: float | None, error: str | None) -> Awaitable[Any]:
        return self.nack(delivery.id, retry_in, error)

    async def listen(
        self,
        handler: Handler,
        subscriptions: Iterable[Any] | None = None,
        *,
        prefetch: int | None = None,
        extend_secs: int = DEFAULT_EXTEND_SECS,
        max_extension_secs: float = DEFAULT_MAX_EXTENSION_SECS,
    ) -> None:
        """As Client.listen; `handler` may be a coroutine function (awaited) or a plain one
        (called on the event loop: keep it quick, or hand slow work to a thread)."""
        listener = self._listener(
            handler,
            subscriptions,
            prefetch,
            make_delivery=AsyncDelivery,
            rest_ack=self.ack,
            handler_in_thread=False,
            extend_secs=extend_secs,
            max_extension_secs=max_extension_secs,
        )
        self._listeners.add(listener)
        try:
            await listener.run()
        finally:
            self._listeners.discard(listener)

    def stop(self) -> _Stopped:
        """Stop listen(); callable from anywhere (a handler, another thread), awaitable or not."""
        for listener in list(self._listeners):
            listener.stop()
        return _Stopped()

    async def close(self) -> None:
        self.stop()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
