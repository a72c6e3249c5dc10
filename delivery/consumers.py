"""The websocket at /ws/: live delivery, with the same ledger as pull.

Notify-then-lease: a wake-up (the bus's `wake` word, heard by delivery.wakeups) only says
"subscriber N may have work"; the socket whose turn it is leases from the ledger up to its free
prefetch window and sends what it got. It does so on connect (the catch-up: every subscription
of the subscriber resumes by itself), on a wake-up, after an ack or nack frees room, and when a
lease it holds runs out. Several sockets of one subscriber (a service's workers) take turns:
each leases a share and passes the turn on when it leaves work behind, so N workers each get
about 1/N of a stream.

This module is the frame protocol of one connection; delivery.frames says what each frame
holds, and delivery.socket_loops runs what every process does for all its sockets (heartbeat,
the recheck of a lost wake-up, the token check, the listener of other processes). Each
database call is one db() call, so the event loop never waits on a query per row.
"""

import asyncio
import contextlib
import logging
import math
import time
import uuid
from functools import cached_property
from typing import NamedTuple
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from delivery import group_commit, observe, presence, publishing, subscribing
from mqsite import limits, log_context
from mqsite.client_address import scope_client_address
from mqsite.values import is_db_id
from queues import lookup
from subscribers import replay
from subscribers.auth import auth_failed, subscriber_for_token
from subscribers.models import Subscriber, Subscription, may_subscribe_q

from . import frames, inline, ledger, liveness, receipts, socket_loops, spans, wakeups
from .frames import (
    CLOSE_BAD_TOKEN,
    CLOSE_SERVER_ERROR,
    CLOSE_TOO_BIG,
    REVOKED,
    UNKNOWN_IDS,
    FrameError,
)
from .socket_loops import db

log = logging.getLogger(__name__)

