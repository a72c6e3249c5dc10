"""The dashboard's websocket at /ws/dashboard/: a snapshot every second, for staff only; its
feed of messages (their payloads and headers) only for those who may view messages
(queues.view_message, as the admin asks), the others get it empty.

The user comes from the admin login's session (channels.auth.AuthMiddlewareStack); the
handshake of anyone else is refused (403). Each tick is the deployment's shared overview
(dashboard.shared: one computation a second for every dashboard and scrape of every process)
and this dashboard's own feed: the messages newer than the last one it was sent.
"""

import asyncio
import json
import logging
import time
from collections import deque
from importlib import import_module
from types import SimpleNamespace

from channels.db import DatabaseSyncToAsync
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.contrib import auth
from rest_framework.utils.encoders import JSONEncoder

from subscribers.auth import operator_may

from . import shared, snapshot

log = logging.getLogger(__name__)

TICK_SECS = 1.0
# A dashboard left open re-checks its session this often: a logout or a lost staff flag
# closes it within this time, a lost permission to view messages empties its feed.
RECHECK_USER_SECS = 30
CLOSE_NOT_STAFF = 4403


def db(fn):
    """Off the event loop, in a pool thread (as delivery.consumers does)."""
    return DatabaseSyncToAsync(fn, thread_sensitive=False)


MAY_SEE_MESSAGES = "queues.view_message"


async def shared_overview(fresh=False):
    """The deployment's overview, without what only /metrics reads."""
    _, data = await db(shared.current)(fresh=fresh)
    return {key: value for key, value in data.items() if key != "metrics"}


class DashboardConsumer(AsyncWebsocketConsumer):
    task = None

    async def connect(self):
        user = self.scope.get("user")
        if not operator_may(user):
            await self.close()  # before accept: the handshake is refused with 403
            return
        self.may_see_messages = await db(operator_may)(user, MAY_SEE_MESSAGES)
        self.last_message_id = None
        self.shown = deque(maxlen=snapshot.FEED_LIMIT)  # the feed's message ids on the page
        self.user_checked = time.monotonic()
        await self.accept()
        self.task = asyncio.ensure_future(self.run())

    async def disconnect(self, code):
        if self.task is not None:
            self.task.cancel()

    async def receive(self, text_data=None, bytes_data=None):
        # The page only listens; a ping is answered so a client can tell the socket is alive.
        try:
            frame = json.loads(text_data or "{}")
        except ValueError:
            return
        if isinstance(frame, dict) and frame.get("type") == "ping":
            await self.send(text_data=json.dumps({"type": "pong"}))

    async def run(self):
        fresh = True  # the first snapshot of a page is never an older page's
        try:
            while True:
                started = time.monotonic()
                if started - self.user_checked >= RECHECK_USER_SECS:
                    self.user_checked = started
                    if not await db(self.still_staff)():
                        await self.close(code=CLOSE_NOT_STAFF)
                        return
                await self.send_snapshot(fresh)
                fresh = False
                await asyncio.sleep(max(TICK_SECS - (time.monotonic() - started), 0.05))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("dashboard snapshot failed; closing the socket")
            await self.close(code=1011)

    def still_staff(self):
        """Whether the page's session still belongs to a staff user: read again from the
        session store (the scope's copy was loaded at connect and would not see a logout), and
        whether it may still see the messages."""
        key = self.scope["session"].session_key
        if not key:
            return False
        request = SimpleNamespace(session=import_module(settings.SESSION_ENGINE).SessionStore(key))
        user = auth.get_user(request)
        self.may_see_messages = operator_may(user, MAY_SEE_MESSAGES)
        return operator_may(user)

    async def send_snapshot(self, fresh=False):
        data = dict(await shared_overview(fresh))
        own = await db(self.own_part)()
        data.update(own)
        await self.send(text_data=json.dumps({"type": "snapshot", **data}, cls=JSONEncoder))

    def own_part(self):
        if not self.may_see_messages:
            return {"feed": [], "feed_status": {}}
        feed = snapshot.newest_messages(self.last_message_id)
        status = snapshot.delivery_status_of([m["id"] for m in feed] + list(self.shown))
        for m in reversed(feed):  # oldest first, so the deque keeps the newest
            self.shown.append(m["id"])
        if feed:
            self.last_message_id = feed[0]["id"]
        return {"feed": feed, "feed_status": {str(k): v for k, v in status.items()}}
