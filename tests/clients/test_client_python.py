"""The Python client (clients/python, package mqclient) against real Daphne processes on the test
database: every REST call of the contract with both clients, the server's refusals as the
exception classes, and listen(): ack after the handler, nack with its words, a server killed
and started again mid-stream (nothing lost, no handler call twice for one id), 429s, SIGTERM."""

import asyncio
import collections
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from datetime import UTC, datetime, timedelta

import mqclient
import pytest
from django.db import connection
from mqclient import (
    AsyncClient,
    Client,
    MQAuthError,
    MQBadRequest,
    MQConnectionError,
    MQError,
    MQForbidden,
    MQNotFound,
    MQRedirectError,
    MQSchemaMismatch,
    MQThrottled,
)
from websockets.sync.client import connect

from delivery import publishing
from delivery.models import Delivery, Status
from queues import schemas
from queues.models import Queue
from subscribers.models import Subscription
from tests.support.listening import AsyncListening, Listening
from tests.support.redirects import Redirector
from tests.support.servers import ROOT, eventually, start_daphne

# A client's behaviour does not depend on the server's database, and these tests are minutes of
# real servers started, killed and started again: one pass of make test runs them, the
# SQLite one (the other pass runs the server's own tests of each frame on its backend).
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="the client, whatever the server's database: the SQLite pass of make test runs it",
    ),
]


@pytest.fixture
def logger_beside_secret(logger, make_queue):
    """The logger may publish to and subscribe to db; `secret` is a queue it may not use."""
    make_queue("secret")
    return logger


def statuses(**filters):
    return dict(Delivery.objects.filter(**filters).values_list("id", "status"))


# --- REST round trips ------------------------------------------------------------------------------


def test_it_publishes_subscribes_pulls_acks_and_nacks_with_the_blocking_client(server, logger_beside_secret):
    with Client(server.http, logger_beside_secret.token) as mq:
        # given a subscription (asking again reuses it)
        sub = mq.subscribe("db", "create")
        assert sub["queue"] == "db" and sub["event"] == "create"
        assert mq.subscribe("db", "create")["id"] == sub["id"]
        # when messages are published, singly (with a key, twice) and in a batch
        first = mq.publish("db", "create", {"id": 7}, key="k-7")
        assert first["seq"] == 1 and first["deliveries"] == 1
        assert mq.publish("db", "create", {"id": 7}, key="k-7")["id"] == first["id"]
        batch = mq.publish_many("db", [("create", {"id": 8}), ("create", None)])
        assert [m["seq"] for m in batch] == [2, 3]
        # then a pull leases them as Delivery objects, oldest seq first
        pulled = mq.pull(limit=10)
        assert [d.seq for d in pulled] == [1, 2, 3]
        d1, d2, d3 = pulled
        assert isinstance(d1, mqclient.Delivery)
        assert (d1.queue, d1.event, d1.payload, d1.attempt, d1.message_id) == (
            "db",
            "create",
            {"id": 7},
            1,
            first["id"],
        )
        assert isinstance(d1.published_at, datetime) and d1.published_at.tzinfo is not None
        assert d1.headers == {} and d3.payload is None
        assert statuses() == {d.id: Status.INFLIGHT for d in pulled}
        # ack by id, by the delivery itself, and a nack with the client's words
        assert mq.ack([d1.id]) == {"acked": 1, "unknown": []}
        assert d2.ack() == {"acked": 1, "unknown": []}
        assert d3.nack(retry_in=60, error="no such customer")["status"] == Status.PENDING
        assert mq.ack([d1.id, 2**40]) == {"acked": 0, "unknown": [2**40]}
        assert statuses() == {d1.id: Status.ACKED, d2.id: Status.ACKED, d3.id: Status.PENDING}
        assert Delivery.objects.get(id=d3.id).last_error == "nacked by the client: no such customer"
        # pause and resume answer the subscription (what they do: tests/subscribers/test_pause.py)
        assert mq.pause(sub) == {**sub, "paused": True} == mq.pause(sub["id"])
        assert mq.resume(sub) == {**sub, "paused": False}
        # and unsubscribing deletes the subscription, and what it was still owed
        mq.unsubscribe(sub["id"])
    assert not Subscription.objects.filter(subscriber=logger_beside_secret).exists()
    assert statuses() == {d1.id: Status.ACKED, d2.id: Status.ACKED}


def test_it_does_the_same_with_the_asyncio_client(server, logger_beside_secret):
    async def scenario():
        async with AsyncClient(server.http, logger_beside_secret.token) as mq:
            sub = await mq.subscribe("db")
            assert sub["event"] is None
            await mq.publish("db", "create", {"id": 1})
            await mq.publish_many("db", [("delete", {"id": 1}), ("create", {"id": 2}, "key-2")])
            assert await mq.pull(wait=0.1, limit=1) != []
            rest = await mq.pull(limit=10)
            assert [(d.event, d.seq) for d in rest] == [("delete", 2), ("create", 3)]
            assert await rest[0].ack() == {"acked": 1, "unknown": []}
            assert (await rest[1].nack(error="later"))["status"] == Status.PENDING
            assert await mq.ack([]) == {"acked": 0, "unknown": []}
            assert await asyncio.to_thread(lambda: Delivery.objects.get(id=rest[0].id).status) == Status.ACKED
            nacked = await asyncio.to_thread(lambda: Delivery.objects.get(id=rest[1].id).last_error)
            assert nacked == "nacked by the client: later"
            assert (await mq.pause(sub))["paused"] is True
            assert (await mq.resume(sub))["paused"] is False
            await mq.unsubscribe(sub)

    asyncio.run(scenario())
    assert not Subscription.objects.exists()


