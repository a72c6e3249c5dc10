"""A hot backlog made fast, and plain JSON calls to a real server, for the tests of replays and
unsubscribes over many rows."""

import json
import urllib.error
import urllib.request

from django.utils import timezone

from queues.models import Event, Message, Queue


def call(server, token, method, path, body=None, timeout=120):
    """(status, decoded body or None, headers) of one REST call with the subscriber's token."""
    req = urllib.request.Request(
        f"{server.http}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None, r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), e.headers


def fill(queue, n):
    """n hot messages, inserted in big batches (a publish each would take minutes)."""
    event = Event.objects.create(queue=queue, name="row")
    now = timezone.now()
    for start in range(0, n, 5000):
        Message.objects.bulk_create(
            Message(queue=queue, event=event, seq=seq, payload_json=json.dumps({"n": seq}), created_at=now)
            for seq in range(start + 1, min(start + 5000, n) + 1)
        )
    Queue.objects.filter(pk=queue.pk).update(last_seq=n)
