"""End to end, a real Daphne: replays (subscribe with "from", seek) and unsubscribes under way,
and left halfway (issue 26, S2). One replay per subscriber at a time (429 with Retry-After,
nothing made); a subscription is handed nothing until its replay is done; the sweep finishes
a replay or an unsubscribe whose server died, and the subscription then owes every message
exactly once in seq order, or is gone with what it was owed.

A replay "under way" is held as a crash leaves it (begin_replay and a chunk, then nothing), so
that the overlap is certain; the crash tests kill a real Daphne in the middle of one."""

import contextlib
import json
import signal
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from websockets.sync.client import connect

from delivery import ledger, subscribing, tasks
from delivery.models import Delivery, Status
from queues.models import Event, Queue
from subscribers import replay
from subscribers.models import Subscription
from subscribers.provisioning import create_subscriber
from tests.support.backlog import call, fill
from tests.support.servers import eventually, nothing_for, start_daphne, start_worker

pytestmark = pytest.mark.django_db(transaction=True)


def hold_replay(subscriber, queue):
    """A new subscription whose replay from the first seq did begin_replay and one chunk, then
    stopped: as a server that died between two chunks leaves it."""
    subscription, _ = subscribing.subscribe(subscriber, queue)
    ledger.begin_replay(subscription, replay.Point("all"))
    made, done = ledger.replay_chunk(subscription.pk)
    assert made > 0 and not done
    return subscription


def seqs_of(subscription_id):
    return list(
        Delivery.objects.filter(subscription_id=subscription_id).order_by("seq").values_list("seq", flat=True)
    )


def frame_of(ws):
    return json.loads(ws.recv(timeout=10))


def refused(status, body, headers, code):
    """A 429 that names the problem and says when to try again."""
    assert status == 429, (status, body)
    assert headers["Retry-After"] == "2", dict(headers)
    # the body names it in words (and by its code, where REST errors carry one)
    assert body.get("code", code) == code and WORDS[code] in body["detail"], body
    return body["detail"]


WORDS = {"too_many_replays": "MQ_MAX_REPLAYS_PER_SUBSCRIBER", "replay_under_way": "under way"}


# --- one replay at a time -----------------------------------------------------------------------


def test_a_replay_while_another_of_the_subscriber_is_under_way_is_a_429_and_makes_nothing(server, settings):
    settings.MQ_REPLAY_CHUNK = 100
    hist, other = Queue.objects.create(name="hist"), Queue.objects.create(name="other")
    Queue.objects.create(name="third")
    fill(hist, 300)
    fill(other, 50)
    looper, token = create_subscriber("looper", subscribe=["*"])
    _, peer = create_subscriber("peer", subscribe=["*"])
    held = hold_replay(looper, hist)
    before = Delivery.objects.count()

    # REST: a new subscription with a replay, and a seek
    refused(
        *call(server, token, "POST", "/api/subscriptions", {"queue": "other", "from": "all"}),
        "too_many_replays",
    )
    refused(
        *call(server, token, "POST", f"/api/subscriptions/{held.pk}/seek", {"seq": 1}), "too_many_replays"
    )
    # the socket's subscribe frame: an error frame of the code, the socket kept
    with connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "third", "from": "all", "ref": "r1"}))
        frame = frame_of(ws)
        assert (frame["type"], frame["code"], frame["ref"], frame["retry_after"]) == (
            "error",
            "too_many_replays",
            "r1",
            2,
        ), frame
        ws.send(json.dumps({"type": "ping", "ref": "p"}))
        assert frame_of(ws) == {"type": "pong", "ref": "p"}
    # nothing half-written: no subscription, no delivery; the held replay where it was
    assert list(Subscription.objects.filter(subscriber=looper).values_list("pk", flat=True)) == [held.pk]
    assert Delivery.objects.count() == before
    assert Subscription.objects.filter(pk=held.pk, replay_next=101).exists()
    # another subscriber is not held back
    status, body, _ = call(server, peer, "POST", "/api/subscriptions", {"queue": "other", "from": "all"})
    assert status == 201 and body["replay"] == {"from_seq": 1, "deliveries": 50}

    # the first replay done (as the sweep would do it), the same calls succeed
    assert ledger.finish_replay(held.pk) == 200
    assert seqs_of(held.pk) == list(range(1, 301))
    status, body, _ = call(server, token, "POST", "/api/subscriptions", {"queue": "other", "from": "all"})
    assert status == 201 and body["replay"] == {"from_seq": 1, "deliveries": 50}, body
    status, body, _ = call(server, token, "POST", f"/api/subscriptions/{held.pk}/seek", {"seq": 1})
    assert status == 200 and body["replay"]["from_seq"] == 1, body
    with connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "third", "from": "all", "ref": "r2"}))
        frame = frame_of(ws)
        assert (frame["type"], frame["ref"]) == ("subscribed", "r2"), frame


