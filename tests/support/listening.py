"""A Python client's listen() run as a service runs it, in a thread of its own, so that a test
can publish, seek and look at the database meanwhile: Listening for the blocking Client,
AsyncListening for the AsyncClient (in an event loop of its own in that thread)."""

import asyncio
import threading

from mqclient import AsyncClient

from tests.support.servers import eventually


class Listening:
    """client.listen(...) in a thread of its own, as a service's main loop would run it."""

    def __init__(self, client, handler, subscriptions=(("db", "create"),), **kw):
        self.client, self.error = client, None

        def run():
            try:
                client.listen(handler, list(subscriptions), **kw)
            except BaseException as exc:  # the test asserts on it
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self, timeout=20):
        self.client.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "listen() did not return after stop()"
        if self.error is not None:
            raise self.error


class AsyncListening:
    """AsyncClient.listen(...) in an event loop of its own, in a thread of its own."""

    def __init__(self, url, token, handler, subscriptions=(("db", "create"),)):
        self.client, self.error = None, None

        async def main():
            async with AsyncClient(url, token) as mq:
                self.client = mq
                await mq.listen(handler, list(subscriptions))

        def run():
            try:
                asyncio.run(main())
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert eventually(lambda: self.client is not None)

    stop = Listening.stop
