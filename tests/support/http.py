"""Calls to a real server's REST API (a tests.support.servers.Server), with the stdlib's client
so that no client library stands between the test and the server."""

import json
import urllib.request


def request(server, token, method, path, body=None, timeout=30):
    """One call with `token` (and `body` as JSON): (status, the JSON answer)."""
    req = urllib.request.Request(
        f"{server.http}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def post(server, token, path, body, timeout=30):
    """POST `body` as JSON with `token`: (status, the JSON answer)."""
    return request(server, token, "POST", path, body, timeout)


def publish_over_http(server, token, n=1, start=0):
    """Publish n messages to `db` in one batch, message i with the payload {"n": start + i}:
    the messages as the server answered them."""
    messages = [{"event": "create", "payload": {"n": start + i}} for i in range(n)]
    status, body = post(server, token, "/api/queues/db/messages", {"messages": messages})
    assert status == 201
    return body["messages"]