def test_a_refused_replay_to_a_new_event_counts_no_new_event_name(settings):
    settings.MQ_REPLAY_CHUNK = 100
    server = start_daphne({"MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER": "2"})
    try:
        hist, other = Queue.objects.create(name="hist"), Queue.objects.create(name="other")
        fill(hist, 300)
        looper, token = create_subscriber("looper", subscribe=["*"])
        held = hold_replay(looper, hist)
        for name in ("a", "b", "c"):  # more refusals than the hourly cap of new names
            body = {"queue": "other", "event": name, "from": "all"}
            refused(*call(server, token, "POST", "/api/subscriptions", body), "too_many_replays")
        assert not Event.objects.filter(queue=other).exists()
        ledger.finish_replay(held.pk)
        for name in ("a", "b"):  # the cap is whole: the refusals took none of it
            status, body, _ = call(
                server, token, "POST", "/api/subscriptions", {"queue": "other", "event": name}
            )
            assert status == 201, body
    finally:
        server.stop()


def test_a_seek_of_a_subscription_whose_replay_is_under_way_is_a_429_replay_under_way(settings):
    settings.MQ_REPLAY_CHUNK = 100
    server = start_daphne({"MQ_MAX_REPLAYS_PER_SUBSCRIBER": "2"})
    try:
        hist = Queue.objects.create(name="hist")
        Queue.objects.create(name="other")
        fill(hist, 300)
        looper, token = create_subscriber("looper", subscribe=["*"])
        held = hold_replay(looper, hist)
        refused(
            *call(server, token, "POST", f"/api/subscriptions/{held.pk}/seek", {"seq": 1}), "replay_under_way"
        )
        assert Subscription.objects.filter(pk=held.pk, replay_next=101, replay_reopen=False).exists()
        # the cap is 2 here: a replay of another subscription goes ahead
        status, body, _ = call(server, token, "POST", "/api/subscriptions", {"queue": "other", "from": "all"})
        assert status == 201, body
    finally:
        server.stop()


# --- handed nothing until done ------------------------------------------------------------------


def test_a_subscription_whose_replay_is_under_way_is_handed_nothing_then_everything_once_in_order(
    server, settings
):
    settings.MQ_REPLAY_CHUNK = 100
    hist = Queue.objects.create(name="hist")
    fill(hist, 300)
    looper, token = create_subscriber("looper", subscribe=["hist"])
    _, publisher = create_subscriber("publisher", publish=["hist"])
    held = hold_replay(looper, hist)
    with connect(f"{server.ws}?token={token}") as ws:
        ws.send(json.dumps({"type": "subscribe", "queue": "hist"}))  # a reconnect's: the same one
        assert frame_of(ws)["type"] == "subscribed"
        # a publish during the replay is owed, but handed out by nobody yet
        status, body, _ = call(
            server, publisher, "POST", "/api/queues/hist/messages", {"event": "row", "payload": {"n": 301}}
        )
        assert status == 201 and body["seq"] == 301 and body["deliveries"] == 1, body
        status, body, _ = call(server, token, "GET", "/api/deliveries?limit=10")
        assert (status, body) == (200, {"deliveries": []})
        status, body, _ = call(server, token, "GET", "/api/deliveries?limit=10&wait=1")
        assert (status, body) == (200, {"deliveries": []})
        assert nothing_for(ws, 1.5)
        assert Delivery.objects.filter(subscription=held, status=Status.INFLIGHT).count() == 0

        # done in another process (the sweep's): the socket is handed the history, then the live one
        ledger.finish_replay(held.pk)
        got = []
        while len(got) < 301:
            frame = frame_of(ws)
            assert frame["type"] == "message", frame
            got.append(frame)
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
        assert [f["seq"] for f in got] == list(range(1, 302))
        assert nothing_for(ws, 0.5)
    assert seqs_of(held.pk) == list(range(1, 302))


