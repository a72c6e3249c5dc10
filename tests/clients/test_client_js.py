"""The JavaScript client (clients/js/mqclient.js, served at /static/mq/mqclient.js) as its
users run it: in Node, driven by tests/js/node_client.mjs, and in a real Chromium page that
imports it from the server, both against real Daphne processes on the test database. What a
user relies on: every message reaches the handler, is acked when the handler returns and
nacked with its words when it throws, and a server killed and started again mid-stream loses
nothing and calls no handler twice for one delivery id; a slow handler keeps its lease."""

import http.server
import json
import os
import queue as queues
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from types import SimpleNamespace

import pytest
from django.db import connection
from django.utils import timezone

from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber, provision_subscriber
from tests.support.chromium import ARGS, CHROMIUM
from tests.support.outage import database_refusing_connections
from tests.support.personas import subscribed_owner
from tests.support.redirects import Redirector
from tests.support.servers import ROOT, eventually, free_port, start_daphne
from tests.support.slow_answers import SlowAnswers

# A client's behaviour does not depend on the server's database, and these tests are minutes of
# real servers started, killed and started again: one pass of make test runs them, the
# PostgreSQL one (the other pass runs the server's own tests of each frame on its backend).
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="the client, whatever the server's database: the PostgreSQL pass of make test runs it",
    ),
]

MODULE = ROOT / "clients" / "js" / "mqclient.js"
DRIVER = ROOT / "tests" / "js" / "node_client.mjs"
# No skip when it is missing: `make test` installs it (as tests/e2e/test_browser.py says), so a
# missing Chromium is a broken setup, which a skip would hide.


def node_command():
    """node, with the flag that gives Node 20 its global WebSocket (22 has it plainly), or
    None when this machine's node has none (Debian 12's own nodejs is 18)."""
    node = shutil.which("node")
    if node is None:
        return None
    check = "process.exit(typeof WebSocket === 'function' && typeof fetch === 'function' ? 0 : 1)"
    for flags in ([], ["--experimental-websocket"]):
        if subprocess.run([node, *flags, "-e", check], capture_output=True, timeout=30).returncode == 0:
            return [node, *flags]
    return None


NODE = node_command()


@pytest.fixture
def _node():
    # Not a skip: `make test` installs Node, so a missing or too old one is a broken setup,
    # which a skip would hide (as with Chromium above).
    if NODE is None:
        pytest.fail("no node with a global WebSocket here (Node 22, or 20.10+ with a flag)")


needs_node = pytest.mark.usefixtures("_node")


