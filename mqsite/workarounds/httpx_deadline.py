"""A deadline for a whole HTTP exchange (connect, headers, body) in httpx, for webhook posts.

Works around httpx's (httpcore's) timeouts, which are per read and per write: a peer that drips
a byte every few seconds never trips them, and a post could last for ever. Every socket
operation of a post goes through DeadlineBackend, which waits at most until the deadline set by
deadline() for its thread and fails once it has passed, with no thread of its own. httpx takes
no network backend, so transport() builds its connection pool with this one (a private field).

Its test:
tests/delivery/test_webhook_hardening.py::test_a_peer_dripping_bytes_fails_the_attempt_at_the_deadline.
It can go when httpx bounds a whole request by one timeout, or takes a network backend as an
argument (then transport() needs no private field).
"""

import contextvars
import functools
import time
from contextlib import contextmanager

import httpcore
import httpx

_deadline = contextvars.ContextVar("webhook_deadline", default=None)


@contextmanager
def deadline(at):
    """Every socket operation of the thread's posts, within this block, ends by `at`
    (time.monotonic())."""
    token = _deadline.set(at)
    try:
        yield
    finally:
        _deadline.reset(token)


def time_left(timeout):
    """What an operation may wait: its own timeout, but never past the post's deadline."""
    at = _deadline.get()
    if at is None:
        return timeout
    left = at - time.monotonic()
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream):
        self._stream = stream

    def read(self, max_bytes, timeout=None):
        left = time_left(timeout)
        if left is not None and left <= 0:
            raise httpcore.ReadTimeout("the post's deadline passed")
        return self._stream.read(max_bytes, left)

    def write(self, buffer, timeout=None):
        # One send at a time, each within what is left: the stream's own loop gives every
        # send the whole timeout, so a peer reading slowly could stretch a write without end.
        sock = self._stream.get_extra_info("socket")
        view = memoryview(buffer)
        while view:
            left = time_left(timeout)
            if left is not None and left <= 0:
                raise httpcore.WriteTimeout("the post's deadline passed")
            try:
                sock.settimeout(left)
                view = view[sock.send(view) :]
            except TimeoutError as exc:
                raise httpcore.WriteTimeout(str(exc) or "timed out") from exc
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc

    def close(self):
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        # CPython bounds a whole handshake by the socket's timeout (a deadline, not per step).
        left = time_left(timeout)
        if left is not None and left <= 0:
            raise httpcore.ConnectTimeout("the post's deadline passed")
        return DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info):
        return self._stream.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self):
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        left = time_left(timeout)
        if left is not None and left <= 0:
            raise httpcore.ConnectTimeout("the post's deadline passed")
        return DeadlineStream(self._backend.connect_tcp(host, port, left, local_address, socket_options))

    def sleep(self, seconds):
        self._backend.sleep(seconds)


def transport():
    """An httpx transport whose every socket operation is bounded by the thread's deadline."""
    made = httpx.HTTPTransport(verify=_ssl_context(), trust_env=False)
    made._pool = httpcore.ConnectionPool(ssl_context=_ssl_context(), network_backend=DeadlineBackend())
    return made


@functools.cache
def _ssl_context():
    """One per process, shared by its threads (an SSLContext may be): making one reads the CA
    bundle, 20 ms or more, and a webhook job made two at its start, before its first post."""
    return httpx.create_ssl_context(trust_env=False)
