"""Floods that cost the server without a token, or with one (issue 26, S1 and S7), against real
Daphne: big frames before `auth`, big or over-nested frames after it, sockets left
unauthenticated by the hundred, and HTTP headers dripped a byte at a time. While each goes on,
the server keeps answering everyone else."""

import contextlib
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from django.db import connection
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.support.servers import start_daphne

pytestmark = pytest.mark.django_db(transaction=True)

# 1 MiB (Daphne's largest message) of nested empty arrays: about 350,000 lists once decoded.
MEGABYTE_OF_LISTS = "[" + ",".join(["[]"] * ((1024 * 1024 - 2) // 3)) + "]"


def healthz_times(web, probes=20, pause=0.05):
    """Seconds each of `probes` GET /healthz took, one after another."""
    times = []
    with httpx.Client(timeout=30) as client:
        for _ in range(probes):
            started = time.monotonic()
            assert client.get(f"{web.http}/healthz").status_code == 200
            times.append(time.monotonic() - started)
            time.sleep(pause)
    return times


class Flood:
    """Threads that each keep a socket sending `frame` (opening another when it is closed),
    and note how each socket ended and what it was answered."""

    def __init__(self, url, frame, sockets=3):
        self.url, self.frame, self.stop = url, frame, threading.Event()
        self.codes, self.answers, self.sent = [], [], 0
        self.threads = [threading.Thread(target=self.run) for _ in range(sockets)]

    def ended(self, exc):
        # A socket that the flood itself closes when it stops ends 1000 (or unanswered): only
        # the server's closes while the flood runs say how it treats the frames.
        if not self.stop.is_set():
            self.codes.append(exc.rcvd.code if exc.rcvd else None)

    def run(self):
        while not self.stop.is_set():
            try:
                with connect(self.url, max_size=None, open_timeout=10) as ws:
                    reader = threading.Thread(target=self.read, args=(ws,))
                    reader.start()
                    while not self.stop.is_set():
                        ws.send(self.frame)
                        self.sent += 1
                    reader.join(timeout=5)
            except ConnectionClosed as exc:
                self.ended(exc)
            except OSError:
                time.sleep(0.05)

    def read(self, ws):
        try:
            while True:
                self.answers.append(json.loads(ws.recv(timeout=30)))
        except ConnectionClosed as exc:
            self.ended(exc)
        except TimeoutError:
            pass

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def report(capsys, text):
    with capsys.disabled():
        print(f"\n[{connection.vendor}] {text}")


# --- S1: frames are bounded before they are decoded ----------------------------------------------


def test_it_closes_big_frames_before_auth_unparsed_while_healthz_stays_fast(logger, capsys):
    web = start_daphne()
    try:
        quiet = statistics.median(healthz_times(web))
        with Flood(web.ws, MEGABYTE_OF_LISTS) as flood:
            time.sleep(0.5)
            busy = healthz_times(web)
        report(
            capsys,
            f"/healthz median {quiet * 1000:.0f} ms alone, {statistics.median(busy) * 1000:.0f} ms "
            f"(max {max(busy) * 1000:.0f} ms) beside 3 unauthenticated sockets sending 1 MiB frames "
            f"of nested arrays ({flood.sent} frames sent, {len(flood.codes)} sockets closed)",
        )
        assert statistics.median(busy) < 0.5
        # Each socket was closed for its frame (4413), which was never decoded: no answer to it.
        # A client still sending when the server closes may find the connection reset before it
        # reads the close frame (None); the server closes no other way.
        assert flood.codes and set(flood.codes) <= {4413, None}, flood.codes[:10]
        assert flood.codes.count(4413) > len(flood.codes) / 2, flood.codes
        assert flood.answers == []
        # and a client with a token, by the `auth` frame, is served as before.
        with connect(web.ws) as ws:
            ws.send(json.dumps({"type": "auth", "token": logger.token}))
            assert json.loads(ws.recv(timeout=5))["type"] == "authenticated"
            ws.send(json.dumps({"type": "ping", "ref": 1}))
            assert json.loads(ws.recv(timeout=5)) == {"type": "pong", "ref": 1}
    finally:
        web.stop()


def test_an_authenticated_socket_gets_an_error_for_a_frame_of_too_many_arrays(logger, peer, capsys):
    web = start_daphne()
    try:
        ack_of_lists = '{"type": "ack", "ref": "big", "ids": ' + MEGABYTE_OF_LISTS[: 1024 * 1000] + "]}"
        with connect(f"{web.ws}?token={logger.token}", max_size=None) as ws:
            ws.send(ack_of_lists)
            error = json.loads(ws.recv(timeout=5))
            assert error["type"] == "error" and error["code"] == "too_large"  # undecoded: no ref
            assert "4096 arrays and objects" in error["detail"]
            # nested too deep, under the count: the nesting rule of REST bodies
            ws.send(json.dumps({"type": "ping", "ref": "deep", "x": json.loads("[" * 100 + "]" * 100)}))
            error = json.loads(ws.recv(timeout=5))
            assert error["code"] == "bad_json" and "deeper than 64" in error["detail"]
            # a batch publish of many arrays and objects (as REST takes one) is still published
            batch = [{"event": "e", "payload": {"rows": [{"n": i}] * 8}} for i in range(1000)]
            ws.send(json.dumps({"type": "publish", "queue": "db", "messages": batch, "ref": "p"}))
            published = json.loads(ws.recv(timeout=30))
            assert published["type"] == "published" and len(published["messages"]) == 1000
            # and the socket goes on
            ws.send(json.dumps({"type": "ping", "ref": 2}))
            assert json.loads(ws.recv(timeout=5)) == {"type": "pong", "ref": 2}
        # Several sockets with a token sending such frames on end stall no one else.
        with Flood(f"{web.ws}?token={peer.token}", ack_of_lists) as flood:
            time.sleep(0.5)
            busy = healthz_times(web)
            with connect(f"{web.ws}?token={logger.token}") as calm:
                started = time.monotonic()
                calm.send(json.dumps({"type": "ping", "ref": 3}))
                assert json.loads(calm.recv(timeout=5)) == {"type": "pong", "ref": 3}
                pong = time.monotonic() - started
        report(
            capsys,
            f"/healthz median {statistics.median(busy) * 1000:.0f} ms, another socket's ping "
            f"{pong * 1000:.0f} ms, beside 3 authenticated sockets sending 1 MiB ack frames of "
            f"nested arrays ({flood.sent} sent)",
        )
        assert statistics.median(busy) < 0.5
        assert {a["code"] for a in flood.answers} <= {"too_large", "rate_limited"} and flood.answers
    finally:
        web.stop()


# --- S7: what a client without a token may hold ----------------------------------------------------


def test_unauthenticated_sockets_of_one_address_are_capped_while_a_token_still_connects(logger, peer):
    web = start_daphne({"MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS": "5"})
    stack = contextlib.ExitStack()
    try:
        waiting = [stack.enter_context(connect(web.ws)) for _ in range(5)]
        with connect(web.ws) as sixth:
            error = json.loads(sixth.recv(timeout=5))
            assert error["type"] == "error" and error["code"] == "too_many_unauthenticated"
            assert "MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS" in error["detail"]
            with pytest.raises(ConnectionClosed) as closed:
                sixth.recv(timeout=5)
            assert closed.value.rcvd.code == 4429
        # a token in the URL or a header is never counted
        with connect(f"{web.ws}?token={peer.token}") as with_token:
            with_token.send(json.dumps({"type": "ping"}))
            assert json.loads(with_token.recv(timeout=5))["type"] == "pong"
        with connect(web.ws, additional_headers={"Authorization": f"Bearer {peer.token}"}) as with_header:
            with_header.send(json.dumps({"type": "ping"}))
            assert json.loads(with_header.recv(timeout=5))["type"] == "pong"
        # one that authenticates frees its place, and so does one that closes
        waiting[0].send(json.dumps({"type": "auth", "token": logger.token}))
        assert json.loads(waiting[0].recv(timeout=5))["type"] == "authenticated"
        waiting[1].close()
        time.sleep(0.5)
        for _ in range(2):
            late = stack.enter_context(connect(web.ws))
            late.send(json.dumps({"type": "auth", "token": peer.token}))
            assert json.loads(late.recv(timeout=5))["type"] == "authenticated"
    finally:
        stack.close()
        web.stop()


def read_until_closed(sock, timeout):
    """What the server sends until it closes the connection (or `timeout` passes), and when."""
    sock.settimeout(timeout)
    data, deadline = b"", time.monotonic() + timeout
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return data, time.monotonic()
            data += chunk
    return data, None


def test_an_http_client_dripping_its_headers_is_cut_off_at_the_deadline(logger, capsys):
    web = start_daphne({"MQ_HTTP_HEADER_TIMEOUT_SECS": "2"})
    try:
        with socket.create_connection(("127.0.0.1", web.port)) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            cut = None
            with contextlib.suppress(OSError):  # the server closes: the next byte cannot go
                for _ in range(100):  # a byte every 0.1 s, 10 s in all: each would reset an idle timer
                    sock.sendall(b"x")
                    time.sleep(0.1)
            answer, closed_at = read_until_closed(sock, 5)
            cut = (closed_at or time.monotonic()) - started
        report(capsys, f"a client dripping header bytes every 0.1 s was cut off after {cut:.1f} s")
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert b"MQ_HTTP_HEADER_TIMEOUT_SECS" in answer
        assert closed_at is not None and cut < 5
        # a kept-alive connection serves request after request, each within the deadline, and
        # is closed (with no answer) once idle past it
        with socket.create_connection(("127.0.0.1", web.port)) as sock:
            for _ in range(3):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                sock.settimeout(5)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                time.sleep(1.2)  # 3.6 s on one connection in all
            answer, closed_at = read_until_closed(sock, 5)
            assert answer == b"" and closed_at is not None
        # a websocket, past its handshake, is not held to the deadline
        with connect(f"{web.ws}?token={logger.token}") as ws:
            time.sleep(3)
            ws.send(json.dumps({"type": "ping"}))
            assert json.loads(ws.recv(timeout=5))["type"] == "pong"
    finally:
        web.stop()