def publish_rest(server, token, n, start=0, event="create"):
    body = json.dumps({"messages": [{"event": event, "payload": {"n": start + i}} for i in range(n)]})
    req = urllib.request.Request(
        f"{server.http}/api/queues/db/messages",
        data=body.encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 201
        return [m["id"] for m in json.loads(r.read())["messages"]]


@pytest.fixture
def owner_and_token():
    """A service that publishes to and subscribes to `db`, holding a subscription to all of it."""
    _, owner, token, _ = subscribed_owner()
    return owner, token


class NodeClient:
    """A Node process running a user's program around the client: commands in, events out."""

    def __init__(self, server, token, **options):
        self.proc = subprocess.Popen(
            [*NODE, str(DRIVER), str(MODULE), server.http, token, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events, self.lock = [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.lock:
                self.events.append(json.loads(line))
                self.lock.notify_all()

    def send(self, **command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def of(self, kind):
        with self.lock:
            return [e for e in self.events if e["kind"] == kind]

    def wait_for(self, check, timeout=15):
        """Wait until check(events) is true; the events then."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not check(self.events):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not check(self.events):
                    stderr = self.proc.stderr.read() if self.proc.poll() is not None else ""
                    raise AssertionError(f"timed out; events: {self.events[-20:]}\n{stderr}")
                self.lock.wait(min(left, 0.2))
            return list(self.events)

    def states(self):
        return [e["state"] for e in self.of("state")]

    def calls(self):
        return self.of("call")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def node_client():
    started = []

    def start(server, token, **options):
        client = NodeClient(server, token, **options)
        started.append(client)
        return client

    yield start
    for client in started:
        client.stop()


def status_counts(message_ids):
    return Counter(Delivery.objects.filter(message_id__in=message_ids).values_list("status", flat=True))


@needs_node
def test_node_subscribes_receives_and_acks_after_the_handler(server, owner_and_token, node_client):
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.send(cmd="subscribe", queue="db", event=None, sync=True)
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))
    assert client.states() == ["connecting", "open"]

    ids = publish_rest(server, token, 20)
    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 20)
    ids += publish_rest(server, token, 10, start=20)  # after the handler went idle

    client.wait_for(lambda events: len({e["message_id"] for e in events if e["kind"] == "call"}) == 30)
    calls = client.calls()
    assert [c["payload"]["n"] for c in calls] == list(range(30))  # in seq order, each once
    assert eventually(lambda: status_counts(ids) == {Status.ACKED: 30}, timeout=10)
    client.send(cmd="close")
    client.wait_for(lambda events: any(e["kind"] == "closed" for e in events))
    client.proc.stdin.close()
    assert client.proc.wait(timeout=10) == 0  # nothing left running: the program ends
    assert client.states()[-1] == "closed"


@needs_node
def test_node_publishes_over_the_socket_and_gets_the_answer(server, owner_and_token, node_client):
    subscriber, token = owner_and_token
    Queue.objects.create(name="secret")
    client = node_client(server, token)
    client.send(cmd="publish", tag="a", queue="db", event="create", payload={"id": 7}, key="user-7")
    client.send(cmd="publish", tag="again", queue="db", event="create", payload={"id": 7}, key="user-7")
    client.send(cmd="publish", tag="null", queue="db", event="delete", payload=None)
    client.send(cmd="publish", tag="refused", queue="secret", event="create", payload=1)
    client.send(cmd="subscribe", queue="secret", event=None)
    client.wait_for(lambda events: len([e for e in events if e["kind"].startswith("publish")]) == 4)
    client.wait_for(lambda events: any(e["kind"] == "subscribe_error" for e in events))
    assert client.of("subscribe_error")[0]["code"] == "forbidden"  # and no subscription made
    assert not subscriber.subscriptions.filter(queue__name="secret").exists()

    answers = {e["tag"]: e for e in client.of("published") + client.of("publish_error")}
    first = answers["a"]["answer"]
    assert set(first) >= {"id", "queue", "event", "seq", "deliveries"}
    assert (first["queue"], first["event"], first["deliveries"]) == ("db", "create", 1)
    assert answers["again"]["answer"]["id"] == first["id"]  # the same key: the first message
    assert answers["null"]["answer"]["seq"] == first["seq"] + 1
    assert (answers["refused"]["kind"], answers["refused"]["code"]) == ("publish_error", "forbidden")
    message = Message.objects.get(pk=first["id"])
    assert (json.loads(message.payload_json), message.key, Message.objects.count()) == (
        {"id": 7},
        "user-7",
        2,
    )
    assert json.loads(Message.objects.get(pk=answers["null"]["answer"]["id"]).payload_json) is None


@needs_node
def test_node_nacks_what_the_handler_throws_with_its_words_and_gets_it_again(
    server, owner_and_token, node_client
):
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.send(cmd="subscribe", queue="db", event=None, fail="first")
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))

    (message_id,) = publish_rest(server, token, 1)

    # The first call throws: nacked with the error's text, then redelivered after its backoff.
    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 1)
    delivery = Delivery.objects.get(message_id=message_id)
    assert eventually(lambda: "no such customer" in Delivery.objects.get(pk=delivery.pk).last_error)
    assert f"cannot file {delivery.pk}: no such customer" in Delivery.objects.get(pk=delivery.pk).last_error
    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 2, timeout=20)
    assert [c["attempt"] for c in client.calls()] == [1, 2]
    assert eventually(lambda: Delivery.objects.get(pk=delivery.pk).status == Status.ACKED)


@needs_node
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_node_survives_a_server_killed_and_started_again_mid_stream(
    server, owner_and_token, node_client, sig
):
    """Nothing lost, no handler call twice for one delivery id: acks the dead server never
    wrote come back as deliveries the client remembers, and are acked without a call."""
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.send(cmd="subscribe", queue="db", event=None, delay_ms=15)
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))
    ids = publish_rest(server, token, 150)
    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) >= 40)

    server.stop(sig)  # mid-stream: a hundred are leased, sent or being handled
    handled_before = len(client.calls())
    client.wait_for(lambda events: client.states().count("connecting") == 2)
    time.sleep(1)  # down for a while: the client retries with its backoff
    again = start_daphne(port=server.port)
    try:
        client.wait_for(lambda events: client.states().count("open") == 2, timeout=20)
        ids += publish_rest(again, token, 50, start=150)
        client.wait_for(lambda events: {e["message_id"] for e in client.calls()} == set(ids), timeout=40)
        assert eventually(lambda: status_counts(ids) == {Status.ACKED: 200}, timeout=20), status_counts(ids)
        time.sleep(1)  # anything redelivered late would show as a second call now
        per_id = Counter(c["id"] for c in client.calls())
        assert max(per_id.values()) == 1, [i for i, n in per_id.items() if n > 1]
        assert len(per_id) == 200
        assert handled_before < 150  # mid-stream indeed: the rest came again after the restart
        # While the server was down: told once, not at every retry.
        assert [e["code"] for e in client.of("error")].count("unreachable") == 1
        assert client.states()[:3] == ["connecting", "open", "connecting"] and client.states()[-1] == "open"
    finally:
        again.stop()


@needs_node
def test_node_sends_a_keyed_publish_again_through_a_database_outage_and_it_is_stored_once(
    server, owner_and_token, node_client
):
    """The database goes away under an open socket (a failover): the server cannot publish, so
    it closes the socket, and refuses the client's reconnects until the database is back. The
    keyed publish under way is sent again and stored once; the unkeyed one is refused to its
    caller rather than sent twice or lost unsaid."""
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.send(cmd="publish", tag="warm", queue="db", event="create", payload={"warm": 1})
    client.wait_for(lambda events: any(e["kind"] == "published" for e in events))
    with database_refusing_connections():
        client.send(
            cmd="publish", tag="keyed", queue="db", event="create", payload={"order": 7}, key="order-7"
        )
        client.send(cmd="publish", tag="unkeyed", queue="db", event="create", payload={"order": 8})
        client.wait_for(lambda events: client.states().count("connecting") >= 2)
        time.sleep(1.5)  # away a while: the reconnects fail
        assert [e["tag"] for e in client.of("published")] == ["warm"]
    client.wait_for(
        lambda events: any(e.get("tag") == "keyed" and e["kind"] == "published" for e in events), timeout=30
    )
    (unkeyed,) = [e for e in client.of("publish_error") if e["tag"] == "unkeyed"]
    assert unkeyed["code"]  # told, with a code, not left waiting
    stored = [(m.key, json.loads(m.payload_json)) for m in Message.objects.order_by("seq")]
    assert stored == [(None, {"warm": 1}), ("order-7", {"order": 7})]
    assert client.states()[-1] == "open"


@needs_node
def test_node_handles_what_waited_even_when_it_names_the_handler_after_the_resume(
    server, owner_and_token, node_client
):
    """The server resumes the durable subscription as soon as the socket is authenticated;
    what it sends before the program calls subscribe() waits for that handler."""
    subscriber, token = owner_and_token
    ids = publish_rest(server, token, 5)
    client = node_client(server, token)
    client.wait_for(lambda events: "open" in client.states())
    assert eventually(lambda: status_counts(ids) == {Status.INFLIGHT: 5})  # sent, held, not handled
    time.sleep(0.3)
    assert client.calls() == []

    client.send(cmd="subscribe", queue="db", event=None, sync=True)

    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 5)
    assert [c["payload"]["n"] for c in client.calls()] == [0, 1, 2, 3, 4]
    assert eventually(lambda: status_counts(ids) == {Status.ACKED: 5})


@needs_node
def test_node_close_lets_the_running_handler_finish_and_acks_it(server, owner_and_token, node_client):
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.send(cmd="subscribe", queue="db", event=None, delay_ms=800)
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))
    (message_id,) = publish_rest(server, token, 1)
    client.wait_for(lambda events: any(e["kind"] == "call" for e in events))

    client.send(cmd="close")

    client.wait_for(lambda events: any(e["kind"] == "closed" for e in events))
    # The server writes the ack as it closes the socket, a moment after the client saw it close.
    delivery = Delivery.objects.filter(message_id=message_id)
    assert eventually(lambda: delivery.get().status == Status.ACKED), delivery.get().status
    assert delivery.get().attempt == 1  # not handed out again
    assert client.states()[-1] == "closed"


@needs_node
def test_node_stops_when_its_token_is_rotated(server, owner_and_token, node_client):
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.wait_for(lambda events: "open" in client.states())

    # createsubscriber again: a new token, and the old one is void
    provision_subscriber("owner", publish=["db"], subscribe=["db"], update=True)

    events = client.wait_for(lambda events: "closed" in client.states(), timeout=10)
    closed = [e for e in events if e["kind"] == "state"][-1]
    assert (closed["code"], closed["error"]) == (4401, "unauthorized")
    client.proc.stdin.close()
    assert client.proc.wait(timeout=10) == 0
    assert client.states() == ["connecting", "open", "closed"]


@needs_node
def test_node_acks_again_without_a_second_call_when_its_ack_was_lost(server, owner_and_token, node_client):
    """The handler returned and the client sent its ack, but the server never read it (frozen,
    then killed): the delivery comes again after the restart, and the client, which remembers
    the id, acks it again without calling the handler."""
    subscriber, token = owner_and_token
    client = node_client(server, token)
    client.send(cmd="subscribe", queue="db", event=None, delay_ms=1000)
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))
    (message_id,) = publish_rest(server, token, 1)
    client.wait_for(lambda events: len(client.calls()) == 1)

    os.kill(server.proc.pid, signal.SIGSTOP)  # the ack the handler's return sends is never read
    time.sleep(1.5)
    server.stop(signal.SIGKILL)
    restarted_at = timezone.now()
    again = start_daphne(port=server.port)
    try:
        delivery = Delivery.objects.filter(message_id=message_id)
        assert eventually(lambda: delivery.get().status == Status.ACKED, timeout=20), delivery.get().status
        assert delivery.get().delivered_at > restarted_at  # it was handed out again...
        assert len(client.calls()) == 1  # ...and the handler was not called again
    finally:
        again.stop()


@needs_node
def test_node_with_a_bad_token_is_closed_and_does_not_retry(server, owner_and_token, node_client):
    client = node_client(server, "mq_not_a_token")
    client.send(cmd="subscribe", queue="db", event=None)
    events = client.wait_for(lambda events: any(e["kind"] == "subscribe_error" for e in events))
    client.proc.stdin.close()
    # One attempt, then closed with the error, and the program ends: nothing keeps retrying.
    assert client.proc.wait(timeout=10) == 0
    states = [e for e in events if e["kind"] == "state"]
    assert [s["state"] for s in states] == ["connecting", "closed"]
    assert (states[-1]["code"], states[-1]["error"]) == (4401, "unauthorized")
    assert client.of("subscribe_error")[0]["code"] == "unauthorized"


@needs_node
def test_node_waits_out_rate_limits_and_sends_the_refused_frames_again(owner_and_token, node_client):
    """Over the socket's frame rate, the server answers `rate_limited` with retry_after and
    does not process the frame; the client waits and sends it again: every publish answered,
    each message once."""
    subscriber, token = owner_and_token
    server = start_daphne({"MQ_WS_FRAME_RATE": "20", "MQ_WS_FRAME_BURST": "5", "MQ_WS_ABUSE_SECS": "3"})
    try:
        client = node_client(server, token)
        client.wait_for(lambda events: "open" in client.states())
        for n in range(40):
            client.send(cmd="publish", tag=n, queue="db", event="create", payload={"n": n}, key=f"k{n}")
        client.wait_for(lambda events: len(client.of("published")) == 40, timeout=30)
        assert not client.of("publish_error")
        assert Message.objects.count() == 40
        assert client.states() == ["connecting", "open"]  # waited, never pushed into a 4429
    finally:
        server.stop()


@needs_node
def test_node_over_the_socket_limit_waits_then_gets_in_when_a_socket_frees(owner_and_token, node_client):
    """Closed with 4429 (after an error frame `too_many_connections`), the client waits at
    least 5 s before it tries again, rather than hammering; once the first client leaves,
    it gets in and receives."""
    subscriber, token = owner_and_token
    server = start_daphne({"MQ_MAX_CONNECTIONS_PER_SUBSCRIBER": "1"})
    try:
        first = node_client(server, token)
        first.wait_for(lambda events: "open" in first.states())
        second = node_client(server, token)
        second.send(cmd="subscribe", queue="db", event=None, sync=True)
        second.wait_for(lambda events: len(second.of("error")) == 2, timeout=20)
        refused = second.of("error")
        assert {e["code"] for e in refused} == {"too_many_connections"}
        assert refused[1]["t"] - refused[0]["t"] >= 4900  # not hammering: 5 s at least
        assert second.states() == ["connecting"]

        first.send(cmd="close")
        first.wait_for(lambda events: any(e["kind"] == "closed" for e in events))
        second.wait_for(lambda events: "open" in second.states(), timeout=20)
        ids = publish_rest(server, token, 3)
        second.wait_for(lambda events: len(second.calls()) == 3)
        assert eventually(lambda: status_counts(ids) == {Status.ACKED: 3})
    finally:
        server.stop()


@needs_node
@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_node_never_sends_its_token_to_another_origin_a_redirect_points_at(
    owner_and_token, elsewhere, node_client, status
):
    """The handshake answered with a redirect to another host: the runtime's WebSocket (as
    the WHATWG spec says, and browsers do) fails it rather than following, so the auth frame,
    sent only on an open socket, never goes there; the client keeps trying the server it was
    given. Checked against a recorder that does catch the token when a client is pointed at it."""
    subscriber, token = owner_and_token
    redirector = Redirector(elsewhere, status)
    try:
        client = node_client(SimpleNamespace(http=redirector.url), token)
        assert eventually(lambda: redirector.asked, timeout=10)
        time.sleep(2)
        assert redirector.asked[0] == ("GET", "/ws/")
        assert elsewhere.handshakes == [] and not elsewhere.saw(token)
        assert "open" not in client.states()

        # the recorder is not blind: a client pointed straight at it gives its token away
        direct = node_client(SimpleNamespace(http=elsewhere.ws.replace("ws:", "http:")), token)
        direct.wait_for(lambda events: "open" in direct.states())
        assert elsewhere.saw(token)
    finally:
        redirector.close()


def node_warnings(node_client, url, token):
    """What the client printed on stderr (console.warn) from connect() to close()."""
    client = node_client(SimpleNamespace(http=url), token)
    client.send(cmd="close")
    client.wait_for(lambda events: any(e["kind"] == "closed" for e in events))
    client.proc.stdin.close()
    assert client.proc.wait(timeout=10) == 0
    return client.proc.stderr.read()


@needs_node
def test_node_warns_once_when_its_token_would_cross_the_network_in_clear(
    server, owner_and_token, node_client
):
    subscriber, token = owner_and_token
    remote = node_warnings(node_client, "http://mq.example.invalid:8000", token)
    assert remote.count("mqclient: http://mq.example.invalid:8000 is not https") == 1, remote
    assert token not in remote
    assert "is not https" not in node_warnings(node_client, server.http, token)  # loopback: quiet
    assert "is not https" not in node_warnings(node_client, "https://mq.example.invalid", token)


# --- in a real browser -------------------------------------------------------------------------


def readme_counter_page(server):
    """The manual's browser counter (docs/clients/index.md), pointed at this server."""
    text = (ROOT / "docs" / "clients" / "index.md").read_text()
    section = text[text.index("## The JavaScript client") :]
    html = re.search(r"```html\n(.*?)```", section, re.S).group(1)
    assert len(html.splitlines()) <= 15  # the limit for a manual's client
    return html.replace("http://127.0.0.1:8000", server.http)


@pytest.fixture
def page_origin(server):
    """A page server of its own (another origin than the queue server's, as a team's app)."""
    page = readme_counter_page(server)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_browser_page_counts_messages_live_across_a_server_restart(
    server, owner_and_token, page_origin, monkeypatch
):
    from playwright.sync_api import sync_playwright

    subscriber, token = owner_and_token
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's loop in this thread
    errors = queues.SimpleQueue()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda error: errors.put(error))
            page.set_default_timeout(20_000)
            sockets = []
            page.on("websocket", lambda ws: sockets.append(ws.url))
            page.once("dialog", lambda dialog: dialog.accept(token))  # the page's prompt
            page.goto(page_origin)
            state = "document.getElementById('state').textContent"
            count = "document.getElementById('count').textContent"
            page.wait_for_function(f"{state} === 'open'")

            ids = publish_rest(server, token, 20)
            page.wait_for_function(f"{count} === '20'")

            server.stop(signal.SIGKILL)
            page.wait_for_function(f"{state} === 'connecting'")
            again = start_daphne(port=server.port)
            try:
                page.wait_for_function(f"{state} === 'open'")
                ids += publish_rest(again, token, 20, start=20)
                page.wait_for_function(f"{count} === '40'")
                assert eventually(lambda: status_counts(ids) == {Status.ACKED: 40}, timeout=15), (
                    status_counts(ids)
                )
                time.sleep(1)
                assert page.inner_text("#count") == "40"  # no handler call twice for one delivery
            finally:
                again.stop()
            assert sockets and all(url == f"{server.ws}" for url in sockets)  # no token in any URL
            assert errors.empty()
        finally:
            browser.close()


@pytest.mark.parametrize("opened_as", ["file", "set_content"])
def test_the_readme_counter_runs_as_a_file_page_whose_origin_is_null(
    server, owner_and_token, tmp_path, monkeypatch, opened_as
):
    """The manual says: save the counter as counter.html and open it. A file:// page (and
    about:blank with set_content) sends `Origin: null`, which /ws/ lets in (it takes tokens,
    never cookies); the page authenticates with the auth frame and counts."""
    from playwright.sync_api import sync_playwright

    subscriber, token = owner_and_token
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's loop in this thread
    html = readme_counter_page(server)
    errors = queues.SimpleQueue()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda error: errors.put(error))
            page.set_default_timeout(20_000)
            page.once("dialog", lambda dialog: dialog.accept(token))
            if opened_as == "file":
                (tmp_path / "counter.html").write_text(html)
                page.goto((tmp_path / "counter.html").as_uri())
            else:
                page.set_content(html)
            assert page.evaluate("self.origin") == "null"
            page.wait_for_function("document.getElementById('state').textContent === 'open'")
            ids = publish_rest(server, token, 5)
            page.wait_for_function("document.getElementById('count').textContent === '5'")
            assert eventually(lambda: status_counts(ids) == {Status.ACKED: 5}, timeout=15), status_counts(ids)
            assert errors.empty()
        finally:
            browser.close()


def test_a_browser_page_never_sends_its_token_to_another_origin_a_redirect_points_at(
    server, owner_and_token, elsewhere, monkeypatch
):
    """Chromium, like Node, fails a handshake answered with a redirect: the page keeps trying
    the server it named and the other origin gets nothing. The same page connecting to an http
    url of a remote host is warned, on its console, that the token would go in clear."""
    from playwright.sync_api import sync_playwright

    subscriber, token = owner_and_token
    redirector = Redirector(elsewhere, 307)
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's loop in this thread
    page_html = f"""<script type="module">
      import {{ connect }} from "{server.http}/static/mq/mqclient.js";
      window.mq = connect({{ url: "{redirector.url}", token: "{token}" }});
      window.mq.on("state", (state) => (document.title = state));
    </script>"""
    warned = []

    def https():
        return [w for w in warned if "is not https" in w]

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_page()
                page.on("console", lambda m: m.type == "warning" and warned.append(m.text))
                page.set_default_timeout(20_000)
                page.set_content(page_html)
                page.wait_for_function("document.title === 'connecting'")
                assert eventually(lambda: redirector.asked, timeout=10)
                time.sleep(2)
                assert elsewhere.handshakes == [] and not elsewhere.saw(token)
                assert page.title() == "connecting"
                # localhost: nothing to say about https (a slow machine may have printed
                # "cannot connect ... still retrying" by now, which is right: it cannot)
                assert https() == []
                page.evaluate("window.mq.close()")
                page.evaluate(
                    """async (src) => { const { connect } = await import(src);
                    await connect({ url: "http://mq.example.invalid:8000", token: "t" }).close(); }""",
                    f"{server.http}/static/mq/mqclient.js",
                )
                assert eventually(https, timeout=5)
                assert len(https()) == 1 and "http://mq.example.invalid:8000" in https()[0]
            finally:
                browser.close()
    finally:
        redirector.close()


# --- The whole protocol: lease extension, warnings, replay, routing fields -------------------


@needs_node
@pytest.mark.parametrize("max_extension", [3600, 0], ids=["extended", "capped"])
def test_node_extends_the_lease_of_a_handler_still_running_up_to_its_cap(
    server, owner_and_token, node_client, max_extension
):
    """A handler slower than the queue's ack timeout keeps its delivery, and so does the one
    waiting behind it: no second attempt. Past the cap (0 here) the client stops extending and
    the server hands them out again."""
    _, token = owner_and_token
    Queue.objects.filter(name="db").update(ack_timeout=2)
    ids = publish_rest(server, token, 2)  # waiting: the client gets both at once
    client = node_client(server, token, leaseSecs=2, maxExtension=max_extension)
    client.send(cmd="subscribe", queue="db", event=None, delay_ms=3000)
    assert eventually(lambda: status_counts(ids) == {Status.ACKED: 2}, timeout=15)
    attempts = sorted(Delivery.objects.filter(message_id__in=ids).values_list("attempt", flat=True))
    if max_extension:
        assert attempts == [1, 1]
    else:
        assert max(attempts) >= 2  # the server took back at least the one that waited longest
    assert len(client.calls()) == 2  # redelivered or not, each handled once
    assert client.calls()[1]["t"] - client.calls()[0]["t"] >= 3000  # the second one waited


@needs_node
def test_node_warns_when_it_cannot_connect_and_when_its_handler_keeps_failing(
    server, owner_and_token, node_client
):
    _, token = owner_and_token
    nowhere = SimpleNamespace(http=f"http://127.0.0.1:{free_port()}")
    lost = node_client(nowhere, token, backoffInitial=20, backoffMax=50)
    lost.wait_for(lambda events: any(e["kind"] == "warn" for e in events))
    (warning,) = lost.of("warn")  # once, not at every attempt
    assert "cannot connect to ws://127.0.0.1:" in warning["text"] and "still retrying" in warning["text"]

    client = node_client(server, token, warnAfterFailures=3)
    client.send(cmd="subscribe", queue="db", event=None, fail="always")
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))
    publish_rest(server, token, 2)
    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 2)
    time.sleep(0.3)
    assert client.of("warn") == []  # two failures: not yet
    publish_rest(server, token, 1, start=2)
    client.wait_for(lambda events: any(e["kind"] == "warn" for e in events))
    assert "3 handler calls in a row failed" in client.of("warn")[0]["text"]
    assert "no such customer" in client.of("warn")[0]["text"]


