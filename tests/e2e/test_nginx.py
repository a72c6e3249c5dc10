"""The deployment behind nginx (docs/deploy.md): Debian's nginx runs the repository's site file
(deploy/nginx/mqsite.conf, changed only in its ports, certificate and paths: see
tests/support/nginx.py) in front of Daphne started with make run's options, with the settings
docs/deploy.md gives. Through it, over TLS: the admin's login (CSRF across the proxy), a REST
publish, a websocket through the upgrade, static files from disk, and the failed-token limit
counted per real client address (clients on two of loopback's addresses), a client's own
X-Forwarded-For believed neither through nginx nor straight to the server."""

import json
import os
import random
import re
import shutil
import ssl
import subprocess
import sys

import httpx
import pytest
from django.conf import settings
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from mqsite import run_programs
from tests.e2e.test_client_address import away_from_a_minutes_end
from tests.support.nginx import NGINX, self_signed_certificate, start_nginx
from tests.support.servers import ROOT, eventually, free_port, start_daphne

pytestmark = pytest.mark.django_db(transaction=True)

FAILURES = 5  # MQ_AUTH_FAILURES_PER_MINUTE for this test
# Three clients, each on an address of loopback's own (nginx is 127.0.0.1), new at each run so
# that no failed-token count left in a shared Redis by an earlier run within the minute counts
_NET = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}"
CLIENT_A, CLIENT_B, OUTSIDER = f"{_NET}.2", f"{_NET}.3", f"{_NET}.4"


def make_run_daphne_options():
    """Daphne's options in make run (mqsite/supervisord.conf), less its socket and application."""
    args = run_programs.programs()["web"][1:-1]
    fd = args.index("--fd")
    return args[:fd] + args[fd + 2 :]


@pytest.fixture
def deployment(tmp_path):
    if not shutil.which(NGINX):
        pytest.fail(f"{NGINX} is missing: `make test` installs it (TEST_TOOLS: nginx-light)")
    cert, key = self_signed_certificate(tmp_path)
    static_root = tmp_path / "static"  # the site file serves /static/ from <root>/static
    # The deployment's step: collect the static files where nginx serves them from
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
        cwd=ROOT,
        env={**_environment(), "STATIC_ROOT": str(static_root)},
        check=True,
    )
    nginx = web = None
    try:
        web_port = free_port()
        nginx = start_nginx(tmp_path, web_port, cert, key, tmp_path)
        web = start_daphne(
            {
                "MQ_HTTPS": "true",
                "MQ_TRUSTED_PROXIES": "127.0.0.1",  # nginx's address as the server sees it
                "CSRF_TRUSTED_ORIGINS": nginx.https,  # a public port other than 443
                "MQ_AUTH_FAILURES_PER_MINUTE": str(FAILURES),
                "STATIC_ROOT": str(static_root),
            },
            port=web_port,
            daphne_args=make_run_daphne_options(),
        )
        # A file the server never saw (its static files were listed as it started): only a
        # proxy serving the folder from disk can answer it
        (static_root / "only-on-disk.txt").write_text("served by nginx")
        tls = ssl.create_default_context(cafile=str(cert))
        # The websocket client (websockets' sync one, which reads the TLS socket in a thread of
        # its own while another writes) now and then never got its handshake out over TLS 1.3
        # here, about one connection in 300, stuck until nginx gave up on its header 60 s
        # later; over TLS 1.2 never (900 of 900), nor Python's plain TLS socket over 1.3. The
        # site serves both; the sockets speak 1.2.
        socket_tls = ssl.create_default_context(cafile=str(cert))
        socket_tls.maximum_version = ssl.TLSVersion.TLSv1_2
        yield nginx, web, tls, socket_tls
    finally:
        if web is not None:
            web.stop()
        if nginx is not None:
            nginx.stop()


def _environment():
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _line_with(log, text):
    (line,) = [x for x in log.splitlines() if text in x]
    return line


def client(base_url, tls, source):
    """An HTTP client whose connections leave from `source` (one of loopback's addresses)."""
    transport = httpx.HTTPTransport(local_address=source, verify=tls)
    return httpx.Client(base_url=base_url, transport=transport, timeout=30, trust_env=False)


def socket_close_code(nginx, tls, source, token):
    """Open the delivery socket through nginx with `token`: the close code it ends with."""
    with connect(
        f"{nginx.wss}?token={token}", ssl=tls, proxy=None, source_address=(source, 0), open_timeout=10
    ) as ws:
        try:
            ws.recv(timeout=10)
        except ConnectionClosed as closed:
            return closed.rcvd.code
    return None


