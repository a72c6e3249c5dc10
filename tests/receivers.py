"""A real HTTP receiver on loopback for webhook tests: it records what it got and answers
from a script of (status, delay) pairs."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, script=None, default=(200, 0)):
        self.script = list(script or [])
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
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

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
