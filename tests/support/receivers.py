"""A real HTTP receiver on loopback for webhook tests: it records what it got and answers
from a script of (status, delay) pairs."""

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, script=None, default=(200, 0), body=b"ok"):
        self.script = list(script or [])
        self.answer = body  # the body of every answer
        self.default = default
        self.requests = []  # (monotonic time, path, headers dict, body bytes)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                with receiver.lock:
                    receiver.requests.append((time.monotonic(), self.path, dict(self.headers), body))
                    status, delay = receiver.script.pop(0) if receiver.script else receiver.default
                time.sleep(delay)
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", receiver.redirect_to)
                self.send_header("Content-Length", str(len(receiver.answer)))
                self.end_headers()
                self.wfile.write(receiver.answer)

            def log_message(self, *args):
                pass

        self.redirect_to = "http://127.0.0.1:1/"
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Dripper:
    """A real HTTP endpoint on loopback that answers one byte at a time, `interval` seconds
    apart, for `lasting` seconds: the status line and headers (`part="headers"`) or, after
    prompt headers, the body (`part="body"`). No per-read timeout ever trips on it."""

    def __init__(self, part="headers", interval=1.0, lasting=30.0):
        self.part, self.interval, self.lasting = part, interval, lasting
        self.connections = []  # monotonic time each request arrived
        self.open = 0  # requests being dripped to now
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            with self.lock:
                self.connections.append(time.monotonic())
                self.open += 1
            try:
                body = b"x" * 64
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                dripped = head + body if self.part == "headers" else body
                if self.part == "body":
                    conn.sendall(head)
                started = time.monotonic()
                for i in range(len(dripped)):
                    if self.closed.is_set() or time.monotonic() - started > self.lasting:
                        return
                    conn.sendall(dripped[i : i + 1])
                    self.closed.wait(self.interval)
            except OSError:
                return
            finally:
                with self.lock:
                    self.open -= 1

    def close(self):
        self.closed.set()
        self.sock.close()