def test_it_sets_a_filter_and_asks_who_would_receive(server, logger_beside_secret):
    """subscribe(filter=...), set_filter() and route(): what they do is tests/subscribers/test_filters.py
    and tests/delivery/test_route.py; here, that the client says it to the server and reads the answers."""
    with Client(server.http, logger_beside_secret.token) as mq:
        sub = mq.subscribe("db", filter={"payload.kind": ["red"]})
        assert sub["filter"] == {"payload.kind": ["red"]}
        assert mq.subscribe("db")["filter"] == {"payload.kind": ["red"]}  # no filter named: kept
        assert mq.publish("db", "paint", {"kind": "blue"})["deliveries"] == 0
        assert mq.route("db", "paint", {"kind": "blue"}) == [
            {
                "id": sub["id"],
                "subscriber": "logger",
                "event": None,
                "matches": False,
                "reason": 'filter key payload.kind has "blue"',
            }
        ]
        assert mq.route("db", "paint", {"kind": "red"}, headers={"tenant": "acme"})[0]["matches"] is True
        assert mq.set_filter(sub, None)["filter"] is None
        with pytest.raises(MQBadRequest) as refused:
            mq.set_filter(sub["id"], {"payload.a.b.c.d.e": [1]})
        assert refused.value.code == "bad_filter" and "payload.a.b.c.d.e" in refused.value.detail

    async def scenario():
        async with AsyncClient(server.http, logger_beside_secret.token) as mq:
            sub = await mq.subscribe("db", filter={"headers.tenant": ["acme"]})
            assert (await mq.route("db", "x", 1))[0]["reason"] == "filter key headers.tenant is absent"
            assert (await mq.set_filter(sub, None))["filter"] is None

    asyncio.run(scenario())


def test_a_long_poll_waits_for_a_publish(server, logger_beside_secret):
    with (
        Client(server.http, logger_beside_secret.token, timeout=5) as mq,
        Client(server.http, logger_beside_secret.token) as publisher,
    ):
        mq.subscribe("db")
        timer = threading.Timer(0.5, publisher.publish, ("db", "create", "late"))
        timer.start()
        started = time.monotonic()
        (delivery,) = mq.pull(wait=10)
        assert delivery.payload == "late" and 0.4 < time.monotonic() - started < 5
        timer.join()


def test_the_client_publishes_a_delay_and_an_expiry_and_reads_them_back(server, logger_beside_secret):
    soon = datetime.now(UTC) + timedelta(hours=2)
    with Client(server.http, logger_beside_secret.token) as mq:
        mq.subscribe("db")
        delayed = mq.publish("db", "create", 1, delay_secs=3600)
        mq.publish("db", "create", 2, ttl_secs=600)
        mq.publish("db", "create", 3, deliver_at=datetime.now(UTC) - timedelta(minutes=1), expires_at=soon)
        two, three = mq.pull(limit=10)  # the delayed one waits
        assert (two.payload, two.deliver_at) == (2, None) and isinstance(two.expires_at, datetime)
        assert three.deliver_at is None and three.expires_at == soon
        with pytest.raises(MQBadRequest) as refused:
            mq.publish("db", "create", 4, delay_secs=1, deliver_at=soon)
        assert refused.value.code == "bad_delay"
    assert Delivery.objects.get(message_id=delayed["id"]).status == Status.PENDING


# --- errors -----------------------------------------------------------------------------------------