# --- left halfway: the sweep finishes it ---------------------------------------------------------


BACKLOG = 20_000
KILL_CHUNK = "20"  # the killed server's chunks: many, so that it dies in the middle


def kill_midway(server, request, midway):
    """Send `request` (a thread), and SIGKILL the server once `midway()` holds."""

    def send():
        with contextlib.suppress(OSError):  # its answer never comes: the server is killed
            request()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    assert eventually(midway, timeout=60, step=0.02), "the replay never got halfway"
    server.stop(signal.SIGKILL)
    thread.join(timeout=10)


STALL_SECS = 5  # MQ_REPLAY_STALL_SECS of the sweep here (30 by default)


def not_stalled_yet(settings):
    """Just after the kill, the sweep leaves the work alone: it may still be moving."""
    settings.MQ_REPLAY_STALL_SECS = STALL_SECS
    assert tasks.sweep()["stalled_replays"] == 0


def sweep_once_stalled(subscription_id, capsys):
    """Once the last chunk ran MQ_REPLAY_STALL_SECS ago, the sweep finishes the work."""
    busy_since = Subscription.objects.get(pk=subscription_id).busy_since
    assert eventually(lambda: timezone.now() - busy_since > timedelta(seconds=STALL_SECS + 0.2), timeout=30)
    started = time.monotonic()
    assert tasks.sweep()["stalled_replays"] == 1
    with capsys.disabled():
        print(f"\n[{connection.vendor}] the sweep finished it in {time.monotonic() - started:.2f} s")
    assert tasks.sweep()["stalled_replays"] == 0  # done: nothing left to finish


def test_a_replay_whose_server_was_killed_is_finished_by_the_sweeper_each_message_once_in_order(
    settings, capsys, tmp_path
):
    hist = Queue.objects.create(name="hist")
    Queue.objects.create(name="other")
    fill(hist, BACKLOG)
    looper, token = create_subscriber("looper", subscribe=["*"])
    _, publisher = create_subscriber("publisher", publish=["hist"])
    doomed = start_daphne({"MQ_REPLAY_CHUNK": KILL_CHUNK})

    def subscribe():
        call(doomed, token, "POST", "/api/subscriptions", {"queue": "hist", "from": "all"})

    def midway():
        return Subscription.objects.filter(subscriber=looper, replay_next__gt=2000).exists()

    kill_midway(doomed, subscribe, midway)
    not_stalled_yet(settings)
    sub = Subscription.objects.get(subscriber=looper)
    assert sub.busy_since is not None and 2000 < sub.replay_next <= BACKLOG, sub.replay_next
    partial = len(seqs_of(sub.pk))
    assert 2000 <= partial < BACKLOG

    server = start_daphne()
    try:
        # while stalled: a publish is owed, nothing is handed out, another replay waits
        status, body, _ = call(
            server, publisher, "POST", "/api/queues/hist/messages", {"event": "row", "payload": 1}
        )
        assert status == 201 and body["deliveries"] == 1, body
        status, body, _ = call(server, token, "GET", "/api/deliveries?limit=10")
        assert (status, body) == (200, {"deliveries": []})
        refused(
            *call(server, token, "POST", "/api/subscriptions", {"queue": "other", "from": "all"}),
            "too_many_replays",
        )
        refused(
            *call(server, token, "POST", f"/api/subscriptions/{sub.pk}/seek", {"seq": 1}), "too_many_replays"
        )
        # a reconnect's subscribe answers the subscription as it is
        status, body, _ = call(server, token, "POST", "/api/subscriptions", {"queue": "hist", "from": "all"})
        assert (status, body["id"], body["replay"]) == (200, sub.pk, {"from_seq": None, "deliveries": 0}), (
            body
        )

        # the sweeper of `make run` (a worker with beat inside it) finishes it
        started = time.monotonic()
        worker = start_worker({"MQ_REPLAY_STALL_SECS": str(STALL_SECS), "MQ_CELERY_DIR": str(tmp_path)})
        try:
            done = eventually(
                lambda: not Subscription.objects.filter(pk=sub.pk, busy_since__isnull=False).exists(), 60
            )
            assert done, worker.output()[-3000:]
        finally:
            worker.stop()
        with capsys.disabled():
            print(
                f"\n[{connection.vendor}] a worker started, finished it in {time.monotonic() - started:.1f} s"
            )
        assert seqs_of(sub.pk) == list(range(1, BACKLOG + 2))  # each once, the publish too
        sub.refresh_from_db()
        assert (sub.busy_since, sub.replay_next) == (None, None)
        status, body, _ = call(server, token, "GET", "/api/deliveries?limit=100")
        assert [d["seq"] for d in body["deliveries"]] == list(range(1, 101))  # oldest first
        status, body, _ = call(server, token, "POST", "/api/subscriptions", {"queue": "other", "from": "all"})
        assert status == 201, body
    finally:
        server.stop()


