"""Django's ASGI handler, with the middleware chain and the view run as one sync call."""

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler


class SyncChainASGIHandler(ASGIHandler):
    """Every view and middleware of this project is sync (the async work is in the Channels
    consumers). Django's own ASGI handler runs the middleware in async mode where it can, so a
    request crossed between the event loop and a worker thread for each process_request and
    process_response, and WhiteNoise (sync only) split the chain in two: about a dozen
    crossings, a third of a single publish's time in Daphne (py-spy, bench/PROFILE.md). Here the
    chain is built sync and entered once, in the request's own thread (Django's
    ThreadSensitiveContext gives each request one); reading the body and sending the response
    stay on the event loop as before."""

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def get_response_async(self, request):
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)
