"""The websocket at /ws/: live delivery, with the same ledger as pull.

Notify-then-lease: a wake-up (delivery.wakeups) only says "subscriber N may have work"; the consumer
then leases from the ledger up to its free prefetch window and sends what it got. It does so
on connect (the catch-up: every subscription of the subscriber resumes by itself), on a
wake-up, after an ack or nack frees room, and when a lease it holds runs out. In case a wake-up
was lost, one loop per process asks the ledger every RECHECK_SECS which of its sockets'
subscribers have work, in one query for all of them, and wakes those: an idle socket costs no
query of its own (each used to make three every 2 s, which bounded how many one process held).
Each operation is one database call (database_sync_to_async), so the event loop never waits
on a query per row.
"""

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
import weakref
from collections import defaultdict
from functools import cached_property
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.db import DatabaseSyncToAsync
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from rest_framework.utils.encoders import JSONEncoder

from mqsite import limits
from mqsite.api import is_db_id, storable_text
from mqsite.parsers import BadJSON, decode_json
from queues import group_commit, publishing
from queues.names import BadName, clean_name
from subscribers import presence, subscribing
from subscribers.auth import auth_failed, subscriber_for_token
from subscribers.models import Subscriber, Subscription

from . import ledger, liveness, wakeups
from .api.serializers import MAX_NACK_ERROR_CHARS

log = logging.getLogger(__name__)

# How often an idle connection looks at the ledger without a wake-up: the most a lost
# wake-up (or one from a process that could not reach Redis) can delay a delivery.
RECHECK_SECS = 2.0
# A socket hands out nothing in its first moments: a client that reconnects and sends its
# subscribe frames again gets each "subscribed" answer before the catch-up, in the order of
# the contract, rather than racing the automatic resume. Short, since it delays every resume.
RESUME_GRACE_SECS = 0.2
CLOSE_BAD_TOKEN = 4401
CLOSE_BY_OPERATOR = 4000  # an operator closed the connection (the admin)
REVOKED = "its subscriber's token or right was revoked"
UNKNOWN_IDS = "These delivery ids are not yours or do not exist."
# Daphne (autobahn) lets an application close only with 1000 or 3000-4999: the standard 1009
# (too big) and 1011 (server error) raise instead of closing, so these mirror HTTP's codes.
CLOSE_TOO_BIG = 4413
CLOSE_SERVER_ERROR = 4500
MESSAGE_FIELDS = ("id", "message_id", "queue", "event", "seq", "payload", "attempt", "published_at")
PUBLISHED_FIELDS = ("id", "queue", "event", "seq", "deliveries")


def db(fn):
    """Run a database call off the event loop, in a pool thread (not channels' single shared
    thread: one slow call there would hold up every socket of the process)."""
    return DatabaseSyncToAsync(fn, thread_sensitive=False)


class FrameError(Exception):
    def __init__(self, code, detail, **extra):
        super().__init__(detail)
        self.code, self.detail, self.extra = code, detail, extra

    @classmethod
    def of_limit(cls, exc):
        """A limits.LimitExceeded, as the socket tells it (with its retry_after, if any)."""
        return cls(exc.code, exc.detail, **({"retry_after": exc.wait} if exc.wait is not None else {}))

    def frame(self, ref=None):
        """The error frame: every error the socket sends is built here."""
        return {
            "type": "error",
            "code": self.code,
            "detail": self.detail,
            **self.extra,
            **({"ref": ref} if ref is not None else {}),
        }


_maintenance = _recheck = _listener = _token_check = _loop = None
_open = weakref.WeakSet()  # the consumers of this process with a socket open


async def release_open_sockets():
    """The server is stopping (mqsite/shutdown.py): every socket of this process hands back
    what it holds now, rather than at its ack deadline."""
    consumers = list(_open)
    for c in consumers:
        c.give_back = True  # the client is not at fault: its attempts are not spent
    await asyncio.gather(*(c.disconnect(None) for c in consumers), return_exceptions=True)


def open_sockets():
    return len(_open)