def test_an_unsubscribe_whose_server_was_killed_is_finished_by_the_sweep_and_leaves_nothing_owed(
    settings, capsys
):
    settings.MQ_REPLAY_CHUNK = 5000
    hist = Queue.objects.create(name="hist")
    fill(hist, BACKLOG)
    looper, token = create_subscriber("looper", subscribe=["hist"])
    _, publisher = create_subscriber("publisher", publish=["hist"])
    sub, _, _ = subscribing.subscribe_from(looper, hist, None, replay.Point("all"))
    acked = list(Delivery.objects.filter(subscription=sub, seq__lte=1000).values_list("id", flat=True))
    assert ledger.ack_deliveries(looper, acked)[0] == 1000
    doomed = start_daphne({"MQ_REPLAY_CHUNK": KILL_CHUNK})

    def unsubscribe():
        call(doomed, token, "DELETE", f"/api/subscriptions/{sub.pk}")

    def midway():
        return Delivery.objects.filter(subscription=sub).count() < BACKLOG - 2000

    kill_midway(doomed, unsubscribe, midway)
    not_stalled_yet(settings)
    sub.refresh_from_db()
    assert sub.leaving and sub.busy_since is not None
    assert 0 < Delivery.objects.filter(subscription=sub).exclude(status=Status.ACKED).count() < BACKLOG - 2000

    server = start_daphne()
    try:
        # while stalled: a publish is not owed to it, nothing is handed out, it cannot be
        # reused nor replayed (a 200 would name a subscription about to go)
        status, body, _ = call(
            server, publisher, "POST", "/api/queues/hist/messages", {"event": "row", "payload": 1}
        )
        assert status == 201 and body["deliveries"] == 0, body
        status, body, _ = call(server, token, "GET", "/api/deliveries?limit=10")
        assert (status, body) == (200, {"deliveries": []})
        refused(
            *call(server, token, "POST", f"/api/subscriptions/{sub.pk}/seek", {"seq": 1}), "replay_under_way"
        )
        refused(*call(server, token, "POST", "/api/subscriptions", {"queue": "hist"}), "replay_under_way")
        with connect(f"{server.ws}?token={token}") as ws:
            ws.send(json.dumps({"type": "subscribe", "queue": "hist", "ref": "s"}))
            frame = frame_of(ws)
            assert (frame["type"], frame["code"], frame["ref"]) == ("error", "replay_under_way", "s"), frame

        sweep_once_stalled(sub.pk, capsys)
        assert not Subscription.objects.filter(pk=sub.pk).exists()
        assert not Delivery.objects.filter(subscriber=looper).exclude(status=Status.ACKED).exists()
        # its acked history stays, let go of
        assert sorted(Delivery.objects.filter(subscriber=looper).values_list("id", flat=True)) == sorted(
            acked
        )
        assert not Delivery.objects.filter(subscription_id=sub.pk).exists()
        # and it may subscribe again: a new subscription, owed from now on
        status, body, _ = call(server, token, "POST", "/api/subscriptions", {"queue": "hist"})
        assert status == 201 and body["id"] != sub.pk, body
    finally:
        server.stop()