def test_the_servers_refusals_are_the_exception_classes_with_status_code_and_words(
    server, logger_beside_secret
):
    with Client(server.http, "not-a-token") as stranger:
        with pytest.raises(MQAuthError) as exc:
            stranger.publish("db", "create", {})
        assert exc.value.status == 401 and exc.value.detail
    with Client(server.http, logger_beside_secret.token) as mq:
        with pytest.raises(MQForbidden) as exc:
            mq.publish("secret", "create", {})
        assert exc.value.status == 403 and exc.value.code == "forbidden" and "secret" in exc.value.detail
        with pytest.raises(MQNotFound) as exc:
            mq.publish("nowhere", "create", {})
        assert exc.value.status == 404 and "nowhere" in exc.value.detail
        with pytest.raises(MQNotFound):
            mq.nack(2**40)
        with pytest.raises(MQBadRequest) as exc:
            mq.publish("db", "Not A Name!", {})
        assert exc.value.status == 400 and exc.value.detail.startswith("event:")
        with pytest.raises(MQBadRequest) as exc:
            mq.publish("db", "create", "x" * 300_000)  # over MQ_MAX_PAYLOAD_BYTES
        assert exc.value.status == 413
        with pytest.raises(MQForbidden):
            mq.subscribe("secret")
        schemas.set_event_schema(Queue.objects.get(name="db"), "typed", {"required": ["id"]})
        with pytest.raises(MQSchemaMismatch) as exc:
            mq.publish_many("db", [("typed", {"id": 1}), ("typed", {})])
        assert exc.value.status == 400 and exc.value.code == "schema_mismatch"
        assert exc.value.errors == [{"index": 1, "path": "", "message": "must have required property 'id'"}]
        assert all(isinstance(e, MQError) for e in (MQAuthError(401, "x", "y"), MQThrottled(429, "x", "y")))
    with Client(
        f"http://127.0.0.1:{server.port + 1 if server.port < 65535 else 1}", logger_beside_secret.token
    ) as nobody:
        with pytest.raises(MQConnectionError):
            nobody.pull()
    assert not Queue.objects.filter(name="nowhere").exists()


def test_the_asyncio_clients_refusals_are_the_same_classes(server, logger_beside_secret):
    async def scenario():
        async with AsyncClient(server.http, "bad") as stranger:
            with pytest.raises(MQAuthError):
                await stranger.pull()
        async with AsyncClient(server.http, logger_beside_secret.token) as mq:
            with pytest.raises(MQForbidden):
                await mq.publish("secret", "create", {})
            with pytest.raises(MQNotFound):
                await mq.unsubscribe(2**40)
            with pytest.raises(MQBadRequest):
                await mq.pull(limit=5000)

    asyncio.run(scenario())


def test_a_throttled_call_is_mq_throttled_with_retry_after(logger_beside_secret):
    web = start_daphne({"MQ_THROTTLE_RATE": "3/min"})
    try:
        with Client(web.http, logger_beside_secret.token) as mq:
            for _ in range(3):
                mq.pull()
            with pytest.raises(MQThrottled) as exc:
                mq.pull()
            assert exc.value.status == 429 and 0 < exc.value.retry_after <= 60

        async def again():
            async with AsyncClient(web.http, logger_beside_secret.token) as mq:
                with pytest.raises(MQThrottled) as exc:
                    await mq.publish("db", "create", {})
                return exc.value.retry_after

        assert 0 < asyncio.run(again()) <= 60
    finally:
        web.stop()


# --- listen ---------------------------------------------------------------------------------------


def test_listen_acks_each_delivery_only_after_its_handler_returned(server, logger_beside_secret):
    release = threading.Event()
    handled = []

    def handler(delivery):
        if not handled:
            release.wait(10)  # the first one is slow
        handled.append((delivery.id, delivery.payload))

    with Client(server.http, logger_beside_secret.token) as mq:
        listening = Listening(mq, handler)
        assert eventually(lambda: Subscription.objects.filter(subscriber=logger_beside_secret).exists())
        mq.publish_many("db", [("create", {"n": i}) for i in range(5)])
        # given the handler is still working on the first delivery
        assert eventually(lambda: Delivery.objects.filter(status=Status.INFLIGHT).count() == 5)
        first = Delivery.objects.order_by("id").first()
        time.sleep(0.5)
        assert Delivery.objects.get(id=first.id).status == Status.INFLIGHT  # not acked yet
        # when it returns, then it and the rest are acked, each handled once, in order
        release.set()
        assert eventually(lambda: set(statuses().values()) == {Status.ACKED})
        listening.stop()
    assert [p["n"] for _, p in handled] == [0, 1, 2, 3, 4]
    assert len({i for i, _ in handled}) == 5


def test_listen_with_prefetch_1_holds_one_delivery_in_flight_at_a_time(server, logger_beside_secret):
    """prefetch rides on the auth frame: the server hands the socket one delivery until it is
    acked, the resume's first lease included (the others stay pending for other workers)."""
    with Client(server.http, logger_beside_secret.token) as mq:
        mq.subscribe("db", "create")
        mq.publish_many("db", [("create", {"n": i}) for i in range(4)])  # waiting before it connects
        most = []

        def handler(delivery):
            most.append(Delivery.objects.filter(status=Status.INFLIGHT).count())
            time.sleep(0.1)

        listening = Listening(mq, handler, prefetch=1)
        assert eventually(lambda: set(statuses().values()) == {Status.ACKED})
        listening.stop()
    assert most == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="prefetch"):
        Client(server.http, logger_beside_secret.token).listen(lambda d: None, [("db", None)], prefetch=0)


def test_listen_authenticates_with_the_auth_frame_so_no_token_is_in_the_handshake(
    server, logger_beside_secret
):
    """A proxy's or the server's access log never sees the token: it goes in the first frame."""
    assert mqclient._listener.AUTH_BY_FRAME
    headers, first = mqclient._listener.socket_auth(logger_beside_secret.token, 3)
    assert headers == {} and first == [{"type": "auth", "token": logger_beside_secret.token, "prefetch": 3}]


