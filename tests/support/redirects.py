"""Real servers on loopback for the clients' redirect tests: a Redirector that answers every
request (the websocket handshake included) with a 3xx to another origin, and the Elsewhere it
points at, which records every request and socket frame it gets, so that a test can assert that
a token never reached it.

The two are different origins as a browser counts them: the redirector is `localhost`, the
other is `127.0.0.1` on a port of its own (scheme, host and port: any difference counts)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from websockets.sync.server import serve


class Elsewhere:
    """Another origin: a websocket server at /ws/ that accepts every socket and records the
    handshake headers and each frame, and an HTTP server that records every REST request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.handshakes = []  # (path, headers dict)
        self.frames = []  # text frames, as received
        self.requests = []  # (method, path, headers dict, body bytes)
        elsewhere = self

        def on_handshake(connection, request):
            with elsewhere.lock:
                elsewhere.handshakes.append((request.path, dict(request.headers.raw_items())))

        def on_socket(ws):
            for frame in ws:
                with elsewhere.lock:
                    elsewhere.frames.append(frame)
                if '"auth"' in str(frame):
                    ws.send(json.dumps({"type": "authenticated", "subscriber": "elsewhere"}))

        self.ws_server = serve(on_socket, "127.0.0.1", 0, process_request=on_handshake)
        threading.Thread(target=self.ws_server.serve_forever, daemon=True).start()
        self.ws = f"ws://127.0.0.1:{self.ws_server.socket.getsockname()[1]}"

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def record(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with elsewhere.lock:
                    elsewhere.requests.append((self.command, self.path, dict(self.headers), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_DELETE = record

            def log_message(self, *args):
                pass

        self.http_server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_server.daemon_threads = True
        threading.Thread(target=self.http_server.serve_forever, daemon=True).start()
        self.http = f"http://127.0.0.1:{self.http_server.server_address[1]}"

    def saw(self, token):
        """Whether the token reached this origin anywhere: a header, a frame, a body."""
        with self.lock:
            seen = [json.dumps(h) for _, h in self.handshakes] + [str(f) for f in self.frames]
            seen += [json.dumps(h) + body.decode("utf-8", "replace") for _, _, h, body in self.requests]
        return any(token in text for text in seen)

    def close(self):
        self.ws_server.shutdown()
        self.http_server.shutdown()
        self.http_server.server_close()


class Redirector:
    """A server at http://localhost:PORT that answers every request with `status` and a
    Location on `elsewhere`: /ws/ to its websocket server, the rest to its HTTP server (the
    same path and query). It records what it was asked: (method, path)."""

    def __init__(self, elsewhere, status=302):
        self.status, self.asked = status, []
        redirector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a websocket client reads no other answer

            def redirect(self):
                redirector.asked.append((self.command, self.path))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                base = elsewhere.ws if self.path.startswith("/ws/") else elsewhere.http
                self.send_response(redirector.status)
                self.send_header("Location", base + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_DELETE = redirect

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://localhost:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
