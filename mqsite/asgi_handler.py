"""Django's ASGI handler, with a request's sync work done in one call to its thread."""

from asgiref.sync import sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.urls import set_script_prefix


class SyncChainASGIHandler(ASGIHandler):
    """Every view and middleware of this project is sync (the async work is in the Channels
    consumers). Django's own ASGI handler runs the middleware in async mode where it can, so a
    request crossed between the event loop and a worker thread for each process_request and
    process_response, and WhiteNoise (sync only) split the chain in two: about a dozen
    crossings, a third of a single publish's time in Daphne (py-spy, bench/PROFILE.md). Here the
    chain is built sync, and a request's sync work (the request_started signal, the chain and
    the view, closing the response, which sends request_finished) is one call, in the request's
    own thread (Django's ThreadSensitiveContext gives each request one): Django's handler made
    three, each a hop to that thread and back, plus two tasks to watch for a disconnect that a
    sync view could not act on anyway. Reading the body and sending the response stay on the
    event loop, as before; a streaming response (static files) is closed after it is sent."""

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def handle(self, scope, receive, send):
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:  # the client went away before its body arrived
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

    def _respond(self, scope, body_file):
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self.get_response(request)
        if not response.streaming:
            response.close()  # its content stays; closing sends request_finished, in this thread
        return response