@needs_node
def test_node_subscribes_from_all_and_seeks_back(server, node_client):
    """The deliveries a seek reopens keep their ids, which the client remembers as acked (to
    ack a lost-ack repeat without a handler call): it must forget them before the seek's
    request goes, since the server pushes them down the socket at its commit, before the HTTP
    answer. Here that answer comes 2 s late (a proxy holds back POST answers), every time."""
    queue = Queue.objects.create(name="db")
    _, token = create_subscriber("replayer", publish=["db"], subscribe=["db"])
    ids = publish_rest(server, token, 3)  # before any subscription: owed to none yet
    seqs = list(Message.objects.filter(pk__in=ids).order_by("seq").values_list("seq", flat=True))

    proxy = SlowAnswers(server.http, delay=2)
    client = node_client(proxy, token)
    client.send(cmd="subscribe", queue="db", event=None, options={"from": "all"})
    client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 3)
    assert [c["payload"]["n"] for c in client.calls()] == [0, 1, 2]
    assert eventually(lambda: status_counts(ids) == {Status.ACKED: 3})
    subscription = client.of("subscribed")[0]["subscription"]
    assert queue.subscriptions.filter(pk=subscription).exists()

    try:
        client.send(cmd="seek", subscription=subscription, point={"seq": seqs[1]})
        client.wait_for(lambda events: any(e["kind"] in ("seeked", "seek_error") for e in events))
        assert client.of("seeked"), client.of("seek_error")
        client.wait_for(lambda events: len([e for e in events if e["kind"] == "call"]) == 5)
        again = client.calls()[3:]
        assert [c["payload"]["n"] for c in again] == [1, 2]
        assert {c["attempt"] for c in again} == {2}  # the same deliveries, handed out again
        # handed to the handler before the answer was back: the race, as the proxy orders it
        assert again[0]["t"] < client.of("seeked")[0]["t"]

        client.send(cmd="seek", subscription=subscription, point={"seq": 0})
        client.wait_for(lambda events: any(e["kind"] == "seek_error" for e in events))
        assert client.of("seek_error")[0]["code"] not in (None, "http_500")
    finally:
        client.stop()
        proxy.close()


