"""listen(): one websocket held open, deliveries handed to a handler one at a time, each acked
when its handler returns and nacked with the exception's text when it raises.

Written once, in asyncio: AsyncClient.listen awaits it, Client.listen runs it in an event loop
of its own (the handler then runs in a thread of its own, so that the socket keeps answering
pings while a handler works).

The rules a user relies on:
- at least once from the server, effectively once to the handler: an id whose handler returned
  is remembered (_acked: the last REMEMBERED_IDS of them) and, if the server hands it out again
  (its ack was lost with the connection), acked again without calling the handler; a seek
  through the same client forgets those of its subscription first (the server hands them out
  again, same ids, and the handler must see them);
- a connection that goes away (the server restarting, a network cut) is opened again after a
  jittered exponential backoff, capped; the server resumes the subscriber's subscriptions by
  itself, and the subscribe frames are sent again (the same subscriptions are reused);
- a 429 (a socket closed with 4429, a refused handshake, a `rate_limited` frame) waits at least
  what the server asked for;
- a refusal that waiting cannot mend (a bad token: 4401; a subscription the subscriber may not
  hold) ends listen() with its MQError;
- stop(), SIGTERM or a first Ctrl-C: no new delivery is started, the one under way finishes, what finished is
  acked (over REST if the socket is gone), and listen() returns. Deliveries received but not
  started go back to the server with the socket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import json
import logging
import random
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from . import _protocol
from ._acked import AckedIds
from .delivery import Delivery
from .errors import (
    MQAuthError,
    MQBadRequest,
    MQError,
    MQForbidden,
    MQNotFound,
    MQRedirectError,
    MQThrottled,
    error_for_close,
    error_for_frame,
)

log = logging.getLogger("mqclient")

# Acks go out in one frame for what finished within ACK_DELAY_SECS, at once when nothing else
# waits or ACK_BATCH have gathered (each ack frees room in the server's prefetch window).
ACK_DELAY_SECS = 0.01
ACK_BATCH = 50
MAX_IDS_PER_FRAME = 1000
# Reconnect backoff: the first wait about FIRST_BACKOFF_SECS, doubling, never over MAX_BACKOFF_SECS.
FIRST_BACKOFF_SECS = 0.5
MAX_BACKOFF_SECS = 30.0
# A connection that got its subscriptions answered, a delivery, or lasted this long was a good
# one: the backoff starts again from the first step after it.
STABLE_AFTER_SECS = 5.0
# A socket closed with 4429 waits at least this long: LIMIT_WAIT_SECS after the server said
# which limit (too many sockets: one must close first), ADDRESS_WAIT_SECS when it said nothing
# (the throttle of failed tokens from this address, counted per minute). A `retry_after` the
# server gave wins over both. The JavaScript client waits alike.
LIMIT_WAIT_SECS = 5.0
ADDRESS_WAIT_SECS = 60.0
# Websocket close codes and handshake statuses that waiting cannot mend.
FATAL = (MQAuthError, MQForbidden, MQNotFound, MQBadRequest, MQRedirectError)
# A handler still running keeps its delivery's lease (as Pub/Sub's clients do): the first
# extension after FIRST_EXTEND_SECS (under the shortest ack timeout a queue may have, 1 s; a
# quick handler sends none), then every third of `extend_secs`, each asking for `extend_secs`
# more, until `max_extension_secs` from the handler's start: past that the lease runs out and
# the server hands the delivery out again (a handler stuck for ever must not hold it for ever).
DEFAULT_EXTEND_SECS = 30
DEFAULT_MAX_EXTENSION_SECS = 3600.0
FIRST_EXTEND_SECS = 0.5
MAX_EXTEND_SECS = 43200  # the contract's cap on one extension
# A listen() that cannot connect says so at WARNING from the first failed attempt (a wrong URL,
# a server down), a handler that keeps raising from the HANDLER_WARN_AFTER-th failure in a row
# (one failure is a retry, routine); either again at most once every WARN_EVERY_SECS.
CONNECT_WARN_AFTER = 1
HANDLER_WARN_AFTER = 3
WARN_EVERY_SECS = 60.0
# How a socket proves who it is: the `auth` frame (the protocol's extensions; no token in the
# handshake at all, so no proxy's log keeps it), or the Authorization header for a server
# older than that extension.
AUTH_BY_FRAME = True


def socket_auth(token: str, prefetch: int | None = None) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(handshake headers, first frames) that authenticate a socket; `prefetch` rides on the
    auth frame, so the window holds from the resume's first lease."""
    if AUTH_BY_FRAME:
        frame: dict[str, Any] = {"type": "auth", "token": token}
        if prefetch is not None:
            frame["prefetch"] = prefetch
        return {}, [frame]
    return {"Authorization": f"Bearer {token}"}, []


