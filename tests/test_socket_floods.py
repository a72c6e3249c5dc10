"""Floods that cost the server without a token, or with one (issue 26, S1 and S7), against real
Daphne: big frames before `auth`, big or over-nested frames after it, sockets left
unauthenticated by the hundred, and HTTP headers dripped a byte at a time. While each goes on,
the server keeps answering everyone else."""

import json
import statistics
import threading
import time

import httpx
import pytest
from django.db import connection
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.servers import start_daphne

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
                self.codes.append(exc.rcvd.code if exc.rcvd else None)
            except OSError:
                time.sleep(0.05)

    def read(self, ws):
        try:
            while True:
                self.answers.append(json.loads(ws.recv(timeout=30)))
        except ConnectionClosed as exc:
            self.codes.append(exc.rcvd.code if exc.rcvd else None)
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
        # Each socket was closed for its frame (4413), which was never decoded: no answer to it
        assert flood.codes and set(flood.codes) == {4413}, flood.codes[:10]
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