def test_a_handler_that_raises_is_nacked_with_its_words_and_handled_again(server, logger_beside_secret):
    calls = collections.defaultdict(list)
    errors_seen = []

    def handler(delivery):
        calls[delivery.id].append(delivery.attempt)
        if delivery.payload == "poison" and delivery.attempt == 1:
            raise ValueError("no such customer 7")
        if delivery.payload == "poison":
            errors_seen.append(Delivery.objects.get(id=delivery.id).last_error)

    with Client(server.http, logger_beside_secret.token) as mq:
        listening = Listening(mq, handler)
        assert eventually(lambda: Subscription.objects.filter(subscriber=logger_beside_secret).exists())
        mq.publish("db", "create", "fine")
        poison = mq.publish("db", "create", "poison")
        # redelivered after the server's backoff (1 s), then acked
        assert eventually(lambda: set(statuses().values()) == {Status.ACKED}, timeout=15)
        listening.stop()
    delivery = Delivery.objects.get(message_id=poison["id"])
    assert calls[delivery.id] == [1, 2]
    assert errors_seen == ["nacked by the client: no such customer 7"]
    assert sorted(len(c) for c in calls.values()) == [1, 2]


def test_a_delivery_handed_out_again_after_its_handler_returned_is_acked_not_handled_again(
    server, logger_beside_secret
):
    """The ack of a handled delivery can be lost with its connection; the server then hands it
    out again (same id). Here the redelivery is made by hand: the row is put back to pending."""
    handled = []
    with Client(server.http, logger_beside_secret.token) as mq:
        listening = Listening(mq, lambda d: handled.append(d.id))
        assert eventually(lambda: Subscription.objects.filter(subscriber=logger_beside_secret).exists())
        mq.publish("db", "create", 1)
        assert eventually(lambda: set(statuses().values()) == {Status.ACKED})
        (delivery_id,) = handled
        # as if the ack never arrived: pending again, and handed out at the socket's next look
        Delivery.objects.filter(id=delivery_id).update(status=Status.PENDING, acked_at=None)
        mq.publish("db", "create", 2)  # wakes the socket
        assert eventually(
            lambda: len(handled) == 2 and set(statuses().values()) == {Status.ACKED}, timeout=10
        )
        listening.stop()
    assert handled[0] == delivery_id and handled.count(delivery_id) == 1
    assert Delivery.objects.get(id=delivery_id).attempt == 2  # it was really handed out again