def ensure_maintenance():
    """Loops of a server process. One refreshes the heartbeat of every socket of the process
    (one UPDATE), sweeps connections whose server died (their heartbeat stopped) and expires
    overdue leases, so that nothing waits on a socket that is gone, even where no other
    sweeper runs (the embedded mode). One wakes the sockets whose subscribers have work (see
    the module's docstring). In the services mode, one hears the other processes' wake-ups."""
    global _maintenance, _recheck, _listener, _token_check, _loop
    _loop = asyncio.get_running_loop()
    if not _running(_token_check):
        _token_check = asyncio.ensure_future(_check_tokens())
    if not _running(_maintenance):
        _maintenance = asyncio.ensure_future(_maintain())
    if not _running(_recheck):
        _recheck = asyncio.ensure_future(_wake_those_with_work())
    if settings.REDIS_URL and not _running(_listener):
        _listener = asyncio.ensure_future(wakeups.listen())


def _running(task):
    # A task of another event loop (closed: one per test) never runs again, though not done.
    return task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()


async def _maintain():
    while True:
        await asyncio.sleep(presence.HEARTBEAT_SECS)
        try:
            gone = await db(presence.heartbeat)([c.channel_name for c in list(_open)])
            # Their rows were deleted (an operator closed them, the announcement was lost).
            for c in [c for c in list(_open) if c.channel_name in gone]:
                asyncio.ensure_future(c.revoke(CLOSE_BY_OPERATOR, "closed by an operator"))
            await db(presence.sweep_stale_connections)()
            await db(ledger.expire_overdue_leases)()
        except Exception:
            log.exception("maintenance sweep failed; trying again in %s s", presence.HEARTBEAT_SECS)


async def _wake_those_with_work():
    while True:
        await asyncio.sleep(RECHECK_SECS)
        consumers = [c for c in list(_open) if not c.closing]
        if not consumers:
            continue
        try:
            due = await db(ledger.subscribers_with_work)({c.subscriber.pk for c in consumers})
        except Exception:
            log.exception("looking for work failed; trying again in %s s", RECHECK_SECS)
            continue
        for c in consumers:
            if c.subscriber.pk in due:
                c.wake.set()


async def _check_tokens():
    """The safety net of revocation: every MQ_REVOCATION_CHECK_SECS, whatever Redis lost."""
    while True:
        await asyncio.sleep(settings.MQ_REVOCATION_CHECK_SECS)
        consumers = [c for c in list(_open) if not c.closing]
        if not consumers:
            continue
        try:
            await check_tokens(consumers)
        except Exception:
            log.exception("checking tokens failed; trying again in %s s", settings.MQ_REVOCATION_CHECK_SECS)


async def check_tokens(consumers):
    """Close the sockets whose subscriber is gone, inactive or has another token now, and make
    those whose rights changed look again (an announcement lost with Redis): two queries for
    all of them."""

    def current():
        ids = {c.subscriber.pk for c in consumers}
        granted = defaultdict(set)
        through = Subscriber.subscribe_queues.through.objects.filter(subscriber_id__in=ids)
        for subscriber_id, queue_id in through.values_list("subscriber_id", "queue_id"):
            granted[subscriber_id].add(queue_id)
        rows = Subscriber.objects.filter(pk__in=ids).values_list(
            "pk", "token_hash", "is_active", "subscribe_all", "publish_all"
        )
        return {
            pk: (token_hash, active, (subscribe_all, publish_all, frozenset(granted[pk])))
            for pk, token_hash, active, subscribe_all, publish_all in rows
        }

    now = await db(current)()
    for c in consumers:
        token_hash, active, rights = now.get(c.subscriber.pk, (None, False, None))
        if (token_hash, active) != (c.subscriber.token_hash, True):
            asyncio.ensure_future(c.revoke())
        elif c.rights != rights:
            if c.rights is not None:  # the first look only learns them
                c.look_again()
            c.rights = rights