# A socket hands out nothing in its first moments: a client that reconnects and sends its
# subscribe frames again gets each "subscribed" answer before the catch-up, in the order of
# the contract, rather than racing the automatic resume. At most this long: the grace ends as
# soon as the socket knows it has nothing more to wait for (DeliveryConsumer.end_grace).
RESUME_GRACE_SECS = 0.2
# How long a socket opened without a token may take to send its `auth` frame: long enough for
# a page on a slow link, short enough that sockets opened and left silent cost little.
AUTH_WAIT_SECS = 10
# What a socket leases at its turn while other sockets of its subscriber share the stream: a
# backlog is dealt out in shares this big, round-robin (alone, a socket fills its window).
FAIR_SHARE = 10
# A socket alone on its subscriber's stream leases ahead: with what fills its window, as many
# again as its client's acks just made room for (at most a window), held here unsent. The next
# acks are answered from them at once, while the next lease runs, rather than after its round
# trip. Not sent within this long (the client stopped acking), they are given back, their
# attempt with them, for a socket that will take them.
AHEAD_SECS = 0.5
# A socket whose lease got all it asked for, from its subscriber's one unordered subscription,
# leases the next ones from it with no read first (ledger.alease_again), for at most this long
# before a full lease again (which expires overdue leases and finds other subscriptions).
AGAIN_SECS = 0.25


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
    # mqsite.bus and delivery.wakeups), and with channels_redis every socket held a Redis
    # connection blocked in BZPOPMIN for nothing, which capped how many idle sockets a process could hold.
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
    authenticating = False  # an `auth` frame is being checked
    waiting_for_auth = False  # counted in limits.unauthenticated until its `auth` frame
    auth_timer = None
    revoked = None  # why the server closed it (its held deliveries' last error)
    rights = None  # as check_tokens last saw them: a change makes the socket look again
    recheck_task = None
    recheck_wanted = False
    # This socket's window: MQ_PREFETCH, or less if its auth or a subscribe frame asked for
    # less (`prefetch`, an extension: a slow worker holds no more than it can work on).
    prefetch = None
    # Set when the resume grace is over (end_grace); None until authenticated.
    resumed = None
    # Ids of the subscriptions the subscriber held when this socket opened that no subscribe
    # frame of it has named yet: the grace waits for these.
    unnamed = frozenset()
    # Room held in the window for publishes of this process under way (delivery.inline), and
    # the futures of those seats, each done once what it got is held and sent.
    seated = 0
    seats = frozenset()

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
        await self.accept()
        if token is None:
            # Authentication after open (API.md, Extensions): a browser need not put its token
            # in a URL that logs keep. Until the `auth` frame, the socket holds nothing and
            # answers nothing else; one that never sends it is closed after AUTH_WAIT_SECS.
            # Such sockets are counted by address: one client cannot hold thousands of them.
            try:
                limits.unauthenticated.admit(self.address)
            except limits.LimitExceeded as exc:
                await self.send_json(FrameError.of_limit(exc).frame())
                await self.close(code=limits.CLOSE_TOO_MANY)
                return
            self.waiting_for_auth = True
            self.auth_timer = asyncio.get_running_loop().call_later(AUTH_WAIT_SECS, self.auth_too_late)
            return
        await self.authenticate(token)

    @cached_property
    def address(self):
        return scope_client_address(self.scope)

    def stop_waiting_for_auth(self):
        """The socket no longer counts as unauthenticated: its `auth` frame came, or it closed."""
        if self.waiting_for_auth:
            self.waiting_for_auth = False
            limits.unauthenticated.release(self.address)

    def auth_too_late(self):
        if self.subscriber is None and not self.authenticating:
            asyncio.ensure_future(self.close(code=CLOSE_BAD_TOKEN))

    async def on_auth(self, frame):
        token = frame.get("token")
        if self.subscriber is not None or self.authenticating:
            raise FrameError("bad_frame", "This socket is authenticated already.")
        if not isinstance(token, str) or not token:
            raise FrameError("bad_frame", "auth needs a token (a string).")
        prefetch = frames.prefetch_of(frame)  # the window from the resume's first lease on
        self.authenticating = True
        self.auth_timer.cancel()
        self.stop_waiting_for_auth()
        await self.authenticate(token, prefetch)

    async def authenticate(self, token, prefetch=None):
        """Look the token up and start the connection (presence, the pump, the resume); or
        close the socket: 4401, or 4429 past the address's failed attempts. Whether it started."""
        address = self.address
        subscriber = await db(subscriber_for_token)(token)
        if subscriber is None:
            throttled = await db(auth_failed)(address)  # a bad token counts against the address
            await self.close(code=limits.CLOSE_TOO_MANY if throttled else CLOSE_BAD_TOKEN)
            return False
        self.ended = set()  # subscriptions ended by a revoked right, told to the client
        # (queue, event or None) of the subscriptions whose deliveries go out as `messages`
        # frames (a lease names the queue and event of each delivery, not its subscription)
        self.batched = set()
        self.held = {}  # delivery id -> monotonic time its lease ends
        self.ahead = []  # leased for this socket beyond its window, not sent yet (send_ahead)
        self.made_room = 0  # deliveries its client settled since its last lease (send_ready)
        self.again = None  # (ledger.Again, until when) for the next lease (send_ready)
        self.ordered_held = set()  # those of them of ordered queues
        self.ordered_acked = []  # acked ones of them: their next heads are leased after the commit
        self.ack_buffer = []  # acked ids not yet written: a burst of ack frames is one write
        self.ack_task = None
        self.publish_buffer = []  # [_Publish] not yet published
        self.publish_buffered = 0  # messages in it
        self.receipts = receipts.Owed(self.send_json, subscriber.pk)  # the receipts this socket owes
        self.prefetch = min(prefetch or settings.MQ_PREFETCH, settings.MQ_PREFETCH)
        self.wake = asyncio.Event()
        self.sending = asyncio.Lock()  # a lease and the sending of what it got are one step
        self.resume_at = time.monotonic() + RESUME_GRACE_SECS
        self.resumed = asyncio.Event()

        def open_connection():
            presence.open_connection(subscriber, self.channel_name, address)
            # In the same thread hop: what the grace waits for.
            held = Subscription.objects.filter(subscriber=subscriber, leaving=False)
            return list(held.values_list("pk", "queue_id"))

        try:
            held = await db(open_connection)()
        except limits.LimitExceeded as exc:  # too many sockets: say why, then close
            await self.send_json(FrameError.of_limit(exc).frame())
            await self.close(code=limits.CLOSE_TOO_MANY)
            return False
        # From here on the socket is its subscriber's: disconnect() releases what it holds.
        self.subscriber = subscriber
        log_context.bind(subscriber=subscriber.pk)  # this socket's task's lines, and its pump's
        self.unnamed = {pk for pk, _ in held}
        self.seats = set()
        if not self.unnamed:
            self.end_grace()  # nothing to resume: no subscribe frame need be waited for
        if self.authenticating:  # before the pump starts: the resume comes after `authenticated`
            await self.send_json({"type": "authenticated", "subscriber": subscriber.name})
        self.watching = wakeups.watch(subscriber.pk, self.wake, self.has_room)
        if settings.REDIS_URL and await db(presence.held_elsewhere)([subscriber.pk], liveness.name()):
            wakeups.joined_elsewhere(subscriber.pk)  # its workers there share with this one
        self.pump_task = asyncio.ensure_future(self.pump())
        socket_loops.opened(self)
        inline.listen(self, {queue_id for _, queue_id in held})
        self.wake.set()  # resume: what waited is sent first
        return True

    async def disconnect(self, code):
        if self.auth_timer is not None:
            self.auth_timer.cancel()
        self.stop_waiting_for_auth()
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
        inline.forget(self)
        self.wake.set()
        self.end_grace()  # a pump waiting out the grace stops now, not at its end
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
        if self.seats:
            # What publishes under way give this socket is in flight to it once they commit:
            # the release below must come after, or it would wait for its ack deadline.
            await asyncio.wait(list(self.seats), timeout=10)
        # What this socket held and had not acked is ready for another at once; what it leased
        # ahead and never sent, its attempt given back.
        unsent, self.ahead = [d["id"] for d in self.ahead], []
        await db(presence.close_connection)(
            self.channel_name,
            spend=not self.give_back,
            reason=self.revoked or ledger.CONNECTION_CLOSED,
            unsent=unsent,
        )
        socket_loops.closed(self)
        wakeups.unwatch(self.subscriber.pk, self.watching)
        self.receipts.close()

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
                if not self.resumed.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.resumed.wait(), self.resume_at - time.monotonic())
                    self.end_grace()
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

    def end_grace(self, named=None):
        """The resume grace ends, and the catch-up starts, at the first of: RESUME_GRACE_SECS
        after authentication; a subscribe frame of this socket having named (`named`, its
        subscription's id) each subscription the subscriber held when the socket opened; a
        frame of any other kind (`named` None).

        Why these: the grace exists so that a client that reconnects and sends its subscribe
        frames again gets each `subscribed` before deliveries of it. Such a client sends them
        first (the Python client: auth, its subscribe frames, then the acks of what finished
        while it was away), so once each subscription is named again, or once the client sends
        anything else, there is nothing left to wait for, and a catch-up that waited the whole
        0.2 s spent 28 % of its time waiting (a tenth-size W4). A client that sends nothing (a
        worker that only consumes) cannot be told from one whose subscribe frames are still on
        the way, so it waits at most RESUME_GRACE_SECS, as before. A subscriber with no
        subscription has nothing to resume: each subscribe's answer goes before its deliveries
        anyway (on_subscribe holds the sending lock)."""
        if self.resumed is None:  # not authenticated: there is no grace yet
            return
        if named is not None:
            self.unnamed.discard(named)
            if self.unnamed:
                return
        self.resumed.set()

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
            forbidden = Subscription.objects.filter(subscriber=subscriber).exclude(may_subscribe_q())
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

        # Nothing leased ahead of them goes out any more (the release below gives it back).
        dropped = self.drop_ahead({(queue, event) for _, queue, event in ending})
        async with self.sending:  # after any delivery of them being sent, before any other
            released = set(await db(release)())
            for delivery_id in released:
                self.held.pop(delivery_id, None)
            self.ahead = [d for d in self.ahead if d["id"] not in released]
            await self.give_back_unsent([i for i in dropped if i not in released])
            self.ended.update(ids)
            for i, queue, event in ending:
                frame = {"type": "unsubscribed", "subscription": i, "queue": queue, "event": event}
                await self.send_json({**frame, "reason": "forbidden"})
        self.wake.set()  # the window has room again

    def until_a_lease_ends(self):
        """Seconds until the first lease this socket holds runs out (its window opens then), or
        what it leased ahead is to be given back, at most HEARTBEAT_SECS."""
        ends = min(self.held.values(), default=math.inf)
        ends = min(ends, min((d["stale_at"] for d in self.ahead), default=math.inf))
        return min(max(ends - time.monotonic(), 0.05), presence.HEARTBEAT_SECS)

    def has_room(self):
        """Whether this socket's window could take a delivery now (read from any thread, by a
        wake-up choosing whose turn it is: a hint, as the wake-up itself is)."""
        return not self.closing and self.window_free() > 0

    def window_free(self):
        """Room in the window: the prefetch less what is sent and unacked and what publishes of
        this process under way hold for this socket (delivery.inline). What was leased ahead
        and not sent is outside it."""
        return self.prefetch - len(self.held) - self.seated

    def room(self):
        """How many deliveries a publish of this process may hand this socket now
        (delivery.inline): none while closing or in its resume grace; a share, as at a turn of
        send_ready(), while other sockets of its subscriber here share the stream."""
        if self.closing or not self.resumed.is_set() or self.ahead:
            return 0  # a catch-up under way (leased ahead) is served first, in its order
        free = self.window_free()
        return min(free, FAIR_SHARE) if wakeups.sockets_of(self.subscriber.pk) > 1 else free

    def reserve(self, seat):
        self.seated += seat.room
        self.seats.add(seat.done)

    def unreserve(self, seat):
        if not seat.done.done():
            self.seated -= seat.room
            self.seats.discard(seat.done)
            seat.done.set_result(None)

    async def take_seated(self, seat, got):
        """What a publish of this process made in flight to this socket (delivery.inline), as
        (subscription id, delivery), committed: counted in the window and sent, as a lease's
        would be (after the `subscribed` of its subscription: the sending lock). Not of a
        subscription whose right was withdrawn meanwhile (it stays in flight until its
        deadline, leased to nobody after), nor to a socket that is closing (its release after
        this hands them back)."""
        try:
            async with self.sending:
                # Committed: what it got takes the seat's room in the window (below) instead.
                self.unreserve(seat)
                if not self.closing:
                    await self.hold_and_send([d for sub, d in got if sub not in self.ended])
        except Exception:
            log.warning("deliveries to %s not sent: redelivered later", self.channel_name, exc_info=True)
        finally:
            self.unreserve(seat)

    async def send_ready(self):
        pk = self.subscriber.pk
        async with self.sending:
            now = time.monotonic()
            self.held = {i: until for i, until in self.held.items() if until > now}
            await self.give_back_stale(now)
            await self.send_ahead()
            free = self.window_free()
            sharing = wakeups.sockets_of(pk) > 1 or wakeups.shared_with_other_processes(pk)
            made_room, self.made_room = self.made_room, 0
            ahead = self.to_lease_ahead(made_room, sharing)
            want = (min(free, FAIR_SHARE) if sharing else max(free, 0)) + ahead
            if want <= 0:
                wakeups.pass_turn(pk)  # woken while full: another socket with room takes it
                return
            leased = await self.lease(want, sharing, now)
            if self.closing:
                # The socket is gone: the release in disconnect() hands these back, unsent.
                self.ahead += leased
                return
            await self.hold_and_send(leased)
        if sharing and len(leased) == want:
            wakeups.pass_turn(pk)  # more may be ready: the next socket's turn (or ours again)

    async def lease(self, want, sharing, now):
        """Lease up to `want` for this socket: from the subscription its last lease read when
        that got all it asked for (AGAIN_SECS), else the whole lease."""
        again, self.again = self.again, None
        if again is not None and not sharing and again[1] > now:
            leased = await ledger.alease_again(
                self.subscriber, again[0], limit=want, holder=self.channel_name
            )
            if len(leased) == want:
                self.again = again
            return leased
        found = []
        leased = await ledger.alease_deliveries(
            self.subscriber, limit=want, holder=self.channel_name, framed=True, found=found
        )
        if found and len(leased) == want:
            self.again = (found[0], now + AGAIN_SECS)
        return leased

    def to_lease_ahead(self, made_room, sharing):
        """How many to lease ahead: up to twice what the client settled since the last lease,
        at most a window (a client that drains its window fast finds the next one here, a slow
        one is not held more than it takes); none while other sockets share the stream (what
        one holds ahead, another could take), nor for a socket that asked for a smaller window
        than the server's (a slow worker holds only what it can work on: docs/websocket.md)."""
        if sharing or self.prefetch < settings.MQ_PREFETCH:
            return 0
        return max(min(2 * made_room, self.prefetch - len(self.ahead)), 0)

    async def hold_and_send(self, leased):
        """Count what a lease got in the window (until its ack deadline) and send it; what the
        window has no room for is kept, leased ahead (send_ahead sends it)."""
        now_wall, now = time.time(), time.monotonic()
        for d in leased:
            d["until"] = until = now + (d["ack_deadline"].timestamp() - now_wall)
            d["stale_at"] = min(now + AHEAD_SECS, until - AHEAD_SECS)
        fits = max(self.window_free(), 0)
        self.ahead += leased[fits:]
        await self.hold_and_send_now(leased[:fits])

    async def hold_and_send_now(self, leased):
        for d in leased:
            self.held[d["id"]] = d["until"]
        self.ordered_held.intersection_update(self.held)
        self.ordered_held.update(await self.of_ordered_queues(leased))
        await self.send_deliveries(leased)

    async def send_ahead(self):
        """Send what was leased ahead, as far as the window has room: no lease waited for.
        Without the sending lock (an ack frame's room is filled at once, while the pump may be
        leasing): these are this socket's already, and a revocation drops its own from them
        first (apply_changes)."""
        fits = self.window_free()
        if fits <= 0 or not self.ahead or self.closing:
            return  # closing: the release gives them back unsent
        now = time.monotonic()
        out, self.ahead = self.ahead[:fits], self.ahead[fits:]
        # One past its time is not sent: give_back_stale() hands it back.
        self.ahead += [d for d in out if d["stale_at"] <= now]
        await self.hold_and_send_now([d for d in out if d["stale_at"] > now])

    async def give_back_stale(self, now):
        """What was leased ahead and not sent within AHEAD_SECS (or close to its deadline) goes
        back to pending, its attempt given back: the client has stopped acking."""
        stale = [d["id"] for d in self.ahead if d["stale_at"] <= now]
        if not stale:
            return
        self.ahead = [d for d in self.ahead if d["stale_at"] > now]
        await self.give_back_unsent(stale, wake=False)

    def drop_ahead(self, subscriptions):
        """Take what was leased ahead of these (queue, event or None) subscriptions out, so
        that none of it goes out any more; their ids. (A delivery names its queue and event,
        not its subscription: one of another subscription to the same ones is taken out too,
        and its caller gives it back.)"""
        dropped = [d["id"] for d in self.ahead if _of(d, subscriptions)]
        if dropped:
            self.ahead = [d for d in self.ahead if not _of(d, subscriptions)]
        return dropped

    async def give_back_unsent(self, unsent, wake=True):
        """These deliveries, leased ahead and not sent, go back to pending, their attempt given
        back (those gone or acked meanwhile are left as they are)."""
        if unsent:
            await db(ledger.release_held)(
                [self.channel_name], reason=ledger.NOT_SENT, wake=wake, delivery_ids=unsent
            )

    async def of_ordered_queues(self, leased):
        """The ids of those deliveries whose queue is ordered (queues are kept in the process:
        no query on PostgreSQL's async path)."""
        ordered = set()
        for name in {d["queue"] for d in leased}:
            queue = await lookup.afind_queue(name)
            if queue is not None and queue.ordered:
                ordered.add(name)
        return {d["id"] for d in leased if d["queue"] in ordered}

    @spans.sent_frames
    async def send_deliveries(self, leased):
        """Each as a `message` frame, but those of subscriptions asked with `batch` together in
        one `messages` frame (after the single ones, each subscription's in seq order)."""
        batch = []
        for d in leased:
            if (d["queue"], d["event"]) in self.batched or (d["queue"], None) in self.batched:
                batch.append(frames.message_text(d))
            else:
                await self.send(text_data=frames.message_text(d))
        if batch:
            await self.send(text_data=frames.messages_text(batch))

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
        if len(raw) > settings.MQ_MAX_BODY_BYTES or (
            self.subscriber is None and frames.too_big_before_auth(raw)
        ):
            await self.close(code=CLOSE_TOO_BIG)
            return
        if self.frame_rate.take() is not None:
            await self.refuse_frame(raw)
            return
        ref = None
        try:
            frame = frames.parse(raw) if frames.is_small(raw) else await frames.parse_big(raw)
            ref = frame.get("ref")
            handler = self.handlers.get(frame.get("type"))
            if self.subscriber is None and frame.get("type") != "auth":
                if self.authenticating:
                    return  # its auth failed: the socket is closing
                raise FrameError("unauthenticated", 'Send {"type": "auth", "token": ...} first.')
            if handler is None:
                raise FrameError(
                    "unknown_type",
                    f"Unknown frame type {frame.get('type')!r}; known: {', '.join(sorted(self.handlers))}.",
                )
            if frame.get("type") != "subscribe":
                self.end_grace()  # the client is past its subscribe frames: resume now
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
        ref = frames.ref_of(raw)
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

    async def on_subscribe(self, frame):
        queue, event = await self.resolve(frame)
        batch = frame.get("batch", False)
        if not isinstance(batch, bool):
            raise FrameError("bad_frame", "batch must be true or false.")
        prefetch = frames.prefetch_of(frame)

        point = frames.replay_point_of(frame)
        filter_ = frames.filter_of(frame)

        def subscribe():
            if not self.subscriber.may_subscribe(queue):
                raise FrameError("forbidden", f"{self.subscriber.name} may not subscribe to {queue.name}.")
            if point is None:
                subscription = subscribing.subscribe(
                    self.subscriber, queue, event, limited=True, filter=filter_
                )[0]
                return subscription, {"filter": subscription.filter}
            subscription, _, replayed = subscribing.subscribe_from(
                self.subscriber, queue, event, point, limited=True, filter=filter_
            )
            return subscription, {"filter": subscription.filter, "replay": replay.answer_of(replayed)}

        async with self.sending:  # "subscribed" goes out before any delivery of it
            subscription, replayed = await db(subscribe)()
            self.again = None  # the next lease reads: this subscription too
            (self.batched.add if batch else self.batched.discard)((queue.name, event))
            if prefetch is not None:  # the socket's window, whichever subscription asks: last wins
                self.prefetch = min(prefetch, settings.MQ_PREFETCH)
            await self.send_json(
                frames.with_ref(
                    {
                        "type": "subscribed",
                        "subscription": subscription.pk,
                        "queue": queue.name,
                        "event": event,
                        **replayed,
                    },
                    frame.get("ref"),
                )
            )
        self.end_grace(named=subscription.pk)
        inline.listen(self, [queue.pk])
        self.wake.set()

    async def on_unsubscribe(self, frame):
        queue, event = await self.resolve(frame)
        # None of what was leased ahead of it goes out after `unsubscribed` (the unsubscribe
        # drops it; one of another subscription to the same queue and event is given back).
        dropped = self.drop_ahead({(queue.name, event)})

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

        self.again = None  # the next lease reads
        try:
            subscription_id = await db(unsubscribe)()
        finally:
            await self.give_back_unsent(dropped)
        self.batched.discard((queue.name, event))
        answer = {"type": "unsubscribed", "subscription": subscription_id, "queue": queue.name}
        await self.send_json(frames.with_ref({**answer, "event": event}, frame.get("ref")))

    async def on_ack(self, frame):
        ids = frames.ids_of(frame)
        unknown = [i for i in ids if not is_db_id(i)]
        self.ack_buffer += [i for i in ids if is_db_id(i)]
        was_full = self.window_free() <= 0
        ordered = [i for i in ids if i in self.ordered_held]
        self.made_room += sum(self.held.pop(i, None) is not None for i in ids)
        # An ordered queue's next message is leasable only once this ack commits: write_acks
        # leases it then, since a lease before would find the head still in flight, and
        # nothing else would come to lease it.
        self.ordered_held.difference_update(ordered)
        self.ordered_acked += ordered
        from_ahead = bool(self.ahead) and self.window_free() > 0
        if from_ahead:
            self.wake.set()  # the pump leases ahead again, while send_ahead() below fills the room
        elif was_full and len(ordered) < len(ids):
            # The window has room now: lease the next ones while the acks are written, not
            # after (they are other rows; a catch-up waited a round trip per window for
            # nothing). A window that had room took all that was ready at its last lease:
            # woken now, it would make an empty lease per ack (new messages wake it anyway).
            self.wake.set()
        if self.ack_task is None or self.ack_task.done():
            self.ack_task = asyncio.ensure_future(self.write_acks())
        if from_ahead:
            await self.send_ahead()
        if unknown:
            raise FrameError("unknown_ids", UNKNOWN_IDS, ids=unknown)

    async def write_acks(self):
        """Write buffered acks, one ledger call for all that arrived while the last ran."""
        while self.ack_buffer:
            ids, self.ack_buffer = self.ack_buffer, []
            ordered, self.ordered_acked = self.ordered_acked, []
            try:
                _, unknown = await ledger.aack_deliveries(self.subscriber, ids)
            except BaseException:
                if ordered:
                    self.wake.set()  # the pump looks again, acked or not
                raise
            if ordered:
                await self.send_heads(ordered)
            if unknown:
                await self.send_json(FrameError("unknown_ids", UNKNOWN_IDS, ids=unknown).frame())

    async def send_heads(self, acked):
        """Lease and send the next head of the ordered subscriptions whose deliveries `acked`
        were just acked (committed)."""
        async with self.sending:
            free = self.window_free()
            if free <= 0 or self.closing:
                return
            leased = await ledger.alease_heads_after(
                self.subscriber, acked, limit=free, holder=self.channel_name, framed=True
            )
            if self.closing:
                return  # the socket is gone: the release in disconnect() hands these back
            await self.hold_and_send(leased)

    async def on_nack(self, frame):
        ids, retry_in, error = frames.nack_of(frame)

        # One ledger call, one statement for every id (ledger.nack_deliveries).
        nacked = await ledger.anack_deliveries(
            self.subscriber, ids, retry_in=retry_in, error=ledger.nack_reason(error)
        )
        unknown, settled = nacked.unknown, list(nacked.settled)
        self.made_room += sum(self.held.pop(i, None) is not None for i in ids)
        self.wake.set()
        if unknown:
            raise FrameError("unknown_ids", UNKNOWN_IDS, ids=unknown)
        if settled:
            raise FrameError("already_settled", "These deliveries are already acked or dead.", ids=settled)

    async def on_extend(self, frame):
        ids, seconds = frames.extend_of(frame)
        # Only the leases this socket holds: a delivery keeps its id across attempts, so a late
        # extend must not prolong the lease another connection took after this one's expired.
        extended = await ledger.aextend_deliveries(self.subscriber, ids, seconds, holder=self.channel_name)
        until = time.monotonic() + seconds
        for i in extended.ids:
            if i in self.held:  # its window and its wake-up at the deadline follow the lease
                self.held[i] = until
        if extended.unknown:
            # As an ack frame's unknown ids, with the REST answer's fields beside them.
            raise FrameError(
                "unknown_ids",
                frames.NOT_EXTENDED,
                ids=extended.unknown,
                extended=len(extended.ids),
                unknown=extended.unknown,
            )

    async def on_publish(self, frame):
        """Checked here, published in order by write_publishes: the frames that arrive while one
        batch commits go together in the next (and, through group_commit, with other sockets'
        and requests' publishes to the same queue), so a client may keep many in flight. A
        batch frame (`messages`) is all or nothing, and answered by one `published` frame."""
        queue_name = frame.get("queue")
        if not isinstance(queue_name, str):
            raise FrameError("bad_frame", "publish needs a 'queue' name.")
        outgoing, batch = frames.outgoing_of(frame)
        outgoing = frames.receipt_of(frame, outgoing)
        receipt = outgoing[0].receipt
        if receipt:
            self.receipts.book(len(outgoing))  # too_many_receipts past the subscriber's cap
        self.publish_buffer.append(_Publish(frame.get("ref"), queue_name, outgoing, batch, receipt))
        self.publish_buffered += len(outgoing)
        if self.publish_task is None or self.publish_task.done():
            self.publish_task = asyncio.ensure_future(self.write_publishes())
        if self.publish_buffered >= publishing.MAX_BATCH:
            await asyncio.shield(self.publish_task)  # back-pressure: read no more until written

    async def write_publishes(self):
        try:
            while self.publish_buffer:
                batch, self.publish_buffer, self.publish_buffered = self.publish_buffer, [], 0
                waiting = []
                for p, answers in await self.publish_in_order(batch):
                    if isinstance(answers, FrameError):
                        await self.send_json(answers.frame(p.ref))
                    else:
                        await self.send_json(frames.published_frame([a for a, _ in answers], p.batch, p.ref))
                        if p.receipt:
                            waiting += await self.receipts.published(answers, p.ref)
                    if p.receipt:  # once awaited (not before: the cap counts them throughout)
                        self.receipts.unbook(len(p.outgoing))
                if waiting:
                    await self.receipts.check(waiting)
        except Exception:
            # Unanswered, these publishes may or may not be in: the client publishes them
            # again (with their keys, once), as after any dropped connection.
            log.exception("publishing for %s failed; closing the socket", self.channel_name)
            self.give_back = True  # our failure, not the client's
            with contextlib.suppress(Exception):
                await self.close(code=CLOSE_SERVER_ERROR)

    async def publish_in_order(self, publishes):
        """[(publish, its [(answer, created)] or a FrameError)] for the buffered publish frames: each run
        of frames for one queue (up to MAX_BATCH messages, a frame never split) is one
        publish, so their seqs follow the order the frames came in."""
        answers = []
        for name, run in _runs(publishes):
            queue, error, refused = None, None, {}
            try:
                frames.check_queue_name(name)
                queue = await lookup.afind_queue(name)
                if queue is None:
                    raise FrameError("not_found", f"There is no queue named {name!r}.")
                if not await self.subscriber.amay_publish(queue):
                    raise FrameError("forbidden", f"{self.subscriber.name} may not publish to {queue.name}.")
                # Each frame against its schemas alone, before the run goes together: a frame
                # that fails is refused whole, and fails none of the others.
                refused = await _schema_refusals(queue, run)
                with observe.publishing("websocket"):
                    published = await group_commit.apublish(
                        queue,
                        [o for p in run if id(p) not in refused for o in p.outgoing],
                        publisher=self.subscriber,
                        checked=True,
                    )
            except FrameError as exc:
                error = exc
            except limits.LimitExceeded as exc:
                error = FrameError.of_limit(exc)
            start = 0
            for p in run:
                if error is not None or id(p) in refused:
                    answers.append((p, refused.get(id(p), error)))
                    continue
                answers.append((p, published[start : start + len(p.outgoing)]))
                start += len(p.outgoing)
        return answers

    async def on_ping(self, frame):
        await self.send_json({"type": "pong", **({"ref": frame["ref"]} if "ref" in frame else {})})

    handlers = {
        "auth": on_auth,
        "subscribe": on_subscribe,
        "unsubscribe": on_unsubscribe,
        "ack": on_ack,
        "nack": on_nack,
        "extend": on_extend,
        "publish": on_publish,
        "ping": on_ping,
    }

    # --- helpers ---

    async def resolve(self, frame):
        """The queue and event name of a (un)subscribe frame."""
        name = frames.queue_name_of(frame)
        event = frames.event_of(frame)
        queue = await db(lookup.find_queue)(name)
        if queue is None:
            raise FrameError("not_found", f"There is no queue named {name!r}.")
        return queue, event

    async def send_json(self, content):
        await self.send(text_data=frames.encode(content))


