"""The clients of a fault run: publishers over REST (batches and single messages) and over a
websocket, and subscribers of three kinds: websocket, webhook (a receiver on loopback) and
pull (GET /api/deliveries). Each behaves as a careful client does, and misbehaves at random
as real ones do: connections dropped (cleanly or not), deliveries never acked, nacks, webhook
answers of 500 or none at all.

Publishers use an idempotency key per message (its tag) and retry until the server answers:
a publish whose answer was lost is sent again and the server answers with the first message,
so every message tried is confirmed once, and the history holds exactly what was confirmed.
"""

import itertools
import json
import logging
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from standardwebhooks import Webhook
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import connect

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the log

EVENTS = ("create", "delete")
CLIENT_ERRORS = (OSError, ConnectionClosed, InvalidHandshake, InvalidStatus, TimeoutError, httpx.HTTPError)


class Pacer:
    """Hands out messages at `rate` per second over the run, `total` in all, of which exactly
    `ordered` go to the ordered queue, spread over the run like the rest."""

    def __init__(self, total, rate, ordered):
        self.left = {"fifo": ordered, "bulk": total - ordered}
        self.total, self.rate = total, rate
        self.taken = 0
        self.started = time.monotonic()
        self.lock = threading.Lock()

    def take(self, want, rng, halt):
        """Returns (queue, how many), or (None, 0) once all are taken or publishing stops."""
        while not halt.is_set():
            with self.lock:
                if self.taken >= self.total:
                    return None, 0
                allowed = self.rate * (time.monotonic() - self.started) + 50 - self.taken
                if allowed >= 1:
                    share = self.left["fifo"] / (self.total - self.taken)
                    queue = "fifo" if rng.random() < share else "bulk"
                    if not self.left[queue]:
                        queue = "fifo" if queue == "bulk" else "bulk"
                    if queue == "fifo":
                        want = min(want, 5)  # ordered publishers send few at a time
                    n = int(min(want, self.left[queue], allowed))
                    self.left[queue] -= n
                    self.taken += n
                    return queue, n
            halt.wait(0.02)
        return None, 0


