"""End to end, a real Daphne: a replay of the whole hot backlog (subscribe from all, then
unsubscribe, in a loop) must not stall other tenants' publishes (issue 26, S2). Replays and
unsubscribes go in chunks, each its own short transaction; the subscription still owes every
message exactly once, in seq order."""

import statistics
import threading
import time

import pytest

from delivery.models import Delivery
from queues.models import Queue
from subscribers.models import Subscription
from subscribers.provisioning import create_subscriber
from tests.support.backlog import call, fill

pytestmark = pytest.mark.django_db(transaction=True)

BACKLOG = 50_000  # hot messages, as in the finding
LOOP_SECS = 12
# Generous: the finding measured 3.2 s at the median; the target is under 100 ms.
MEDIAN_BOUND_SECS = 0.25


def test_a_loop_of_replays_of_the_whole_backlog_leaves_other_publishers_fast_and_owes_each_message_once(
    server,
):
    hist = Queue.objects.create(name="hist")
    Queue.objects.create(name="orders")
    fill(hist, BACKLOG)
    _, looper = create_subscriber("looper", subscribe=["hist"])
    _, tenant = create_subscriber("tenant", publish=["orders", "hist"])

    stop = threading.Event()
    loops, refused, errors = [], [], []

    def replay_loop():
        while not stop.is_set():
            started = time.monotonic()
            status, body, headers = call(
                server, looper, "POST", "/api/subscriptions", {"queue": "hist", "from": "all"}
            )
            if status == 429:
                refused.append(headers.get("Retry-After"))
                continue
            if status != 201:
                errors.append((status, body))
                return
            assert body["replay"] == {"from_seq": 1, "deliveries": body["replay"]["deliveries"]}
            deleted, _, _ = call(server, looper, "DELETE", f"/api/subscriptions/{body['id']}")
            if deleted != 204:
                errors.append((deleted, None))
                return
            loops.append((body["replay"]["deliveries"], time.monotonic() - started))

    def publish_timed(queue, n):
        took = []
        for i in range(n):
            started = time.monotonic()
            status, _, _ = call(
                server, tenant, "POST", f"/api/queues/{queue}/messages", {"event": "e", "payload": {"i": i}}
            )
            took.append(time.monotonic() - started)
            assert status == 201
        return took

    quiet = publish_timed("orders", 20)
    looping = threading.Thread(target=replay_loop)
    looping.start()
    time.sleep(0.5)
    busy = {"orders": [], "hist": []}
    deadline = time.monotonic() + LOOP_SECS
    while time.monotonic() < deadline:
        busy["orders"] += publish_timed("orders", 1)
        busy["hist"] += publish_timed("hist", 1)  # the queue being replayed, too
    stop.set()
    looping.join(timeout=120)
    assert not errors, errors
    assert loops, "not one replay finished"

    def ms(took):
        return f"median {statistics.median(took) * 1000:.0f} ms, max {max(took) * 1000:.0f} ms, n={len(took)}"

    print(
        f"\nquiet publish: {ms(quiet)}\nduring replays, to another queue: {ms(busy['orders'])}"
        f"\nduring replays, to the replayed queue: {ms(busy['hist'])}"
        f"\nreplay+unsubscribe loops: {len(loops)}, median {statistics.median(t for _, t in loops):.2f} s"
        f" ({loops[0][0]} deliveries each at first); refused 429: {len(refused)}"
    )
    assert statistics.median(busy["orders"]) < MEDIAN_BOUND_SECS
    assert statistics.median(busy["hist"]) < MEDIAN_BOUND_SECS

    # A replay left in place, while the tenant goes on publishing to its queue, and the
    # subscriber already asking for deliveries: every message exactly once, oldest first.
    leased, publishing_on = [], threading.Event()

    def pull():
        while not publishing_on.is_set():
            time.sleep(0.01)
            status, body, _ = call(server, looper, "GET", "/api/deliveries?limit=5")
            if status == 200 and body["deliveries"]:
                leased.extend(body["deliveries"])
                return

    def publish_meanwhile():
        while not publishing_on.is_set():
            publish_timed("hist", 1)

    threads = [threading.Thread(target=pull), threading.Thread(target=publish_meanwhile)]
    for t in threads:
        t.start()
    status, body, _ = call(server, looper, "POST", "/api/subscriptions", {"queue": "hist", "from": "all"})
    assert status == 201 and body["replay"]["from_seq"] == 1
    time.sleep(0.5)
    publishing_on.set()
    for t in threads:
        t.join(timeout=60)

    sub = Subscription.objects.get(pk=body["id"])
    assert sub.busy_since is None and sub.replay_next is None  # done, leased again
    seqs = sorted(Delivery.objects.filter(subscription=sub).values_list("seq", flat=True))
    last_seq = Queue.objects.get(pk=hist.pk).last_seq
    assert last_seq > BACKLOG  # published during the replay too
    assert seqs == list(range(1, last_seq + 1))  # each message once, none missing
    # the first handed out are the oldest: nothing live before the history is owed
    assert [d["seq"] for d in leased] == [1, 2, 3, 4, 5]
