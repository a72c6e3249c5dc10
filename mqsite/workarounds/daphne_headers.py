"""A deadline on an HTTP request's headers, inside Daphne.

Works around Twisted's HTTPChannel (which Daphne serves HTTP with): its only clock is an idle
timeout of 60 s started again by every byte received, so a client that sends a header byte
every 59 s holds a connection for ever, and a thousand such clients hold a thousand. Here a
request's headers must all arrive within MQ_HTTP_HEADER_TIMEOUT_SECS of the connection opening
(or of the previous answer on a kept-alive connection); past it, a client that had begun its
headers gets 408 and the connection is closed, an idle one is closed. Once the headers are in,
Twisted's own timeouts and Daphne's apply as before.

Its test:
tests/e2e/test_socket_floods.py::test_an_http_client_dripping_its_headers_is_cut_off_at_the_deadline.
It can go when Daphne (or a server in front of it, such as nginx's client_header_timeout) sets
a total deadline on a request's headers.
"""

from django.conf import settings
from twisted.web import http

TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s"
)


class HeaderDeadlineChannel(http.HTTPChannel):
    _header_deadline = None

    def connectionMade(self):
        super().connectionMade()
        self._start_header_clock()

    def allHeadersReceived(self):
        self._stop_header_clock()
        super().allHeadersReceived()

    def requestDone(self, request):
        super().requestDone(request)
        # Not after a websocket's handshake: Daphne took the request's transport for it.
        upgraded = getattr(request, "transport", True) is None
        if self.persistent and self.transport is not None and not self._handlingRequest and not upgraded:
            self._start_header_clock()  # the next request's headers, idle time included

    def connectionLost(self, reason):
        self._stop_header_clock()
        super().connectionLost(reason)

    def _start_header_clock(self):
        self._stop_header_clock()
        self._header_deadline = self.callLater(settings.MQ_HTTP_HEADER_TIMEOUT_SECS, self._headers_too_late)

    def _stop_header_clock(self):
        if self._header_deadline is not None and self._header_deadline.active():
            self._header_deadline.cancel()
        self._header_deadline = None

    def _headers_too_late(self):
        self._header_deadline = None
        if self.transport is None:
            return
        if self._receivedHeaderSize or self.requests:  # a request had begun: say why
            body = (
                b'{"detail": "The request headers did not arrive within %g s (MQ_HTTP_HEADER_TIMEOUT_SECS).",'
                b' "code": "timeout"}' % settings.MQ_HTTP_HEADER_TIMEOUT_SECS
            )
            self.transport.write(TIMED_OUT % (len(body), body))
        # Nothing more is read; closed once the answer is written, forced after abortTimeout.
        self.dataReceived = self.lineReceived = lambda *args: None
        self.timeoutConnection()


def install():
    """Twisted's HTTPFactory makes each connection's channel from the module's HTTPChannel."""
    http.HTTPChannel = HeaderDeadlineChannel
