"""Stopping Daphne gracefully (SIGTERM), hooked into its Twisted reactor by mqsite/asgi.py,
which also says what the application stops and hands back (delivery/stopping.py).

Daphne 4.2 does not do it by itself: its cancel of the applications fails on the first
kept-alive HTTP connection (so the websocket consumers never hear of it and keep their
deliveries until the ack deadline), it does not wait for HTTP requests under way, and a
request thread that still needs the event loop once it has stopped waits for it for ever, so
the process never exits. Instead, before the reactor stops:

1. new HTTP requests are answered 503 (try again: another process, or this one restarted) and
   long polls stop waiting;
2. every websocket of the process hands back what it holds;
3. HTTP requests under way get up to SHUTDOWN_SECS to finish and be answered;

and once it has stopped, the process exits at once, whatever thread is still stuck.

Its test: tests/e2e/test_shutdown.py. It can go when Daphne stops gracefully by itself: tells
every application instance (websockets included) it is stopping, waits for the HTTP requests
under way, and exits.
"""

import asyncio
import logging
import os

from mqsite import request_ids, tracing

log = logging.getLogger(__name__)

# Within a process manager's grace: supervisord.conf gives the web server 5 s, so that `make
# run` is gone within 10 s (the workers' 4 s come after it). A request is never that long: a
# long poll stops waiting at once, and a body's read has its own deadline.
SHUTDOWN_SECS = 4
# What a request that arrives while the server stops is answered (503), with the code of the
# database-unavailable answer: nothing was done, try again.
STOPPING = b'{"detail": "The server is stopping; try again.", "code": "unavailable"}'

_requests = 0  # HTTP requests under way in this process (counted on its event loop)
_idle = None  # set when _requests falls to 0
# What the application does as the server stops, given by install(): stop() at once (and from
# then on stopping() is true), drain() before the reactor stops, describe() for the log line.
_stop = _drain_app = _describe = None


class CountHTTPRequests:
    """ASGI middleware around the HTTP application: counts requests under way, and answers
    503 to new ones once the server is stopping."""

    def __init__(self, app, stopping):
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope, receive, send):
        global _requests
        if self.stopping():
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", b"1"),
                        (b"x-request-id", request_ids.of_scope(scope).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": STOPPING})
            return
        _requests += 1
        # Its own task, shielded and counted until it ends: Daphne cancels every application
        # instance as it stops, at the same time as _drain() waits for them, and a request
        # under way must still be answered (a cancel would drop it half way).
        request = asyncio.ensure_future(self.app(scope, receive, send))
        request.add_done_callback(_request_ended)
        await asyncio.shield(request)


def _request_ended(_task):
    global _requests
    _requests -= 1
    if _requests == 0 and _idle is not None:
        _idle.set()


async def _drain():
    global _idle
    await _drain_app()
    _idle = asyncio.Event()
    if _requests:
        await _idle.wait()


def before_shutdown():
    """A Twisted trigger; Daphne waits for the Deferred it returns before it stops."""
    from twisted.internet.defer import Deferred

    _stop()
    log.info("stopping: %d HTTP requests under way, %s", _requests, _describe())
    return Deferred.fromFuture(asyncio.ensure_future(_bounded(_drain())))


async def _bounded(work):
    try:
        await asyncio.wait_for(work, SHUTDOWN_SECS)
    except TimeoutError:
        log.warning("stopping: not drained within %s s; exiting anyway", SHUTDOWN_SECS)


def after_shutdown():
    """A request thread still waiting for the stopped event loop would hold the process for
    ever (the interpreter joins its threads at exit): leave now, all that could finish has."""
    tracing.flush()  # os._exit skips the exit handlers, the SDK's flush among them
    logging.shutdown()
    os._exit(0)


def install(reactor, stop, drain, describe):
    """Hook the stop into the reactor; `stop`, `drain` (a coroutine function) and `describe`
    are the application's (see _stop above)."""
    global _stop, _drain_app, _describe
    _stop, _drain_app, _describe = stop, drain, describe
    reactor.addSystemEventTrigger("before", "shutdown", before_shutdown)
    reactor.addSystemEventTrigger("after", "shutdown", after_shutdown)