class Subscribe(NamedTuple):
    """One subscription listen() makes: its subscribe frame's fields."""

    queue: str
    event: str | None = None
    filter: Any = None  # None: the subscription keeps its own
    from_: Any = None  # as subscribe(from_=...) takes it


def subscriptions_of(subscriptions: Iterable[Any] | None) -> list[Subscribe]:
    """Subscribe(...) from ("db", "create"), ("db",), ("db", None), "db", or
    {"queue": "db", "event"?, "filter"?, "from"?}."""
    out = []
    for s in subscriptions or ():
        if isinstance(s, str):
            out.append(Subscribe(s))
        elif isinstance(s, tuple | list) and 1 <= len(s) <= 2:
            out.append(Subscribe(s[0], s[1] if len(s) == 2 else None))
        elif isinstance(s, dict) and isinstance(s.get("queue"), str) and not set(s) - SUBSCRIBE_KEYS:
            out.append(Subscribe(s["queue"], s.get("event"), s.get("filter"), s.get("from")))
        else:
            raise ValueError(
                'a subscription is (queue, event), (queue,), "queue" or '
                f'{{"queue", "event", "filter", "from"}}, not {s!r}'
            )
    return out


SUBSCRIBE_KEYS = {"queue", "event", "filter", "from"}


class _connect(connect):
    """websockets' connect, which follows a redirect to another host and sends it the auth
    frame (it strips only headers): here a redirect to another origin is refused, so the token
    goes to the server the client was given and nowhere else. Same-origin ones are followed."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        target = super().process_redirect(exc)
        if isinstance(target, str) and isinstance(exc, InvalidStatus):
            response = exc.response
            refused = _protocol.redirect_error(
                self.uri, response.status_code, response.headers.get("Location"), same_origin_ok=True
            )
            if refused is not None:
                return refused
        return target


class Backoff:
    """Capped exponential backoff with jitter: many clients cut off at once do not all come
    back at the same instant."""

    def __init__(self, first: float = FIRST_BACKOFF_SECS, cap: float = MAX_BACKOFF_SECS) -> None:
        self.first, self.cap, self.failures = first, cap, 0

    def next(self) -> float:
        ceiling = min(self.cap, self.first * 2**self.failures)
        self.failures += 1
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.failures = 0


class Streak:
    """Failures in a row (connections, handler calls): `failed()` says whether this one is worth
    a WARNING: the WARN_AFTER-th in a row, then at most one every WARN_EVERY_SECS while the
    streak lasts, so a server down for an hour is a few lines, not thousands."""

    def __init__(self, warn_after: int) -> None:
        self.warn_after, self.count, self.warned_at = warn_after, 0, None

    def failed(self, now: float) -> bool:
        self.count += 1
        if self.count < self.warn_after:
            return False
        if self.warned_at is not None and now - self.warned_at < WARN_EVERY_SECS:
            return False
        self.warned_at = now
        return True

    def ended(self) -> None:
        self.count, self.warned_at = 0, None


class _Fatal(Exception):
    """An error frame that ends listen() (a subscription refused)."""

    def __init__(self, error: MQError) -> None:
        super().__init__(str(error))
        self.error = error


class Listener:
    def __init__(
        self,
        *,
        socket_url: str,
        token: str,
        timeout: float,
        handler: Callable[[Any], Any],
        subscriptions: Iterable[Any] | None,
        prefetch: int | None,
        make_delivery: Callable[[dict[str, Any], Listener], Delivery],
        rest_ack: Callable[[list[int]], Awaitable[Any]],
        handler_in_thread: bool,
        done: AckedIds | None = None,
        extend_secs: int = DEFAULT_EXTEND_SECS,
        max_extension_secs: float = DEFAULT_MAX_EXTENSION_SECS,
    ) -> None:
        if type(extend_secs) is not int or not 1 <= extend_secs <= MAX_EXTEND_SECS:
            raise ValueError(f"extend_secs must be a whole number, 1 to {MAX_EXTEND_SECS}: {extend_secs!r}")
        if max_extension_secs < 0:
            raise ValueError(f"max_extension_secs must be 0 or more, not {max_extension_secs!r}")
        self.extend_secs, self.max_extension_secs = extend_secs, float(max_extension_secs)
        self.ws: ClientConnection | None = None  # the socket of the session under way
        self.socket_url, self.token, self.timeout = socket_url, token, timeout
        self.handler = handler
        self.subscriptions = subscriptions_of(subscriptions)
        if prefetch is not None and (type(prefetch) is not int or prefetch < 1):
            raise ValueError(f"prefetch must be a whole number, at least 1, not {prefetch!r}")
        self.prefetch = prefetch
        self.make_delivery = make_delivery
        self.rest_ack = rest_ack
        self.executor = (
            ThreadPoolExecutor(1, thread_name_prefix="mqclient-handler") if handler_in_thread else None
        )
        self.backoff = Backoff()
        self.connect_failures = Streak(CONNECT_WARN_AFTER)
        self.handler_failures = Streak(HANDLER_WARN_AFTER)
        # Ids handled and acked: the client's, so that they outlive one listen() call.
        self.done = done if done is not None else AckedIds()
        self.active: set[int] = set()  # ids waiting in the inbox or being handled
        self.acks: list[int] = []  # handled, not yet sent
        self.nacks: list[tuple[int, float | None, str | None]] = []
        self.refs = itertools.count(1)
        self.sent: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self.accepting = True
        self.healthy = False
        self.heard: list[Any] = []  # what this socket's server said before it closed: frames, limits
        self.stop_requested = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None

    # --- from any thread -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask listen() to stop: thread-safe, and safe from a signal handler."""
        self.stop_requested = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has just ended
                loop.call_soon_threadsafe(self.stopping.set)

    def settle_ack(self, delivery: Delivery) -> None:
        self._in_loop(self._ack, delivery)

    def settle_nack(self, delivery: Delivery, retry_in: float | None, error: str | None) -> None:
        self._in_loop(self._nack, delivery.id, retry_in, error)

    def _in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self.loop is None or threading.get_ident() == self.loop_thread:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # --- the run ---------------------------------------------------------------------------

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.stopping = asyncio.Event()
        self.ack_wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.inbox: asyncio.Queue[Delivery | None] = asyncio.Queue()
        if self.stop_requested:
            self.stopping.set()
        restore = self._stop_on_sigterm()
        worker = asyncio.ensure_future(self._work())
        try:
            await self._connect_again_and_again()
        finally:
            self.accepting = False
            self._drop_inbox()
            self.inbox.put_nowait(None)
            try:
                await asyncio.shield(worker)  # the handler under way finishes
            finally:
                await self._ack_what_is_left()
                restore()
                if self.executor is not None:
                    self.executor.shutdown(wait=False)

    async def _connect_again_and_again(self) -> None:
        while not self.stopping.is_set():
            started = asyncio.get_running_loop().time()
            self.healthy = False
            self.heard = []
            wait, why = None, ""
            try:
                await self._session()
                if self.stopping.is_set():
                    return
                log.info("mqclient: the server closed the socket; connecting again")
            except FATAL:
                raise
            except _Fatal as exc:
                raise exc.error from None
            except MQThrottled as exc:
                wait, why = exc.retry_after or 0, exc.detail
            except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake, MQError) as exc:
                why = str(exc) or type(exc).__name__
            if self.healthy or asyncio.get_running_loop().time() - started > STABLE_AFTER_SECS:
                self.backoff.reset()
                self.connect_failures.ended()
            delay = max(self.backoff.next(), (wait or 0) * random.uniform(1, 1.2))
            if wait is None and why:
                self._say_connection_failed(why, delay)
            if wait is not None:
                log.warning("mqclient: throttled (%s); waiting %.1f s", why, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)

    def _say_connection_failed(self, why: str, delay: float) -> None:
        """A connection that worked and went away is routine (INFO); one that never got its
        subscriptions answered is a listener that cannot connect (WARNING, throttled)."""
        if self.healthy:
            log.info("mqclient: connection lost (%s); connecting again", why)
            return
        streak = self.connect_failures
        if streak.failed(asyncio.get_running_loop().time()):
            log.warning(
                "mqclient: cannot connect to %s (%s); attempt %d failed, trying again in %.1f s",
                self.socket_url,
                why,
                streak.count,
                delay,
            )
        else:
            log.info(
                "mqclient: cannot connect to %s (%s); trying again in %.1f s", self.socket_url, why, delay
            )

    async def _open(self) -> ClientConnection | None:
        """The socket, or None if stop() came first."""
        headers, _ = socket_auth(self.token)

        async def opening() -> ClientConnection:
            try:
                return await _connect(
                    self.socket_url,
                    additional_headers=headers,
                    open_timeout=self.timeout,
                    close_timeout=self.timeout,
                    max_size=None,  # a payload may be as large as the server allows
                )
            except InvalidStatus as exc:  # the handshake answered with an HTTP error
                response = exc.response
                try:
                    _protocol.read_answer(
                        response.status_code, response.body or b"", response.headers.get("Retry-After")
                    )
                except MQError as error:
                    if response.status_code >= 500:  # the server restarting: try again
                        raise MQError(response.status_code, error.code, error.detail) from exc
                    raise error from exc
                raise

        task = asyncio.ensure_future(opening())
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            ws = await task
            await ws.close()
        return None

    async def _session(self) -> None:
        ws = await self._open()
        if ws is None:
            return
        self.ws = ws
        reader = asyncio.ensure_future(self._read(ws))
        tasks: list[asyncio.Future[Any]] = [reader]
        try:
            try:
                _, first = socket_auth(self.token, self.prefetch)
                for frame in first:
                    await ws.send(json.dumps(frame))
                for subscription in self.subscriptions:
                    await self._send(ws, self._subscribe_frame(subscription))
                await self._send_settlements(ws)  # what finished while the last connection was away
            except ConnectionClosed:
                # Closed at once (a limit, a bad token): what the server said before closing
                # tells why, so let the reader take it in first.
                await asyncio.wait({reader}, timeout=self.timeout)
                raise
            flusher = asyncio.ensure_future(self._flush(ws))
            stop = asyncio.ensure_future(self.stopping.wait())
            tasks = [reader, flusher, stop]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                # Stopping: take nothing new, let the handler under way finish, ack, close.
                self.accepting = False
                self._drop_inbox()
                await self.idle.wait()
                with contextlib.suppress(ConnectionClosed, OSError):
                    await self._send_settlements(ws)
                return
            for task in done:
                task.result()  # the reader's end: the close's error, or a fatal frame
        except ConnectionClosed as exc:
            # The close code says why: a refused token (4401) or too many (4429) is told as such.
            error = error_for_close(ws.close_code, ws.close_reason or "")
            if isinstance(error, MQThrottled):
                error.retry_after = self._wait_after_4429()
            if error is not None:
                raise error from exc
            raise
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            self.ws = None
            self._drop_inbox()  # the server hands these out again once the socket is gone
            if self.nacks:
                log.info(
                    "mqclient: %d nacks not sent; the server takes them back with the socket", len(self.nacks)
                )
                self.nacks.clear()
            with contextlib.suppress(Exception):
                await ws.close()

    def _wait_after_4429(self) -> float:
        limits = [e for e in self.heard if isinstance(e, MQThrottled)]
        if limits and limits[-1].retry_after is not None:
            return limits[-1].retry_after
        if limits or self.heard:
            return LIMIT_WAIT_SECS
        return ADDRESS_WAIT_SECS

    def _subscribe_frame(self, subscription: Subscribe) -> dict[str, Any]:
        frame: dict[str, Any] = {
            "type": "subscribe",
            "queue": subscription.queue,
            "event": subscription.event,
        }
        if self.prefetch is not None:
            frame["prefetch"] = self.prefetch
        if subscription.filter is not None:  # the same filter again at a reconnect changes nothing
            frame["filter"] = subscription.filter
        if subscription.from_ is not None:
            # Sent again at each reconnect: the server replays only for a subscription it makes
            # (docs/concepts.md, replay and seek), so the history is handed once.
            frame["from"] = _protocol.point(subscription.from_)
        return frame

    async def _send(self, ws: ClientConnection, frame: dict[str, Any]) -> None:
        """Send a frame with a ref, remembered (a few thousand) so that a `rate_limited` answer
        naming it can be sent again, and an error naming a subscribe frame ends listen()."""
        ref = f"c{next(self.refs)}"
        self.sent[ref] = (frame["type"], frame)
        while len(self.sent) > 4096:
            self.sent.popitem(last=False)
        await ws.send(json.dumps({**frame, "ref": ref}))

    # --- receiving -------------------------------------------------------------------------

    async def _read(self, ws: ClientConnection) -> None:
        async for raw in ws:
            try:
                frame = json.loads(raw)
            except ValueError:
                log.warning("mqclient: a frame that is not JSON: %.200r", raw)
                continue
            kind = frame.get("type")
            if not self.heard:
                self.heard.append(kind)
            if kind == "message":
                self._take(frame)
            elif kind == "messages":
                for item in frame.get("messages") or ():
                    self._take(item)
            elif kind == "subscribed":
                self.healthy = True
                # its queue and event, for a seek of it by id (_acked)
                self.done.subscribed(frame.get("subscription"), frame.get("queue"), frame.get("event"))
            elif kind == "error":
                self._on_error(ws, frame)
            elif kind == "unsubscribed" and frame.get("reason"):
                log.warning(
                    "mqclient: the server ended the subscription %s/%s: %s",
                    frame.get("queue"),
                    frame.get("event") or "*",
                    frame.get("reason"),
                )
        # Closed in good order (1000, 1001: Daphne's websocket_timeout, a proxy's idle timeout, a
        # server going away): the end of this session, and listen() connects again. Any other
        # close code raised out of the loop above, for _session to map.

    def _take(self, frame: dict[str, Any]) -> None:
        if not self.accepting:
            return  # stopping: it goes back to the server with the socket
        self.healthy = True
        delivery_id = frame.get("id")
        if not isinstance(delivery_id, int):
            return
        if delivery_id in self.done:
            # Handled already in this process, but the ack did not reach the server (the
            # connection went away first): ack again, do not handle again.
            self._queue_ack(delivery_id)
            return
        if delivery_id in self.active:
            return  # waiting here or being handled: a lease that ran out, handed out again
        self.active.add(delivery_id)
        self.inbox.put_nowait(self.make_delivery(frame, self))

    def _on_error(self, ws: ClientConnection, frame: dict[str, Any]) -> None:
        sent = self.sent.get(frame.get("ref")) if frame.get("ref") else None
        error = error_for_frame(frame)
        if isinstance(error, MQThrottled):
            self.heard.append(error)  # the why of a 4429 that may follow
            del self.heard[1:-4]  # the first frame's kind and the last few limits are enough
        if isinstance(error, MQThrottled) and sent is not None:
            # Not processed: send it again once the server is ready for it.
            wait = error.retry_after or 0.1
            log.debug(
                "mqclient: %s frame refused (%s); sending it again in %.3f s", sent[0], error.code, wait
            )
            kind, original = sent
            if kind == "ack":
                self.loop.call_later(wait, self._queue_acks, original["ids"])  # type: ignore[union-attr]
            else:
                self.loop.call_later(  # type: ignore[union-attr]
                    wait, lambda: asyncio.ensure_future(self._send_quietly(ws, original))
                )
            return
        if sent is not None and sent[0] == "subscribe":
            raise _Fatal(error)  # a subscription it may not hold: waiting will not mend it
        if error.code in ("unknown_ids", "already_settled"):
            log.debug("mqclient: %s", error)
            return
        log.warning("mqclient: the server refused a frame: %s", error)

    async def _send_quietly(self, ws: ClientConnection, frame: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionClosed, OSError):
            await self._send(ws, frame)

    def _drop_inbox(self) -> None:
        while not self.inbox.empty():
            delivery = self.inbox.get_nowait()
            if delivery is not None:
                self.active.discard(delivery.id)
            else:
                self.inbox.put_nowait(None)  # the worker's end: keep it
                return

    # --- handling --------------------------------------------------------------------------

    async def _work(self) -> None:
        while True:
            delivery = await self.inbox.get()
            if delivery is None:
                return
            self.idle.clear()
            try:
                await self._handle(delivery)
            finally:
                self.active.discard(delivery.id)
                if self.inbox.empty() or not self.accepting:
                    self.idle.set()

    async def _handle(self, delivery: Delivery) -> None:
        keeper = asyncio.ensure_future(self._keep_leased(delivery.id))
        try:
            if self.executor is not None:
                result = await self.loop.run_in_executor(self.executor, self.handler, delivery)  # type: ignore[union-attr]
            else:
                result = self.handler(delivery)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            if delivery.settled is None:
                text = str(exc) or type(exc).__name__
                streak = self.handler_failures
                if streak.failed(asyncio.get_running_loop().time()):
                    log.warning(
                        "mqclient: the handler failed %d times in a row; the last, on delivery %s: %s",
                        streak.count,
                        delivery.id,
                        text,
                        exc_info=exc,
                    )
                else:
                    log.info("mqclient: handler failed on delivery %s: %s", delivery.id, text)
                delivery.settled = "nacked"
                self._nack(delivery.id, None, text)
            return
        finally:
            keeper.cancel()
        self.handler_failures.ended()
        if delivery.settled is None:
            delivery.settled = "acked"
            self._ack(delivery)

    async def _keep_leased(self, delivery_id: int) -> None:
        """Extend the lease of the delivery under way until cancelled (its handler ended) or
        max_extension_secs from now."""
        clock = asyncio.get_running_loop().time
        started, wait = clock(), FIRST_EXTEND_SECS
        while True:
            await asyncio.sleep(wait)
            wait = self.extend_secs / 3
            # whole seconds, as the contract takes them
            seconds = int(min(self.extend_secs, self.max_extension_secs - (clock() - started)))
            if seconds < 1:
                log.warning(
                    "mqclient: the handler of delivery %s still runs after max_extension_secs (%g s): "
                    "its lease is no longer extended, and the server will hand it out again",
                    delivery_id,
                    self.max_extension_secs,
                )
                return
            ws = self.ws
            if ws is None:
                continue  # between connections: the socket that leased it handed it back
            with contextlib.suppress(ConnectionClosed, OSError):
                await self._send(ws, {"type": "extend", "ids": [delivery_id], "seconds": seconds})

    # --- settling (on the loop's thread) ---------------------------------------------------

    def _ack(self, delivery: Delivery) -> None:
        # Remembered before the ack goes: a seek that reopens it comes after the ack, so it
        # finds it here to forget.
        self.done.add(delivery.id, delivery.queue, delivery.event)
        self._queue_ack(delivery.id)

    def _queue_ack(self, delivery_id: int) -> None:
        self.acks.append(delivery_id)
        self.ack_wake.set()

    def _queue_acks(self, ids: list[int]) -> None:
        self.acks.extend(ids)
        self.ack_wake.set()

    def _nack(self, delivery_id: int, retry_in: float | None, error: str | None) -> None:
        self.nacks.append((delivery_id, retry_in, error))
        self.ack_wake.set()

    async def _flush(self, ws: ClientConnection) -> None:
        while True:
            await self.ack_wake.wait()
            self.ack_wake.clear()
            if len(self.acks) < ACK_BATCH and not self.inbox.empty():
                await asyncio.sleep(ACK_DELAY_SECS)  # more finish soon: one frame for them
            await self._send_settlements(ws)

    async def _send_settlements(self, ws: ClientConnection) -> None:
        while self.acks:
            ids = list(dict.fromkeys(self.acks[:MAX_IDS_PER_FRAME]))
            # If the send fails they stay in self.acks: the next connection (or REST at the
            # end) sends them.
            await self._send(ws, {"type": "ack", "ids": ids})
            del self.acks[:MAX_IDS_PER_FRAME]
        while self.nacks:
            delivery_id, retry_in, error = self.nacks[0]
            frame: dict[str, Any] = {"type": "nack", "ids": [delivery_id]}
            if retry_in is not None:
                frame["retry_in"] = retry_in
            if error is not None:
                frame["error"] = _protocol.clean_error(error)
            await self._send(ws, frame)
            self.nacks.pop(0)

    async def _ack_what_is_left(self) -> None:
        """At the end, acks the socket could not carry go over REST (best effort: unacked,
        they come back, and another process handles them: at least once)."""
        if not self.acks:
            return
        ids, self.acks = list(dict.fromkeys(self.acks)), []
        try:
            await asyncio.wait_for(self.rest_ack(ids), self.timeout)
        except Exception as exc:
            log.warning("mqclient: %d acks could not be sent (%s); they will be redelivered", len(ids), exc)

    # --- SIGTERM and Ctrl-C ------------------------------------------------------------------

    def _stop_on_sigterm(self) -> Callable[[], None]:
        """In the main thread, SIGTERM and a first Ctrl-C (SIGINT) stop listen() cleanly; a
        second Ctrl-C interrupts as usual. The previous handlers come back afterwards. Elsewhere
        (a signal can only be caught there) they are left alone."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        loop = self.loop
        assert loop is not None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def on_sigint() -> None:
            self.stop()
            with contextlib.suppress(Exception):  # the next one raises KeyboardInterrupt
                loop.remove_signal_handler(signal.SIGINT)

        try:
            loop.add_signal_handler(signal.SIGTERM, self.stop)
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):
            return lambda: None

        def restore() -> None:
            for s, handler in previous.items():
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(s)
                with contextlib.suppress(Exception):
                    signal.signal(s, handler)

        return restore