@needs_node
def test_node_publishes_headers_and_a_group_and_its_filter_picks_what_it_gets(server, node_client):
    Queue.objects.create(name="db")
    _, token = create_subscriber("router", publish=["db"], subscribe=["db"])
    client = node_client(server, token)
    client.send(cmd="subscribe", queue="db", event="create", options={"filter": {"headers.kind": ["a"]}})
    client.wait_for(lambda events: any(e["kind"] == "subscribed" for e in events))
    for tag, kind in (("a", "a"), ("b", "b")):
        options = {"headers": {"kind": kind}, "group": f"order-{tag}", "ttl_secs": 60, "receipt": True}
        client.send(cmd="publish", tag=tag, queue="db", event="create", payload={"n": tag}, options=options)
    client.wait_for(lambda events: len(client.of("published")) == 2)
    answers = {e["tag"]: e["answer"] for e in client.of("published")}
    assert {tag: answer["deliveries"] for tag, answer in answers.items()} == {"a": 1, "b": 0}
    client.wait_for(lambda events: len(client.calls()) == 1)
    (call,) = client.calls()
    assert (call["payload"], call["headers"], call["group"]) == ({"n": "a"}, {"kind": "a"}, "order-a")
    # its receipt, once its one delivery is acked; and one for the message nobody was owed
    client.wait_for(lambda events: len(client.of("receipt")) == 2)
    receipts = {e["tag"]: e["receipt"] for e in client.of("receipt")}
    assert receipts["a"]["deliveries"] == {"pending": 0, "inflight": 0, "acked": 1, "dead": 0}
    assert receipts["a"]["id"] == answers["a"]["id"]
    assert sum(receipts["b"]["deliveries"].values()) == 0
