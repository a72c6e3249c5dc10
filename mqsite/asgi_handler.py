"""Django's ASGI handler, with a request's sync work done in one call to its thread."""

import tempfile
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import HttpResponse
from django.urls import set_script_prefix

from . import log_context, request_ids
from .bodies import body_limit, too_large_detail, too_large_json


class BodyTooLarge(Exception):
    pass


def declared_length(scope):
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class RequestThreads:
    """A request's thread, kept for the next request when it is done.

    Django's handler gives each request a ThreadSensitiveContext of its own, and asgiref then
    starts a thread for it and joins that thread when the request ends: the event loop waited
    about 1.7 ms a request for the new thread to start (py-spy: Thread.start, a fifth of
    Daphne's CPU under REST publishes one at a time, and the join in a thread of its own
    besides). Here a request still has a thread to itself for as long as it runs (a long poll
    blocks in it), but the thread is an idle one of an earlier request, kept. What a request
    leaves in its thread is what a WSGI server's reused thread holds: the database connection,
    given back or closed by request_finished as before (a SQLite connection stays open, as
    CONN_MAX_AGE=None asks, where a new thread had to open one each time)."""

    def __init__(self, keep):
        self.keep = keep  # idle threads kept at most; past a burst, the extra ones end
        self.idle = []

    def take(self):
        if self.idle:
            return self.idle.pop()
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="request")

    def give(self, executor):
        if len(self.idle) < self.keep:
            self.idle.append(executor)  # the last used first: its thread is the likeliest warm
        else:
            executor.shutdown(wait=False)


class SyncChainASGIHandler(ASGIHandler):
    """Every view and middleware of this project is sync (the async work is in the Channels
    consumers). Django's own ASGI handler runs the middleware in async mode where it can, so a
    request crossed between the event loop and a worker thread for each process_request and
    process_response, and WhiteNoise (sync only) split the chain in two: about a dozen
    crossings, a third of a single publish's time in Daphne (py-spy, bench/PROFILE.md). Here the
    chain is built sync, and a request's sync work (the request_started signal, the chain and
    the view, closing the response, which sends request_finished) is one call, in the request's
    own thread (RequestThreads): Django's handler made three, each a hop to that thread and
    back, plus two tasks to watch for a disconnect that a sync view could not act on anyway.
    Reading the body and sending the response stay on the event loop, as before; a streaming
    response (static files) is closed after it is sent."""

    threads = RequestThreads(keep=64)

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        executor = self.threads.take()
        try:
            # The request's id, for its answer and its log lines (mqsite.request_ids); the
            # context is this request's task's own, and goes with it to its thread.
            log_context.bind(request_id=request_ids.of_scope(scope))
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        except BaseException:
            # Cancelled, or failed: its thread may still be running the request, and no next
            # request may queue behind that. The thread ends once it is done.
            executor.shutdown(wait=False)
            raise
        self.threads.give(executor)

    async def handle(self, scope, receive, send):
        # The route's body limit, before anything else (no authentication, no database): under
        # Daphne mqsite/workarounds/daphne_bodies.py has refused such a body before it arrived; this is the
        # same rule for any other server.
        limit = body_limit(scope["method"], scope["path"])
        size = declared_length(scope)
        if size is not None and size > limit:
            await self.send_too_large(send, too_large_detail(limit, size))
            return
        try:
            body_file = await self.read_body(receive, limit)
        except RequestAborted:  # the client went away before its body arrived
            return
        except BodyTooLarge:
            await self.send_too_large(send, too_large_detail(limit))
            return
        set_script_prefix(get_script_prefix(scope))
        try:
            response = await sync_to_async(self._respond, thread_sensitive=True)(scope, body_file)
            try:
                await self.send_response(response, send)
            finally:
                if response.streaming:
                    await sync_to_async(response.close, thread_sensitive=True)()
        finally:
            body_file.close()

    async def read_body(self, receive, limit=None):
        """Django's read_body (spooled to disk past FILE_UPLOAD_MAX_MEMORY_SIZE), stopping as
        soon as the body passes `limit`."""
        body_file = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
        seen = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            seen += len(chunk)
            if limit is not None and seen > limit:
                body_file.close()
                raise BodyTooLarge()
            body_file.write(chunk)
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    async def send_too_large(self, send, detail):
        response = HttpResponse(too_large_json(detail), status=413, content_type="application/json")
        response["Connection"] = "close"
        response[request_ids.HEADER] = log_context.current("request_id")
        await self.send_response(response, send)

    def _respond(self, scope, body_file):
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self.get_response(request)
        if not response.streaming:
            response.close()  # its content stays; closing sends request_finished, in this thread
        return response
