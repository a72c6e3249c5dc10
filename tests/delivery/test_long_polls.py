"""Long polls (GET /api/deliveries?wait=...): they hold no database connection while they wait,
and a subscriber has at most MQ_MAX_LONG_POLLS waiting at once (issue 14)."""

import statistics
import threading
import time
from functools import partial

import httpx
import pytest

from delivery import long_polls, subscribing
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.conftest import client_for
from tests.support.servers import eventually, start_daphne, start_redis

SUBSCRIBERS = 10
POLLS_EACH = 4  # MQ_MAX_LONG_POLLS's default
POOL_SIZE = 4  # far fewer than the polls waiting: none of them may hold one


eventually = partial(eventually, timeout=15)


@pytest.mark.django_db(transaction=True)
def test_forty_waiting_long_polls_hold_no_connection_and_leave_publishes_fast():
    """Forty long polls (ten subscribers, four each) wait on a Daphne whose database pool has
    four connections, across processes' caps in Redis; a fifth poll of a subscriber is a 429;
    another client's publishes answer within 2 s; each poll wakes with the message meant for it."""
    queue = Queue.objects.create(name="db")
    tokens = []
    for i in range(SUBSCRIBERS):
        subscriber, token = create_subscriber(f"s{i}", subscribe=["db"])
        subscribing.subscribe(subscriber, queue, f"e{i}")
        tokens.append(token)
    _, publisher_token = create_subscriber("publisher", publish=["db"])
    redis = start_redis()
    web = start_daphne({"REDIS_URL": redis.url, "DB_POOL_MAX_SIZE": str(POOL_SIZE)})
    polls, refused_then_retried = [], [0]
    lock = threading.Lock()

    def long_poll(i):
        with httpx.Client(base_url=web.http, headers={"Authorization": f"Bearer {tokens[i]}"}) as c:
            while True:
                r = c.get("/api/deliveries?wait=30&limit=1", timeout=40)
                if r.status_code != 429:  # a probe below held a slot for a moment: go again
                    break
                with lock:
                    refused_then_retried[0] += 1
                time.sleep(0.1)
            with lock:
                polls.append((i, r, time.monotonic()))

    threads = [
        threading.Thread(target=long_poll, args=(i,)) for i in range(SUBSCRIBERS) for _ in range(POLLS_EACH)
    ]
    try:
        for t in threads:
            t.start()
        # Given: every subscriber's four polls are waiting, which a fifth (short) poll being
        # refused shows.
        refusals = {}
        for i, token in enumerate(tokens):
            with httpx.Client(base_url=web.http, headers={"Authorization": f"Bearer {token}"}) as c:

                def fifth_refused(c=c, i=i):
                    r = c.get("/api/deliveries?wait=0.2", timeout=10)
                    refusals[i] = r
                    return r.status_code == 429

                assert eventually(fifth_refused), refusals[i].content
                # A plain pull is never refused by the cap.
                plain = c.get("/api/deliveries?wait=0", timeout=10)
                assert plain.status_code == 200 and plain.json() == {"deliveries": []}
        fifth = refusals[0]
        assert int(fifth.headers["Retry-After"]) >= 1
        assert "MQ_MAX_LONG_POLLS" in fifth.json()["detail"]
        assert not polls, "a poll answered before anything was published"

        # When: another client publishes, first to an event nobody waits for, then one message
        # for each waiting poll.
        times, sent_at = [], {}
        with httpx.Client(base_url=web.http, headers={"Authorization": f"Bearer {publisher_token}"}) as pub:

            def publish(event):
                started = time.monotonic()
                r = pub.post("/api/queues/db/messages", json={"event": event, "payload": {}}, timeout=15)
                times.append(time.monotonic() - started)
                assert r.status_code == 201, r.content
                return r.json()["id"], started

            for _ in range(20):
                publish("other")
            for _ in range(POLLS_EACH):
                for i in range(SUBSCRIBERS):
                    message_id, started = publish(f"e{i}")
                    sent_at[message_id] = (i, started)
        for t in threads:
            t.join(timeout=40)

        # Then: every publish answered within 2 s, and every poll woke with its own message.
        print(
            f"\n{len(times)} publishes beside {SUBSCRIBERS * POLLS_EACH} long polls (pool {POOL_SIZE}):"
            f" p50 {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms;"
            f" polls refused then retried: {refused_then_retried[0]}"
        )
        assert max(times) < 2, times
        assert len(polls) == SUBSCRIBERS * POLLS_EACH
        woke_after = []
        for i, r, answered in polls:
            assert r.status_code == 200, r.content
            (delivery,) = r.json()["deliveries"]
            meant_for, published = sent_at[delivery["message_id"]]
            assert meant_for == i and delivery["event"] == f"e{i}"
            woke_after.append(answered - published)
        print(f"polls woke {statistics.median(woke_after) * 1000:.0f} ms (p50) after their publish")
        assert len({r.json()["deliveries"][0]["id"] for _, r, _ in polls}) == len(polls)  # each once
        assert max(woke_after) < 10  # woken by their message, long before their 30 s wait
    finally:
        web.stop()
        redis.stop()
        for t in threads:
            t.join(timeout=1)


