"""Body limits inside Daphne, where a body arrives.

Daphne (Twisted) receives a request's whole body, to memory or a temporary file, before it calls
the application, so a check in the ASGI handler comes after the upload: a client could make the
server take in 32 MiB (or, chunked, without end) before hearing no. Here the limit of the route
(mqsite/bodies.py) is applied when the headers end (a Content-Length over it: 413 at once, the
body never read) and as each chunk arrives (past it: 413 at once, the rest dropped).

Its tests: tests/mqsite/test_attacks.py::test_api4_a_declared_body_over_the_limit_is_refused_before_it_is_sent
and ::test_api4_a_chunked_body_is_refused_as_it_passes_the_limit. It can go when Daphne checks a
body's size against a limit as it arrives, before it calls the application.
"""

from io import BytesIO

from daphne import http_protocol
from twisted.internet import reactor

from mqsite import request_ids
from mqsite.bodies import body_limit, raw_target_path, too_large_detail, too_large_json

# After a 413 the connection is half-closed and what the client still sends is dropped for this
# long: closing at once, with its data unread, would make the kernel reset the connection, and
# a reset can destroy the answer before the client reads it.
LINGER_SECS = 2.0


def _drop(*args):
    return None


class BodyLimitedRequest(http_protocol.WebRequest):
    refused = False
    body_seen = 0
    limit = None
    _linger = None

    def gotLength(self, length):
        channel = self.channel
        self.limit = body_limit(channel._command.decode("latin-1"), raw_target_path(channel._path))
        if length is not None and length > self.limit:
            super().gotLength(0)  # a small in-memory buffer, never a temporary file
            self.refuse(too_large_detail(self.limit, length))
            return
        super().gotLength(length)

    def handleContentChunk(self, data):
        if self.refused:
            return
        self.body_seen += len(data)
        if self.limit is not None and self.body_seen > self.limit:
            self.refuse(too_large_detail(self.limit))
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if not self.refused:  # the application never sees a refused request
            super().requestReceived(command, path, version)

    def refuse(self, detail):
        self.refused = True
        self.content.close()
        self.content = BytesIO()
        # Twisted answers "Expect: 100-continue" after gotLength: not after this answer.
        self.requestHeaders.removeHeader(b"Expect")
        channel = self.channel
        transport = channel.transport
        body = too_large_json(detail)
        sent_id = (self.requestHeaders.getRawHeaders(b"x-request-id") or [None])[0]
        transport.write(
            b"HTTP/1.1 413 Request Entity Too Large\r\n"
            b"Content-Type: application/json\r\n"
            b"X-Request-ID: " + request_ids.from_header(sent_id).encode() + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n"
            b"Connection: close\r\n\r\n" + body
        )
        # Whatever else comes on this connection is dropped, unparsed.
        channel.dataReceived = channel.rawDataReceived = channel.lineReceived = _drop
        if hasattr(transport, "loseWriteConnection"):
            transport.loseWriteConnection()
            self._linger = reactor.callLater(LINGER_SECS, self._close, transport)
        else:  # a transport that cannot half-close (TLS): close once the answer is written
            transport.loseConnection()

    @staticmethod
    def _close(transport):
        if not getattr(transport, "disconnected", False):
            transport.abortConnection()

    def connectionLost(self, reason):
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        super().connectionLost(reason)


def install():
    """Daphne's factory builds each request from the module's WebRequest: make it this one."""
    http_protocol.WebRequest = BodyLimitedRequest