@pytest.mark.parametrize(
    "kind, stop_signal",
    [("blocking", signal.SIGKILL), ("asyncio", signal.SIGKILL), ("blocking", signal.SIGTERM)],
    ids=["blocking-killed", "asyncio-killed", "blocking-stopped"],
)
def test_a_server_killed_and_started_again_mid_stream_loses_nothing_and_handles_each_id_once(
    logger_beside_secret, kind, stop_signal
):
    """Killed (SIGKILL: what it held comes back once the new process sees it dead), or
    stopped as a restart stops it (SIGTERM: it hands back what its sockets held)."""
    web = start_daphne()
    port = web.port
    handled = collections.Counter()
    lock = threading.Lock()

    def handler(delivery):
        time.sleep(0.005)  # some work: the kill finds deliveries handled, held and in the pipe
        with lock:
            handled[delivery.id] += 1

    total = 600
    publisher = Client(web.http, logger_beside_secret.token)

    def publish_batch(start, n):
        deadline = time.monotonic() + 60
        while True:  # the server may be away: publish again (the keys make it once)
            try:
                return publisher.publish_many(
                    "db", [("create", {"n": i}, f"n-{i}") for i in range(start, start + n)]
                )
            except (MQConnectionError, MQError) as exc:
                if isinstance(exc, MQError) and exc.status not in (None, 503):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    try:
        if kind == "blocking":
            listening = Listening(Client(web.http, logger_beside_secret.token), handler)
        else:
            listening = AsyncListening(web.http, logger_beside_secret.token, handler)
        assert eventually(lambda: Subscription.objects.filter(subscriber=logger_beside_secret).exists())
        for start in range(0, total // 2, 50):
            publish_batch(start, 50)
        assert eventually(lambda: sum(handled.values()) > 50, timeout=20)
        # mid-stream: the listener holds deliveries it has not handled or acked yet
        held = Delivery.objects.filter(status=Status.INFLIGHT).exists()
        web.stop(stop_signal)
        assert held and sum(handled.values()) < total // 2
        time.sleep(0.5)
        web = start_daphne(port=port)
        for start in range(total // 2, total, 50):
            publish_batch(start, 50)
        all_ids = set(Delivery.objects.values_list("id", flat=True))
        assert len(all_ids) == total
        assert eventually(lambda: set(handled) == all_ids, timeout=60), f"{len(handled)} of {total}"
        assert eventually(lambda: set(statuses().values()) == {Status.ACKED}, timeout=20)
        listening.stop()
    finally:
        publisher.close()
        web.stop()
    twice = {i: n for i, n in handled.items() if n > 1}
    assert not twice, f"handled more than once: {twice}"


def test_listen_backs_off_on_4429_and_recovers_when_a_socket_is_free(logger_beside_secret, caplog):
    web = start_daphne({"MQ_MAX_CONNECTIONS_PER_SUBSCRIBER": "1"})
    handled = []
    caplog.set_level(logging.INFO, logger="mqclient")
    try:
        with Client(web.http, logger_beside_secret.token) as mq:
            mq.subscribe("db", "create")
            # given another socket of the subscriber holds its only place
            with connect(f"{web.ws}?token={logger_beside_secret.token}") as other:
                time.sleep(0.3)
                listening = Listening(mq, lambda d: handled.append(d.payload))
                time.sleep(3)
                refused = [r for r in caplog.records if "throttled" in r.getMessage()]
                # told which limit (too_many_connections), then 4429: it waits 5 s, not a storm
                assert len(refused) == 1, len(refused)
                mq.publish("db", "create", "after")
                other.close()
            # when the place is free, it connects within its capped backoff and gets what waited
            assert eventually(lambda: handled == ["after"], timeout=15)
            assert eventually(lambda: set(statuses().values()) == {Status.ACKED})
            listening.stop()
    finally:
        web.stop()


def test_listen_with_a_bad_token_raises_mq_auth_error(server, logger_beside_secret):
    with Client(server.http, "bad-token") as mq:
        with pytest.raises(MQAuthError):
            mq.listen(lambda d: None, [("db", "create")])


def test_listen_on_a_queue_it_may_not_use_raises_mq_forbidden(server, logger_beside_secret):
    with Client(server.http, logger_beside_secret.token) as mq:
        with pytest.raises(MQForbidden):
            mq.listen(lambda d: None, [("db", "create"), ("secret", None)])


def test_the_asyncio_listen_handles_acks_nacks_and_stops_acking_what_finished(server, logger_beside_secret):
    handled = collections.Counter()

    async def scenario():
        async with AsyncClient(server.http, logger_beside_secret.token) as mq:

            async def handler(delivery):
                handled[delivery.id] += 1
                await asyncio.sleep(0.001)
                if delivery.payload == "poison" and delivery.attempt == 1:
                    raise RuntimeError("cannot yet")
                if sum(handled.values()) == 22:  # 21 messages, the poison twice
                    mq.stop()

            listening = asyncio.ensure_future(mq.listen(handler, [("db", None)]))
            await asyncio.sleep(0.5)
            await mq.publish_many("db", [("create", i) for i in range(20)] + [("delete", "poison")])
            await asyncio.wait_for(listening, 20)

    asyncio.run(scenario())
    assert len(handled) == 21 and sorted(handled.values()) == [1] * 20 + [2]
    # the last one finished just before the stop: acked too (its ack went out before the
    # close; the server writes it as it closes)
    assert eventually(lambda: set(statuses().values()) == {Status.ACKED})


LISTENER = textwrap.dedent(
    """
    import sys, time
    from mqclient import Client

    def handler(delivery):
        time.sleep(0.05)
        print(delivery.id, flush=True)

    with Client(sys.argv[1], sys.argv[2]) as mq:
        mq.listen(handler, [("db", "create")])
    print("stopped", flush=True)
    """
)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_stops_listen_cleanly_acking_what_was_handled(server, logger_beside_secret, stop_signal):
    with Client(server.http, logger_beside_secret.token) as mq:
        mq.subscribe("db", "create")
        mq.publish_many("db", [("create", i) for i in range(200)])
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        proc = subprocess.Popen(
            [sys.executable, "-c", LISTENER, server.http, logger_beside_secret.token],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            # As a terminal's Ctrl-C finds it (a child started in the background ignores SIGINT).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        lines = []
        while len(lines) < 10:
            lines.append(proc.stdout.readline().strip())
        proc.send_signal(stop_signal)
        out, _ = proc.communicate(timeout=20)
    lines += out.split()
    assert proc.returncode == 0 and lines[-1] == "stopped"
    done = {int(i) for i in lines[:-1] if i}
    assert 10 <= len(done) < 200
    # every delivery it handled is acked; what it had not started goes back (not acked)
    assert eventually(
        lambda: set(Delivery.objects.filter(status=Status.ACKED).values_list("id", flat=True)) == done
    )


def test_a_handler_may_settle_its_delivery_itself(server, logger_beside_secret):
    def handler(delivery):
        if delivery.payload == "later":
            delivery.nack(retry_in=600, error="not now")
        else:
            delivery.ack()

    with Client(server.http, logger_beside_secret.token) as mq:
        listening = Listening(mq, handler)
        assert eventually(lambda: Subscription.objects.filter(subscriber=logger_beside_secret).exists())
        done = mq.publish("db", "create", "now")
        later = mq.publish("db", "create", "later")
        nacked = Delivery.objects.filter(message_id=later["id"], last_error="nacked by the client: not now")
        assert eventually(lambda: nacked.filter(status=Status.PENDING).exists())
        acked = Delivery.objects.filter(message_id=done["id"], status=Status.ACKED)
        assert eventually(acked.exists)
        time.sleep(0.3)
        listening.stop()
    # the listener left each as its handler settled it: no ack after the nack
    assert nacked.get().status == Status.PENDING and nacked.get().attempt == 1


def test_listen_sends_again_the_acks_the_socket_refused_over_its_frame_rate(logger_beside_secret, caplog):
    web = start_daphne({"MQ_WS_FRAME_RATE": "5", "MQ_WS_FRAME_BURST": "5", "MQ_WS_ABUSE_SECS": "30"})
    caplog.set_level(logging.DEBUG, logger="mqclient")
    handled = collections.Counter()

    def handler(delivery):
        time.sleep(0.02)  # acks go out as they finish: more frames than 5 a second
        handled[delivery.id] += 1

    try:
        with Client(web.http, logger_beside_secret.token) as mq:
            mq.subscribe("db", "create")
            listening = Listening(mq, handler)
            mq.publish_many("db", [("create", i) for i in range(150)])
            assert eventually(lambda: len(handled) == 150, timeout=30)
            assert eventually(lambda: set(statuses().values()) == {Status.ACKED}, timeout=30)
            listening.stop()
    finally:
        web.stop()
    assert set(handled.values()) == {1}
    assert any("ack frame refused (rate_limited)" in r.getMessage() for r in caplog.records)


def test_a_4429_with_no_word_before_it_waits_a_minute(logger_beside_secret, caplog):
    """The throttle of failed tokens from one address closes with 4429 and says nothing more;
    its window is a minute, so the listener does not knock again before then."""
    web = start_daphne({"MQ_AUTH_FAILURES_PER_MINUTE": "1"})
    caplog.set_level(logging.INFO, logger="mqclient")
    try:
        with Client(web.http, "bad-token") as bad:
            with pytest.raises(MQAuthError):
                bad.listen(lambda d: None)  # the one failure the address may have: 4401
            listening = Listening(bad, lambda d: None)  # the next one: 4429
            assert eventually(lambda: any("throttled" in r.getMessage() for r in caplog.records), timeout=10)
            time.sleep(1)
            listening.stop()
    finally:
        web.stop()
    (refused,) = [r.getMessage() for r in caplog.records if "throttled" in r.getMessage()]
    assert float(refused.rsplit("waiting ", 1)[1].split()[0]) >= 60


def test_urls_and_error_bodies_are_read_as_the_contract_gives_them():
    from mqclient import _protocol, errors

    assert _protocol.base_urls("https://mq.example:8443/") == (
        "https://mq.example:8443/api/",
        "wss://mq.example:8443/ws/",
    )
    assert _protocol.base_urls("http://h:8000/mq") == ("http://h:8000/mq/api/", "ws://h:8000/mq/ws/")
    with pytest.raises(ValueError):
        _protocol.base_urls("ws://h:8000")
    field_errors = errors.error_for_answer(400, {"event": ["Bad name."], "payload": ["Required."]})
    assert (
        isinstance(field_errors, MQBadRequest)
        and field_errors.detail == "event: Bad name.; payload: Required."
    )
    throttled = errors.error_for_answer(429, {"detail": "Slow down."}, "Wed, 21 Oct 2099 07:28:00 GMT")
    assert isinstance(throttled, MQThrottled) and throttled.retry_after > 3600
    assert type(errors.error_for_answer(503, {"detail": "Try again."})) is MQError
    frame = errors.error_for_frame(
        {"type": "error", "code": "rate_limited", "detail": "x", "retry_after": 0.5}
    )
    assert isinstance(frame, MQThrottled) and frame.retry_after == 0.5
    failure = {"index": 0, "path": "/id", "message": "must be of type integer"}
    mismatch = errors.error_for_frame(
        {"type": "error", "code": "schema_mismatch", "detail": "x", "errors": [failure]}
    )
    assert isinstance(mismatch, MQSchemaMismatch) and mismatch.status == 400 and mismatch.errors == [failure]
    assert _protocol.clean_error("a\x00b" + "c" * 2000) == "ab" + "c" * 998
    # A socket's redirect is followed on its own origin only (scheme, host and port).
    here = "ws://mq.example:8000/ws/"
    assert _protocol.redirect_error(here, 302, "/v2/ws/", same_origin_ok=True) is None
    assert _protocol.redirect_error(here, 302, "http://mq.example:8000/x", same_origin_ok=True) is None
    for there in ("ws://mq.example:8001/ws/", "wss://mq.example:8000/ws/", "ws://other.example:8000/ws/"):
        assert _protocol.redirect_error(here, 302, there, same_origin_ok=True).code == "cross_origin_redirect"


# --- redirects, clean closes, clear text -----------------------------------------------------------


def refused_listen(listening, elsewhere, token):
    """The error listen() ended with, once it ended; fails at once if the token got out."""
    assert eventually(lambda: not listening.thread.is_alive() or elsewhere.saw(token), timeout=10)
    assert not elsewhere.saw(token), f"the other origin got the token: {elsewhere.frames[:2]}"
    assert eventually(lambda: not listening.thread.is_alive(), timeout=5), "listen() goes on"
    time.sleep(0.3)  # anything late would show now
    assert elsewhere.handshakes == [] and not elsewhere.saw(token)
    return listening.error


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_listen_refuses_a_socket_redirect_to_another_origin_and_never_sends_it_the_token(
    logger_beside_secret, elsewhere, status
):
    """A server (or whoever holds its name) answering the handshake with a redirect to another
    host does not get the token: websockets follows it and the client would send its auth frame
    there. listen() ends with MQRedirectError instead, which says where it pointed."""
    redirector = Redirector(elsewhere, status)
    mq = Client(redirector.url, logger_beside_secret.token, timeout=5)
    try:
        refused = refused_listen(Listening(mq, lambda d: None), elsewhere, logger_beside_secret.token)
        assert isinstance(refused, MQRedirectError), repr(refused)
        assert (refused.status, refused.code) == (status, "cross_origin_redirect")
        assert elsewhere.ws in refused.detail and "not followed" in refused.detail
        assert redirector.asked == [("GET", "/ws/")]  # asked once: waiting will not mend it
    finally:
        mq.close()
        redirector.close()


def test_the_asyncio_listen_refuses_it_too(logger_beside_secret, elsewhere):
    redirector = Redirector(elsewhere, 302)
    try:
        listening = AsyncListening(redirector.url, logger_beside_secret.token, lambda d: None)
        try:
            refused = refused_listen(listening, elsewhere, logger_beside_secret.token)
        finally:
            listening.client.stop()
        assert isinstance(refused, MQRedirectError) and refused.code == "cross_origin_redirect"
    finally:
        redirector.close()


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_rest_calls_follow_no_redirect_and_say_so(logger_beside_secret, elsewhere, status):
    """httpx would follow a 307 with the body (it drops only the Authorization header on another
    origin): the client follows none, and tells why rather than a bare `HTTP 307`."""
    redirector = Redirector(elsewhere, status)
    try:
        with Client(redirector.url, logger_beside_secret.token, timeout=5) as mq:
            for call in (
                lambda: mq.publish("db", "create", {"secret": 1}),
                lambda: mq.pull(),
                lambda: mq.ack([1]),
            ):
                with pytest.raises(MQRedirectError) as refused:
                    call()
                assert (refused.value.status, refused.value.code) == (status, "cross_origin_redirect")
                assert elsewhere.http in refused.value.detail

        async def scenario():
            async with AsyncClient(redirector.url, logger_beside_secret.token, timeout=5) as mq:
                await mq.publish("db", "create", {"secret": 1})

        with pytest.raises(MQRedirectError, match="cross_origin_redirect"):
            asyncio.run(scenario())
        assert [method for method, _ in redirector.asked] == ["POST", "GET", "POST", "POST"]
        assert elsewhere.requests == [] and not elsewhere.saw(logger_beside_secret.token)
    finally:
        redirector.close()


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_listen_connects_again_when_the_server_closes_the_socket_cleanly(logger_beside_secret, caplog, kind):
    """Daphne closes every socket in good order (1000) once it is --websocket_timeout old (a day
    by default), as a proxy's idle timeout or a server going away does: listen() opens another
    and goes on handling, rather than dying with an AttributeError."""
    caplog.set_level(logging.INFO, logger="mqclient")
    web = start_daphne(daphne_args=["--websocket_timeout", "2"])
    handled = []
    try:
        if kind == "blocking":
            listening = Listening(
                Client(web.http, logger_beside_secret.token), lambda d: handled.append(d.payload)
            )
        else:
            listening = AsyncListening(
                web.http, logger_beside_secret.token, lambda d: handled.append(d.payload)
            )
        with Client(web.http, logger_beside_secret.token) as publisher:
            assert eventually(lambda: Subscription.objects.filter(subscriber=logger_beside_secret).exists())
            publisher.publish("db", "create", "before")
            assert eventually(lambda: handled == ["before"])

            def closed_cleanly():
                return [r for r in caplog.records if "the server closed the socket" in r.getMessage()]

            # two sockets closed in good order, and listen() still there
            assert eventually(
                lambda: len(closed_cleanly()) >= 2 or not listening.thread.is_alive(), timeout=20
            )
            assert listening.thread.is_alive(), f"listen() ended: {listening.error!r}"
            publisher.publish("db", "create", "after")
            assert eventually(lambda: handled == ["before", "after"], timeout=15)
            assert eventually(lambda: set(statuses().values()) == {Status.ACKED})
        listening.stop()  # raises what listen() raised, if anything
    finally:
        web.stop()


def test_listen_replays_from_a_point_once_and_filters_through_reconnects(logger_beside_secret, caplog):
    """A subscription given as a dict carries `from` and `filter`: the history from that point
    that matches is handed once, and the sockets Daphne closes every 2 s (each followed by a
    reconnect and the subscribe frames again) neither replay it again nor lose the filter."""
    caplog.set_level(logging.INFO, logger="mqclient")
    web = start_daphne(daphne_args=["--websocket_timeout", "2"])
    handled = []
    try:
        with Client(web.http, logger_beside_secret.token) as mq:
            mq.publish("db", "create", {"n": 0, "tier": "gold"})  # before the point
            time.sleep(0.05)
            point = datetime.now(UTC).isoformat()
            mq.publish_many(
                "db", [("create", {"n": n, "tier": tier}) for n, tier in [(1, "gold"), (2, "tin")]]
            )
            subscription = {
                "queue": "db",
                "event": "create",
                "from": point,
                "filter": {"payload.tier": ["gold"]},
            }
            listening = Listening(mq, lambda d: handled.append(d.payload["n"]), [subscription])

            def reconnects():
                return [r for r in caplog.records if "the server closed the socket" in r.getMessage()]

            assert eventually(lambda: handled == [1]), (handled, listening.error)
            assert eventually(lambda: len(reconnects()) >= 2 or not listening.thread.is_alive(), timeout=20)
            mq.publish_many("db", [("create", {"n": 3, "tier": "tin"}), ("create", {"n": 4, "tier": "gold"})])
            assert eventually(lambda: handled == [1, 4], timeout=15)
            time.sleep(0.5)
            listening.stop()
        assert handled == [1, 4]
        with pytest.raises(ValueError, match="a subscription is"):
            Client(web.http, logger_beside_secret.token).listen(
                lambda d: None, [{"queue": "db", "evnt": "x"}]
            )
    finally:
        web.stop()


def test_an_http_url_of_a_remote_host_warns_once_per_client_that_the_token_goes_in_clear():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for url in (
            "http://127.0.0.1:8000",
            "http://localhost:8000",
            "http://[::1]:8000",
            "https://mq.example",
        ):
            Client(url, "mq_t").close()
        assert caught == []  # loopback, or TLS: nothing to say
        for cls in (Client, AsyncClient):
            mq = cls("http://mq.example:8000", "mq_t")
            assert mq._http is not None
        assert len(caught) == 2
    assert all(issubclass(w.category, mqclient.InsecureURLWarning) for w in caught)
    assert "http://mq.example:8000 is not https" in str(caught[0].message)
    assert caught[0].filename == __file__  # pointed at the line that made the client


def readme_clients():
    """The Python programs of the manual's "Three clients in fifteen lines" (docs/clients/index.md),
    for this server."""
    import re

    text = (ROOT / "docs" / "clients" / "index.md").read_text()
    section = text[text.index("## Three clients in fifteen lines") : text.index("## From a Django project")]
    programs = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(programs) == 2 and all(len(p.splitlines()) <= 15 for p in programs)  # the limit
    return programs


def run_readme_program(program, url, token, tmp_path, name):
    """As pasted: the server's URL comes from MQ_URL, the one place a program reads it."""
    path = tmp_path / f"{name}.py"
    path.write_text(program)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "ALERT_URL")}
    return subprocess.Popen(
        [sys.executable, str(path)],
        env={**env, "MQ_URL": url, "MQ_TOKEN": token},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_the_readme_logger_and_monitor_run_as_pasted(server, make_queue, make_subscriber, tmp_path):
    """As a newcomer pastes them, with MQ_TOKEN exported: the logger prints and acks what is
    published to db and filesystem; the monitor cannot reach its alerting endpoint, so each
    network/error is nacked with the reason until it is dead. Ctrl-C stops both cleanly."""
    for name in ("db", "filesystem"):
        make_queue(name)
    make_queue("network", max_attempts=2)
    logger = make_subscriber("mylogger", publish=("db", "filesystem"), subscribe=("db", "filesystem"))
    monitor = make_subscriber("mymonitor", publish=(), subscribe=("network",))
    log_program, monitor_program = readme_clients()
    procs = [
        run_readme_program(log_program, server.http, logger.token, tmp_path, "logger"),
        run_readme_program(monitor_program, server.http, monitor.token, tmp_path, "monitor"),
    ]
    try:
        assert eventually(lambda: Subscription.objects.count() == 3, timeout=15)
        with Client(server.http, logger.token) as mq:
            mq.publish("db", "create", {"id": 1})
            mq.publish("filesystem", "create", {"path": "/x"})
        network = Queue.objects.get(name="network")  # published as an operator: the logger may not
        publishing.publish(network, [publishing.prepare("error", {"host": "db-1"})])
        assert eventually(
            lambda: (
                set(Delivery.objects.filter(subscriber=logger).values_list("status", flat=True))
                == {Status.ACKED}
            ),
            timeout=15,
        )
        dead = Delivery.objects.filter(subscriber=monitor, status=Status.DEAD)
        assert eventually(dead.exists, timeout=20)
        assert "nacked by the client:" in dead.get().last_error
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        outs = [proc.communicate(timeout=20)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    assert "db create 1 {'id': 1}" in outs[0] and "filesystem create 1 {'path': '/x'}" in outs[0]