class Workload:
    def __init__(self, history, cluster, tokens, secrets, *, messages, rate, ordered_share=0.2, seed=0):
        self.history, self.cluster = history, cluster
        self.tokens, self.secrets = tokens, secrets
        self.pacer = Pacer(messages, rate, round(messages * ordered_share))
        self.seed = seed
        self.halt_publishing = threading.Event()
        self.halt = threading.Event()
        self.drops = 0  # bumped by the nemesis: every socket open now is dropped
        self.threads = []
        self.errors = []  # what a client saw that a correct server never says
        self.counts = {"publish_retries": 0, "ws_drops": 0, "noacks": 0, "nacks": 0, "hook_failures": 0}
        self.count_lock = threading.Lock()
        self.retries = {}  # why publishes were retried: status code or "no answer"
        self.tags = itertools.count()
        self.receiver = None

    # --- running ---

    def start_receiver(self):
        self.receiver = WebhookReceiver(self)
        return self.receiver.url

    def start(self):
        plan = [
            ("ws-sub-sock-0", self.ws_subscriber, ("sock",)),
            ("ws-sub-sock-1", self.ws_subscriber, ("sock",)),
            ("ws-sub-sock2", self.ws_subscriber, ("sock2",)),
            # One poller per queue, as a client with an ordered queue would (each round trip
            # of the ordered one is then small), and one for both, sharing with them.
            ("pull-fifo", self.pull_subscriber, ("pull", "fifo")),
            ("pull-bulk", self.pull_subscriber, ("pull", "bulk")),
            ("pull-any", self.pull_subscriber, ("pull", None)),
            ("rest-pub-0", self.rest_publisher, ()),
            ("rest-pub-1", self.rest_publisher, ()),
            ("rest-pub-2", self.rest_publisher, ()),
            ("ws-pub", self.ws_publisher, ()),
        ]
        for i, (name, target, args) in enumerate(plan):
            rng = random.Random(f"{self.seed}-{i}")
            t = threading.Thread(target=self.guard, args=(name, target, rng, *args), name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def guard(self, name, target, rng, *args):
        try:
            target(name, rng, *args)
        except Exception as exc:  # a harness bug: report it, do not hide it
            log.exception("client %s failed", name)
            self.errors.append(f"{name} crashed: {exc!r}")

    def publishing_done(self):
        return all(not t.is_alive() for t in self.threads if "-pub" in t.name)

    def stop_publishing(self):
        self.halt_publishing.set()

    def stop(self):
        self.halt_publishing.set()
        self.halt.set()
        for t in self.threads:
            t.join(timeout=30)
        if self.receiver is not None:
            self.receiver.close()

    def drop_connections(self):
        """The nemesis: every websocket open now is dropped without a closing handshake, and
        the next webhook posts get no answer."""
        self.drops += 1
        if self.receiver is not None:
            self.receiver.drop_next = 5

    def count(self, what, n=1):
        with self.count_lock:
            self.counts[what] += n

    def retry_reason(self, reason):
        with self.count_lock:
            self.retries[str(reason)] = self.retries.get(str(reason), 0) + 1

    def error(self, text):
        if len(self.errors) < 50:
            self.errors.append(text)
        self.history.note(f"client error: {text}")

    # --- publishers ---

    def next_batch(self, rng):
        want = 1 if rng.random() < 0.3 else rng.randint(2, 50)
        queue, n = self.pacer.take(want, rng, self.halt_publishing)
        if not n:
            return None, []
        batch = []
        for _ in range(n):
            tag = f"m{next(self.tags)}"
            batch.append({"event": rng.choice(EVENTS), "payload": {"tag": tag, "pad": "x" * 64}, "key": tag})
        self.history.attempt(queue, [m["key"] for m in batch])
        return queue, batch

    def rest_publisher(self, name, rng):
        urls = self.cluster.http_urls
        headers = {"Authorization": f"Bearer {self.tokens['pub']}"}
        with httpx.Client(timeout=30, headers=headers) as client:
            while True:
                queue, batch = self.next_batch(rng)
                if not batch:
                    return
                body = {"messages": batch} if len(batch) > 1 or rng.random() < 0.5 else batch[0]
                for attempt in itertools.count():
                    url = f"{urls[(attempt + hash(name)) % len(urls)]}/api/queues/{queue}/messages"
                    try:
                        r = client.post(url, json=body)
                    except httpx.HTTPError as exc:
                        r = None
                        self.retry_reason(type(exc).__name__)
                    if r is not None and r.status_code in (200, 201):
                        answers = r.json()["messages"] if "messages" in body else [r.json()]
                        for m, answer in zip(batch, answers, strict=True):
                            self.history.confirm(m["key"], answer)
                        break
                    if r is not None and r.status_code < 500 and r.status_code != 429:
                        self.error(f"publish answered {r.status_code}: {r.text[:200]}")
                        break
                    if self.halt.is_set():
                        return  # the run is over: these stay tried but unconfirmed
                    self.count("publish_retries")
                    if r is not None:
                        self.retry_reason(r.status_code)
                    time.sleep(min(0.1 * 2**attempt, 2))

    def ws_publisher(self, name, rng):
        """Single messages over the websocket's publish frame; on a drop, the same key again."""
        queue, batch = None, []
        ws_urls = self.cluster.ws_urls
        while True:
            try:
                url = rng.choice(ws_urls)
                with connect(f"{url}?token={self.tokens['pub']}", open_timeout=10, close_timeout=1) as ws:
                    while True:
                        if not batch:
                            queue, batch = self.next_batch(rng)
                            if not batch:
                                return
                        for m in batch:
                            ws.send(json.dumps({"type": "publish", "queue": queue, "ref": m["key"], **m}))
                        waiting = {m["key"]: m for m in batch}
                        while waiting:
                            frame = json.loads(ws.recv(timeout=30))
                            if frame.get("type") == "published" and frame.get("ref") in waiting:
                                m = waiting.pop(frame["ref"])
                                self.history.confirm(m["key"], {**frame, "event": m["event"]})
                            elif frame.get("type") == "error":
                                if frame.get("code") in ("bad_message", "not_found", "forbidden"):
                                    self.error(f"ws publish refused: {frame}")
                                    waiting.clear()
                                else:
                                    raise OSError(f"server error frame: {frame}")  # retry them
                        batch = []
            except CLIENT_ERRORS:
                if self.halt.is_set():
                    return
                self.count("publish_retries")
                time.sleep(rng.uniform(0.1, 0.5))

    # --- subscribers ---

    def ws_subscriber(self, name, rng, subscriber):
        """One websocket connection at a time, each living a few seconds, acking what it gets
        (all that is buffered at once in one ack frame), now and then leaving some unacked or
        nacking one, and ending cleanly or abruptly."""
        ws_urls = self.cluster.ws_urls
        while not self.halt.is_set():
            url = rng.choice(ws_urls)
            drops_seen = self.drops
            try:
                with connect(
                    f"{url}?token={self.tokens[subscriber]}",
                    open_timeout=10,
                    close_timeout=0.5,
                    max_size=None,
                ) as ws:
                    until = time.monotonic() + rng.uniform(5, 30)
                    while time.monotonic() < until and not self.halt.is_set() and self.drops == drops_seen:
                        frames = []
                        try:
                            frames.append(ws.recv(timeout=0.2))
                            while len(frames) < 200:  # what is buffered already: one ack frame
                                frames.append(ws.recv(timeout=0))
                        except TimeoutError:
                            pass
                        self.settle(ws, subscriber, frames, rng)
                    abrupt = self.drops != drops_seen or rng.random() < 0.5
                    if abrupt:
                        self.count("ws_drops")
                        ws.socket.shutdown(socket.SHUT_RDWR)
            except CLIENT_ERRORS:
                time.sleep(rng.uniform(0.05, 0.5))

    def settle(self, ws, subscriber, frames, rng):
        acks = []
        for raw in frames:
            if raw is None:
                continue
            frame = json.loads(raw)
            if frame["type"] == "error":
                self.error(f"{subscriber} got an error frame: {frame}")
                continue
            if frame["type"] != "message":
                continue
            self.history.receive(subscriber, frame, "ws")
            roll = rng.random()
            if roll < 0.001:
                self.count("noacks")  # never acked: it comes back after its ack deadline
            elif roll < 0.002:
                self.count("nacks")
                ws.send(json.dumps({"type": "nack", "ids": [frame["id"]]}))
            else:
                acks.append(frame["id"])
        if acks:
            ws.send(json.dumps({"type": "ack", "ids": acks}))

    def pull_subscriber(self, name, rng, subscriber, queue=None):
        urls = self.cluster.http_urls
        headers = {"Authorization": f"Bearer {self.tokens[subscriber]}"}
        with httpx.Client(timeout=30, headers=headers) as client:
            for turn in itertools.count():
                if self.halt.is_set():
                    return
                base = urls[turn % len(urls)] if rng.random() < 0.1 else urls[hash(name) % len(urls)]
                try:
                    params = {"limit": 100, "wait": 1, **({"queue": queue} if queue else {})}
                    r = client.get(f"{base}/api/deliveries", params=params)
                    if r.status_code != 200:
                        time.sleep(0.2)
                        continue
                    deliveries = r.json()["deliveries"]
                    for d in deliveries:
                        self.history.receive(subscriber, d, "pull")
                    if not deliveries:
                        continue
                    roll = rng.random()
                    if roll < 0.003:
                        self.count("noacks", len(deliveries))
                        continue
                    if roll < 0.006:
                        self.count("nacks")
                        client.post(f"{base}/api/deliveries/{deliveries[0]['id']}/nack", json={})
                        deliveries = deliveries[1:]
                    ack = client.post(
                        f"{base}/api/deliveries/ack", json={"ids": [d["id"] for d in deliveries]}
                    )
                    if ack.status_code == 200 and ack.json()["unknown"]:
                        self.error(f"{subscriber}: acks of unknown ids {ack.json()['unknown'][:5]}")
                except CLIENT_ERRORS:
                    time.sleep(rng.uniform(0.05, 0.3))


class WebhookReceiver:
    """The webhook subscriber's endpoint: checks the signature, records the delivery, and
    answers 200 (mostly), 500, or nothing (the connection closed under the post)."""

    def __init__(self, workload, subscriber="hook"):
        self.workload, self.subscriber = workload, subscriber
        self.drop_next = 0
        self.rng = random.Random(f"{workload.seed}-hook")
        self.lock = threading.Lock()
        self.bad_signatures = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                if len(body) < length:  # the worker died mid-post: nothing to check, no answer
                    receiver.workload.count("torn_posts")
                    return
                receiver.handle(self, body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *_: None  # a worker killed mid-post resets its connection
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True).start()

    def handle(self, request, body):
        secret = self.workload.secrets[self.subscriber]
        try:
            Webhook(secret).verify(body, dict(request.headers))
        except Exception as exc:
            with self.lock:
                self.bad_signatures += 1
            self.workload.error(f"webhook post with a bad signature: {exc!r} ({len(body)} bytes)")
            self.answer(request, 400)
            return
        frame = json.loads(body)
        self.workload.history.receive(self.subscriber, frame, "webhook")
        with self.lock:
            roll = self.rng.random()
            drop = self.drop_next > 0 or roll < 0.002
            if self.drop_next > 0:
                self.drop_next -= 1
        if drop:
            self.workload.count("hook_failures")
            request.close_connection = True
            request.connection.shutdown(socket.SHUT_RDWR)  # no answer: the post fails
            return
        if roll < 0.005:
            self.workload.count("hook_failures")
            self.answer(request, 500)
            return
        self.answer(request, 200)

    @staticmethod
    def answer(request, status):
        request.send_response(status)
        request.send_header("Content-Length", "0")
        request.end_headers()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
