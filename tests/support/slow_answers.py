"""A TCP proxy on loopback in front of a server that holds back the server's bytes on the
connections whose first request is a POST, `delay` seconds a chunk; every other connection (a
websocket's GET handshake and its frames, a GET) passes at once.

So a test can make a REST call's answer arrive after what the server pushed down a socket
during that call, as a loaded machine or a slow network may order them: a client that acts on
the answer only then is caught acting too late, every time."""

import asyncio
import contextlib
import threading


class SlowAnswers:
    def __init__(self, target, delay=2.0):
        """`target`: the server's http://127.0.0.1:PORT. The proxy's own is `http`."""
        self.target_port = int(target.rsplit(":", 1)[1])
        self.delay = delay
        self.writers = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self._call(asyncio.start_server(self._proxy, "127.0.0.1", 0))
        self.http = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    async def _proxy(self, client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers |= {client_writer, server_writer}
        try:
            first = await client_reader.read(65536)
            server_writer.write(first)
            delay = self.delay if first.startswith(b"POST ") else 0
            await asyncio.gather(
                self._pipe(client_reader, server_writer, 0),
                self._pipe(server_reader, client_writer, delay),
            )
        finally:
            for writer in (client_writer, server_writer):
                self.writers.discard(writer)
                writer.close()

    @staticmethod
    async def _pipe(reader, writer, delay):
        """Copy until either side ends; then close the other, so its reader ends too."""
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        writer.close()

    def close(self):
        async def stop():
            self.server.close()
            for writer in list(self.writers):
                writer.close()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