def _of(delivery, subscriptions):
    """Whether a leased delivery is of one of these (queue, event or None) subscriptions."""
    queue = delivery["queue"]
    return (queue, delivery["event"]) in subscriptions or (queue, None) in subscriptions


class _Publish(NamedTuple):
    ref: object
    queue: str
    outgoing: list
    batch: bool  # a batch frame: answered with every message, in one `published` frame
    receipt: bool = False  # its messages are owed a `receipt` frame each (delivery.receipts)


async def _schema_refusals(queue, run):
    """{id(publish frame): its schema_mismatch FrameError} for the frames of `run` whose payloads
    fail their events' schemas."""
    refused = {}
    for p in run:
        try:
            await publishing.acheck_schemas(queue, p.outgoing)
        except publishing.SchemaMismatch as exc:
            refused[id(p)] = FrameError(exc.code, str(exc), errors=exc.errors)
    return refused


def _runs(publishes):
    """(queue name, [publish]) for each run of consecutive publishes to one queue, each run at
    most MAX_BATCH messages unless a single frame holds more."""
    run, size = [], 0
    for p in publishes:
        if run and (p.queue != run[0].queue or size + len(p.outgoing) > publishing.MAX_BATCH):
            yield run[0].queue, run
            run, size = [], 0
        run.append(p)
        size += len(p.outgoing)
    if run:
        yield run[0].queue, run