def test_behind_nginx_the_admin_rest_websocket_and_failed_token_limit_work(deployment, operator, owner):
    nginx, web, tls, socket_tls = deployment
    a = client(nginx.https, tls, CLIENT_A)
    b = client(nginx.https, tls, CLIENT_B)
    try:
        # Plain http is only a redirect to https
        with httpx.Client(timeout=10, trust_env=False) as plain:
            redirect = plain.get(f"{nginx.http}/admin/")
        assert redirect.status_code == 301
        assert redirect.headers["location"] == "https://127.0.0.1/admin/"

        # The admin's login over https, its CSRF check passing across the proxy (the browser's
        # Origin, a trusted one), the session cookie secure; a foreign origin is refused
        assert a.get("/admin/login/").status_code == 200
        form = {"username": "op", "password": "op-password-1", "csrfmiddlewaretoken": a.cookies["csrftoken"]}
        forged = a.post("/admin/login/", data=form, headers={"Origin": "https://evil.example"})
        assert forged.status_code == 403
        login = a.post("/admin/login/", data={**form, "next": "/admin/"}, headers={"Origin": nginx.https})
        assert login.status_code == 302 and login.headers["location"] == "/admin/", login.text[:500]
        assert "secure" in login.headers["set-cookie"].lower()
        assert "Log out" in a.get("/admin/").text
        # and the operators' dashboard socket, the browser's way: its session and Origin
        with connect(
            f"{nginx.wss}dashboard/",
            ssl=socket_tls,
            proxy=None,
            source_address=(CLIENT_A, 0),
            origin=nginx.https,
            additional_headers={"Cookie": f"sessionid={a.cookies['sessionid']}"},
        ) as dashboard:
            assert json.loads(dashboard.recv(timeout=10))["type"] == "snapshot"

        # Static files from disk (collectstatic's folder), not from the server
        assert a.get("/static/only-on-disk.txt").text == "served by nginx"
        assert a.get("/static/admin/css/base.css").status_code == 200

        # A REST publish, then the delivery over a websocket through the upgrade
        bearer = {"Authorization": f"Bearer {owner.token}"}
        message = {"event": "create", "payload": {"n": 1}}
        published = a.post("/api/queues/db/messages", json=message, headers=bearer)
        assert published.status_code == 201, published.text
        # its request id, made by nginx, is the server's and in nginx's log line of it
        request_id = published.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
        # (nginx writes a request's line once the answer is sent: the client may read it first)
        assert eventually(lambda: request_id in nginx.access_log())
        assert 'POST /api/queues/db/messages HTTP/1.1" 201 ' in _line_with(nginx.access_log(), request_id)
        # A body over the limit is refused by nginx, in the server's own form
        too_large = a.post(
            "/api/queues/db/messages",
            content=b"[" + b" " * settings.MQ_MAX_BODY_BYTES + b"]",
            headers={**bearer, "Content-Type": "application/json"},
        )
        assert too_large.status_code == 413
        assert too_large.json()["code"] == "payload_too_large" and too_large.headers["x-request-id"]
        with connect(
            f"{nginx.wss}?token={owner.token}", ssl=socket_tls, proxy=None, source_address=(CLIENT_A, 0)
        ) as ws:
            frame = json.loads(ws.recv(timeout=10))
            assert frame["type"] == "message" and frame["payload"] == {"n": 1}, frame
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))

        # The failed-token limit counts the real client: A, naming a new address each time in
        # its own X-Forwarded-For (nginx replaces it), is refused past the limit...
        away_from_a_minutes_end()
        wrong = {"Authorization": "Bearer mq_wrong"}
        statuses = [
            a.get("/api/deliveries", headers={**wrong, "X-Forwarded-For": f"10.9.0.{i}"}).status_code
            for i in range(FAILURES + 1)
        ]
        assert statuses == [401] * FAILURES + [429]
        assert socket_close_code(nginx, socket_tls, CLIENT_A, "mq_wrong") == 4429
        # ...while B, behind the same proxy, is not
        assert b.get("/api/deliveries", headers=wrong).status_code == 401
        assert socket_close_code(nginx, socket_tls, CLIENT_B, "mq_wrong") == 4401
        # and a client that reaches the server itself, not through the proxy, cannot borrow an
        # address by naming it: its X-Forwarded-For is not believed (believed, it would be A's,
        # refused with 4429)
        with connect(
            f"{web.ws}?token=mq_wrong",
            proxy=None,
            source_address=(OUTSIDER, 0),
            additional_headers={"X-Forwarded-For": CLIENT_A},
        ) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
        assert closed.value.rcvd.code == 4401
        # With no server process to answer, nginx says so as the server would: 503, unavailable
        web.stop()
        gone = b.get("/api/deliveries", headers=bearer)
        assert gone.status_code == 503 and gone.headers["retry-after"] == "1"
        assert gone.json()["code"] == "unavailable" and gone.headers["x-request-id"]

        # nginx reached the server every time it ran. Three lines are expected: the body it
        # refused, the server gone, and a socket the server closed (once the client has answered
        # the close, autobahn, Daphne's websocket library, ends the connection with a reset,
        # which nginx logs as an error; the close handshake is over by then).
        expected = (
            "client intended to send too large body",
            "reset by peer) while proxying upgraded connection",
            "connect() failed (111: Connection refused) while connecting to upstream",
        )
        unexpected = [
            line
            for line in nginx.errors().splitlines()
            if ("[error]" in line and not any(e in line for e in expected))
            or "[crit]" in line
            or "[emerg]" in line
        ]
        assert unexpected == []
    finally:
        a.close()
        b.close()