@pytest.mark.django_db(transaction=True)
def test_a_fifth_long_poll_gets_429_and_a_plain_pull_is_still_served(logger, settings):
    """In one process without Redis (the embedded mode), the cap is counted in the process."""
    settings.MQ_MAX_LONG_POLLS = 2
    client_for(logger).post("/api/subscriptions", {"queue": "db"}, format="json")
    answers = []

    def long_poll():
        from django.db import connection

        try:
            answers.append(client_for(logger).get("/api/deliveries?wait=3"))
        finally:
            connection.close()

    threads = [threading.Thread(target=long_poll) for _ in range(2)]
    for t in threads:
        t.start()
    assert eventually(lambda: long_polls._held.get(logger.pk) == 2, timeout=5)
    third = client_for(logger).get("/api/deliveries?wait=1")
    assert third.status_code == 429 and third["Retry-After"] == "1"
    assert "MQ_MAX_LONG_POLLS" in third.json()["detail"]
    assert client_for(logger).get("/api/deliveries").status_code == 200
    client_for(logger).post("/api/queues/db/messages", {"event": "create", "payload": 1}, format="json")
    for t in threads:
        t.join(timeout=10)
    assert sorted(len(a.json()["deliveries"]) for a in answers) == [0, 1]  # one woke with it
    assert not long_polls._held  # the slots were given back
    assert client_for(logger).get("/api/deliveries?wait=0.1").status_code == 200


def test_a_slot_of_a_killed_process_frees_itself_in_redis(settings, monkeypatch):
    """A process killed mid-wait never gives its slots back: they expire by themselves."""
    redis = start_redis()
    try:
        settings.REDIS_URL = redis.url
        settings.MQ_MAX_LONG_POLLS = 2
        long_polls.bus.client.cache_clear()
        long_polls._take_script.cache_clear()
        monkeypatch.setattr(long_polls, "SLOT_MARGIN_SECS", 0.3)
        killed = [long_polls.slot(7, 0.2) for _ in range(2)]
        for held in killed:
            held.__enter__()  # and never left: its process died
        with pytest.raises(long_polls.TooManyLongPolls), long_polls.slot(7, 0.2):
            pass
        with long_polls.slot(8, 0.2):  # another subscriber's count is its own
            pass
        time.sleep(0.6)
        with long_polls.slot(7, 0.2), long_polls.slot(7, 0.2):
            with pytest.raises(long_polls.TooManyLongPolls), long_polls.slot(7, 0.2):
                pass
        for held in killed:
            held.__exit__(None, None, None)  # (only so the generators end while Redis is up)
    finally:
        long_polls.bus.client.cache_clear()
        long_polls._take_script.cache_clear()
        redis.stop()