def _changed(subscriber_ids, channel_names):
    """An announcement (delivery.wakeups.announce), from any thread: the sockets it names
    look again, on their event loop."""
    loop = _loop
    if loop is None or loop.is_closed():
        return
    ids, names = set(subscriber_ids), set(channel_names)

    def look_again():
        for c in list(_open):
            if c.channel_name in names:
                asyncio.ensure_future(c.revoke(CLOSE_BY_OPERATOR, "closed by an operator"))
            elif c.subscriber.pk in ids:
                c.look_again()

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        look_again()
    else:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(look_again)


wakeups.on_change(_changed)


def token_from_scope(scope):
    query = parse_qs(scope.get("query_string", b"").decode("latin1"))
    if query.get("token"):
        return query["token"][0]
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            parts = value.decode("latin1").split()
            if len(parts) == 2 and parts[0].lower() == "bearer":
                return parts[1]
    return None


class DeliveryConsumer(AsyncWebsocketConsumer):
    # No channel layer: nothing is sent to a socket through it (wake-ups go through
    # delivery.wakeups), and with channels_redis every socket held a Redis connection blocked
    # in BZPOPMIN for nothing, which capped how many idle sockets a process could hold.
    channel_layer_alias = None
    subscriber = None
    pump_task = None
    ack_task = None
    publish_task = None
    release_task = None
    closing = False
    # Whether what the socket held on closing gets its attempt back: only when the server
    # closes it (its shutdown, an operator); a client that goes away spends them.
    give_back = False
    revoked = None  # why the server closed it (its held deliveries' last error)
    rights = None  # as check_tokens last saw them: a change makes the socket look again
    recheck_task = None
    recheck_wanted = False

    # --- life of a connection ---

    async def __call__(self, scope, receive, send):
        # The connection's name, as the presence table and a lease's holder know it.
        self.channel_name = liveness.holder(f"ws.{uuid.uuid4().hex}")
        try:
            await super().__call__(scope, receive, send)
        finally:
            # However the connection ends: a websocket.disconnect, a cancel (the server
            # stopping) or an error under it (the transport going away), the pump
            # stops and what the socket held goes back now. A pump left running after an error
            # would lease deliveries for a socket that is gone, again and again, until they die.
            await self.disconnect(None)

    async def connect(self):
        token = token_from_scope(self.scope)
        address = (self.scope.get("client") or ("", 0))[0] or ""
        self.subscriber = await db(subscriber_for_token)(token)
        await self.accept()
        if self.subscriber is None:
            # A missing token is no attempt; a bad one counts against the address.
            throttled = token and await db(auth_failed)(address)
            await self.close(code=limits.CLOSE_TOO_MANY if throttled else CLOSE_BAD_TOKEN)
            return
        self.ended = set()  # subscriptions ended by a revoked right, told to the client
        self.held = {}  # delivery id -> monotonic time its lease ends
        self.ack_buffer = []  # acked ids not yet written: a burst of ack frames is one write
        self.ack_task = None
        self.publish_buffer = []  # [(ref, queue name, outgoing)] not yet published
        self.wake = asyncio.Event()
        self.sending = asyncio.Lock()  # a lease and the sending of what it got are one step
        self.resume_at = time.monotonic() + RESUME_GRACE_SECS
        self.watching = wakeups.watch(self.subscriber.pk, self.wake)
        try:
            await db(presence.open_connection)(self.subscriber, self.channel_name, address)
        except limits.LimitExceeded as exc:  # too many sockets: say why, then close
            await self.send_json(FrameError.of_limit(exc).frame())
            await self.close(code=limits.CLOSE_TOO_MANY)
            return
        self.pump_task = asyncio.ensure_future(self.pump())
        _open.add(self)
        ensure_maintenance()
        self.wake.set()  # resume: what waited is sent first

    async def disconnect(self, code):
        if self.subscriber is None:
            return
        if self.release_task is None:
            self.release_task = asyncio.ensure_future(self.release())
        # Shielded, and shared by every caller: a cancel must not stop a release half way.
        await asyncio.shield(self.release_task)

    async def release(self):
        # Stop the pump and let a lease it has under way finish: cancelling the task would not
        # stop the database call in its thread, and a lease committed after the release below
        # would hold its deliveries until their ack deadline.
        self.closing = True
        self.wake.set()
        if self.pump_task is not None:
            # Its failure, if it failed, was logged where it happened: the release still runs.
            with contextlib.suppress(Exception):
                try:
                    await asyncio.wait_for(self.pump_task, timeout=10)
                except (TimeoutError, asyncio.CancelledError):
                    log.warning("pump of %s did not stop in time", self.channel_name)
        if self.ack_task is not None:
            try:
                await self.ack_task  # acks sent before the close count: write them first
            except Exception:  # unwritten, they come back: at least once
                log.warning("acks of %s were not written", self.channel_name, exc_info=True)
        if self.publish_task is not None:
            await self.publish_task  # publishes received before the close go in (it logs its errors)
        # What this socket held and had not acked is ready for another at once.
        await db(presence.close_connection)(
            self.channel_name, spend=not self.give_back, reason=self.revoked or ledger.CONNECTION_CLOSED
        )
        _open.discard(self)
        wakeups.unwatch(self.subscriber.pk, self.watching)

    async def pump(self):
        try:
            while not self.closing:
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=self.until_a_lease_ends())
                except TimeoutError:
                    pass
                self.wake.clear()
                if self.closing:
                    return
                grace = self.resume_at - time.monotonic()
                if grace > 0:
                    await asyncio.sleep(grace)
                    if self.closing:
                        return
                await self.send_ready()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("delivery pump of %s failed; closing the socket", self.channel_name)
            self.give_back = True  # our failure, not the client's
            with contextlib.suppress(Exception):  # the socket may be gone already
                await self.close(code=CLOSE_SERVER_ERROR)

    async def revoke(self, code=CLOSE_BAD_TOKEN, reason=REVOKED):
        """Close the socket from the server's side and hand back what it held, now."""
        if self.revoked or self.closing:
            return
        self.revoked = reason
        self.give_back = True  # the server's decision, not the client's failure
        await self.disconnect(None)  # first: by the close, what it held is ready for others
        with contextlib.suppress(Exception):  # the socket may be gone already
            await self.close(code=code)

    def look_again(self):
        """An announcement named this socket's subscriber: look again (one look at a time;
        announcements that arrive during one make one more)."""
        self.recheck_wanted = True
        if self.recheck_task is None or self.recheck_task.done():
            self.recheck_task = asyncio.ensure_future(self.recheck())

    async def recheck(self):
        while self.recheck_wanted and not self.closing and not self.revoked:
            self.recheck_wanted = False
            try:
                await self.apply_changes()
            except Exception:
                log.exception("looking again at the subscriber of %s failed", self.channel_name)

    async def apply_changes(self):
        pk = self.subscriber.pk

        def look():
            subscriber = Subscriber.objects.filter(pk=pk).first()
            if (
                subscriber is None
                or not subscriber.is_active
                or subscriber.token_hash != self.subscriber.token_hash
            ):
                return None, []
            forbidden = Subscription.objects.filter(subscriber=subscriber)
            if subscriber.subscribe_all:
                forbidden = forbidden.none()
            granted = Subscriber.subscribe_queues.through.objects.filter(subscriber_id=pk).values("queue_id")
            forbidden = forbidden.exclude(queue_id__in=granted)
            return subscriber, list(forbidden.values_list("id", "queue__name", "event__name"))

        subscriber, forbidden = await db(look)()
        if subscriber is None:
            await self.revoke()
            return
        self.subscriber = subscriber  # its rights as they are now (publish frames ask it)
        self.ended &= {i for i, _, _ in forbidden}  # a right given back resumes them
        ending = [(i, q, e) for i, q, e in forbidden if i not in self.ended]
        if not ending:
            return
        ids = [i for i, _, _ in ending]

        def release():
            # No wake-up: nobody may lease them while the right is withdrawn.
            return ledger.release_held([self.channel_name], reason=REVOKED, wake=False, subscription_ids=ids)

        async with self.sending:  # after any delivery of them being sent, before any other
            for delivery_id in await db(release)():
                self.held.pop(delivery_id, None)
            self.ended.update(ids)
            for i, queue, event in ending:
                frame = {"type": "unsubscribed", "subscription": i, "queue": queue, "event": event}
                await self.send_json({**frame, "reason": "forbidden"})
        self.wake.set()  # the window has room again

    def until_a_lease_ends(self):
        """Seconds until the first lease this socket holds runs out (its window opens then),
        at most HEARTBEAT_SECS."""
        ends = min(self.held.values(), default=math.inf)
        return min(max(ends - time.monotonic(), 0.05), presence.HEARTBEAT_SECS)

    async def send_ready(self):
        async with self.sending:
            now = time.monotonic()
            self.held = {i: until for i, until in self.held.items() if until > now}
            free = settings.MQ_PREFETCH - len(self.held)
            if free <= 0:
                return
            leased = await ledger.alease_deliveries(self.subscriber, limit=free, holder=self.channel_name)
            if self.closing:
                return  # the socket is gone: the release in disconnect() hands these back
            now_wall, now = time.time(), time.monotonic()
            for d in leased:
                self.held[d["id"]] = now + (d["ack_deadline"].timestamp() - now_wall)
                await self.send_json({"type": "message", **{k: d[k] for k in MESSAGE_FIELDS}})

    async def dispatch(self, message):
        # As Channels' own, without its close_old_connections() before every frame: that ran in
        # the one thread shared by every socket of the process, a thread hop per frame. Each
        # database call here is a db() call, which does the same in its own thread.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    # --- frames ---

    async def receive(self, text_data=None, bytes_data=None):
        raw = text_data if text_data is not None else bytes_data
        if self.revoked:
            return  # closed by the server: nothing more from it counts
        if len(raw) > settings.MQ_MAX_BODY_BYTES:
            await self.close(code=CLOSE_TOO_BIG)
            return
        if self.frame_rate.take() is not None:
            await self.refuse_frame(raw)
            return
        ref = None
        try:
            frame = self.parse(raw)
            ref = frame.get("ref")
            handler = self.handlers.get(frame.get("type"))
            if handler is None:
                raise FrameError(
                    "unknown_type",
                    f"Unknown frame type {frame.get('type')!r}; known: {', '.join(sorted(self.handlers))}.",
                )
            await handler(self, frame)
        except limits.LimitExceeded as exc:
            await self.send_json(FrameError.of_limit(exc).frame(ref))
        except FrameError as exc:
            await self.send_json(exc.frame(ref))

    @cached_property
    def frame_rate(self):
        return limits.FrameRate()

    async def refuse_frame(self, raw):
        """A frame over the socket's rate: not processed, but answered (a publish's sender must
        know it is not in); a socket that stays over the rate is closed."""
        if self.frame_rate.closed:
            return
        try:
            ref = self.parse(raw).get("ref")
        except FrameError:
            ref = None
        wait = self.frame_rate.wait
        detail = (
            f"Over {self.frame_rate.rate:g} frames a second (MQ_WS_FRAME_RATE, bursts of "
            f"{self.frame_rate.burst:g}): this frame was not processed; send it again later."
        )
        if self.frame_rate.abusive:
            detail += " The socket stayed over the rate, so it is closed (4429)."
        await self.send_json(
            FrameError("rate_limited", detail, retry_after=max(round(wait, 3), 0.001)).frame(ref)
        )
        if self.frame_rate.abusive:
            self.frame_rate.closed = True
            await self.close(code=limits.CLOSE_TOO_MANY)

    @staticmethod
    def parse(raw):
        try:
            frame = decode_json(raw)
        except BadJSON as exc:
            raise FrameError("bad_json", str(exc)) from None
        if not isinstance(frame, dict):
            raise FrameError("bad_frame", "A frame is a JSON object with a 'type'.")
        return frame

    async def on_subscribe(self, frame):
        queue, event = await self.resolve(frame)

        def subscribe():
            if not self.subscriber.may_subscribe(queue):
                raise FrameError("forbidden", f"{self.subscriber.name} may not subscribe to {queue.name}.")
            return subscribing.subscribe(self.subscriber, queue, event, limited=True)[0]

        async with self.sending:  # "subscribed" goes out before any delivery of it
            subscription = await db(subscribe)()
            await self.send_json(
                {"type": "subscribed", "subscription": subscription.pk, "queue": queue.name, "event": event}
            )
        self.wake.set()

    async def on_unsubscribe(self, frame):
        queue, event = await self.resolve(frame)

        def unsubscribe():
            subscription = (
                Subscription.objects.filter(subscriber=self.subscriber, queue=queue, event__name=event)
                if event is not None
                else Subscription.objects.filter(subscriber=self.subscriber, queue=queue, event__isnull=True)
            )
            subscription = subscription.first()
            if subscription is None:
                raise FrameError(
                    "not_subscribed", f"You have no subscription to {queue.name}/{event or '*'}."
                )
            subscription_id = subscription.pk  # gone from the object once deleted
            subscribing.unsubscribe(subscription)
            return subscription_id

        subscription_id = await db(unsubscribe)()
        await self.send_json(
            {"type": "unsubscribed", "subscription": subscription_id, "queue": queue.name, "event": event}
        )

    async def on_ack(self, frame):
        ids = self.ids_of(frame)
        unknown = [i for i in ids if not is_db_id(i)]
        self.ack_buffer += [i for i in ids if is_db_id(i)]
        for i in ids:
            self.held.pop(i, None)
        # The window has room now: lease the next ones while the acks are written, not after
        # (they are other rows; a catch-up waited a round trip per window for nothing).
        self.wake.set()
        if self.ack_task is None or self.ack_task.done():
            self.ack_task = asyncio.ensure_future(self.write_acks())
        if unknown:
            raise FrameError("unknown_ids", UNKNOWN_IDS, ids=unknown)

    async def write_acks(self):
        """Write buffered acks, one ledger call for all that arrived while the last ran."""
        while self.ack_buffer:
            ids, self.ack_buffer = self.ack_buffer, []
            _, unknown = await ledger.aack_deliveries(self.subscriber, ids)
            if unknown:
                await self.send_json(FrameError("unknown_ids", UNKNOWN_IDS, ids=unknown).frame())

    async def on_nack(self, frame):
        ids = self.ids_of(frame)
        retry_in = frame.get("retry_in")
        if retry_in is not None and (
            isinstance(retry_in, bool)
            or not isinstance(retry_in, int | float)
            or not 0 <= retry_in <= 7 * 86400
            or not math.isfinite(retry_in)
        ):
            raise FrameError("bad_frame", "retry_in must be a number of seconds from 0 to 604800.")
        error = frame.get("error")
        if error is not None and (
            not isinstance(error, str) or len(error) > MAX_NACK_ERROR_CHARS or not storable_text(error)
        ):
            raise FrameError("bad_frame", f"error must be text of at most {MAX_NACK_ERROR_CHARS} characters.")

        # One ledger call, one statement for every id (ledger.nack_deliveries).
        nacked = await ledger.anack_deliveries(
            self.subscriber, ids, retry_in=retry_in, error=ledger.nack_reason(error)
        )
        unknown, settled = nacked.unknown, list(nacked.settled)
        for i in ids:
            self.held.pop(i, None)
        self.wake.set()
        if unknown:
            raise FrameError("unknown_ids", UNKNOWN_IDS, ids=unknown)
        if settled:
            raise FrameError("already_settled", "These deliveries are already acked or dead.", ids=settled)

    async def on_publish(self, frame):
        """Checked here, published in order by write_publishes: the frames that arrive while one
        batch commits go together in the next (and, through group_commit, with other sockets'
        and requests' publishes to the same queue), so a client may keep many in flight."""
        queue_name = frame.get("queue")
        if not isinstance(queue_name, str):
            raise FrameError("bad_frame", "publish needs a 'queue' name.")
        if "payload" not in frame:
            raise FrameError("bad_frame", "publish needs a 'payload' (null is a payload).")
        try:
            outgoing = publishing.prepare(frame.get("event"), frame["payload"], frame.get("key"))
        except publishing.PayloadTooLarge as exc:
            raise FrameError("too_large", str(exc)) from None
        except publishing.BadMessage as exc:
            raise FrameError("bad_message", str(exc)) from None
        self.publish_buffer.append((frame.get("ref"), queue_name, outgoing))
        if self.publish_task is None or self.publish_task.done():
            self.publish_task = asyncio.ensure_future(self.write_publishes())
        if len(self.publish_buffer) >= publishing.MAX_BATCH:
            await asyncio.shield(self.publish_task)  # back-pressure: read no more until written

    async def write_publishes(self):
        try:
            while self.publish_buffer:
                batch, self.publish_buffer = self.publish_buffer, []
                for ref, answer in await self.publish_in_order(batch):
                    if isinstance(answer, FrameError):
                        await self.send_json(answer.frame(ref))
                        continue
                    frame = {"type": "published", **{k: answer[k] for k in PUBLISHED_FIELDS}}
                    await self.send_json({**frame, "ref": ref} if ref is not None else frame)
        except Exception:
            # Unanswered, these publishes may or may not be in: the client publishes them
            # again (with their keys, once), as after any dropped connection.
            log.exception("publishing for %s failed; closing the socket", self.channel_name)
            self.give_back = True  # our failure, not the client's
            with contextlib.suppress(Exception):
                await self.close(code=CLOSE_SERVER_ERROR)

    async def publish_in_order(self, batch):
        """[(ref, answer or FrameError)] for [(ref, queue name, outgoing)]: each run of frames
        for one queue is one publish, so their seqs follow the order the frames came in."""
        answers, start = [], 0
        while start < len(batch):
            name = batch[start][1]
            end = start
            while end < len(batch) and batch[end][1] == name:
                end += 1
            run = batch[start:end]
            error = _bad_queue_name(name)
            queue = await publishing.afind_queue(name) if error is None else None
            if error is None and queue is None:
                error = FrameError("not_found", f"There is no queue named {name!r}.")
            elif error is None and not await self.subscriber.amay_publish(queue):
                error = FrameError("forbidden", f"{self.subscriber.name} may not publish to {queue.name}.")
            if error is None:
                try:
                    published = await group_commit.apublish(
                        queue, [o for _, _, o in run], publisher=self.subscriber
                    )
                except limits.LimitExceeded as exc:
                    error = FrameError.of_limit(exc)
            if error is None:
                answers += [(ref, answer) for (ref, _, _), (answer, _) in zip(run, published, strict=True)]
            else:
                answers += [(ref, error) for ref, _, _ in run]
            start = end
        return answers

    async def on_ping(self, frame):
        await self.send_json({"type": "pong", **({"ref": frame["ref"]} if "ref" in frame else {})})

    handlers = {
        "subscribe": on_subscribe,
        "unsubscribe": on_unsubscribe,
        "ack": on_ack,
        "nack": on_nack,
        "publish": on_publish,
        "ping": on_ping,
    }

    # --- helpers ---

    async def resolve(self, frame):
        """The queue and event name of a (un)subscribe frame."""
        name, event = frame.get("queue"), frame.get("event")
        if not isinstance(name, str):
            raise FrameError("bad_frame", "This frame needs a 'queue' name.")
        if event is not None:
            try:
                event = clean_name(event, "event")
            except BadName as exc:
                raise FrameError("bad_name", str(exc)) from None
        error = _bad_queue_name(name)
        if error is not None:
            raise error
        queue = await db(publishing.find_queue)(name)
        if queue is None:
            raise FrameError("not_found", f"There is no queue named {name!r}.")
        return queue, event

    @staticmethod
    def ids_of(frame):
        ids = frame.get("ids")
        if (
            not isinstance(ids, list)
            or len(ids) > 10000
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise FrameError("bad_frame", "'ids' must be a list of delivery ids (whole numbers).")
        return ids

    async def send_json(self, content):
        await self.send(text_data=json.dumps(content, cls=JSONEncoder))


def _bad_queue_name(name):
    """The error frame for a queue name that breaks the naming rule, or None."""
    try:
        clean_name(name, "queue")
    except BadName as exc:
        return FrameError("bad_name", str(exc))
    return None
