"""Message groups (API.md, Extensions 2026-11-27): a message may name a group; in an ordered
queue order holds within each group, one of it in flight at a time, while the groups' heads go
out at once, the oldest first; without groups an ordered queue is one line as before; in an
unordered queue the group is carried and changes nothing. Deliveries carry "group"."""

from datetime import timedelta

import pytest
from django.utils import timezone

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery, Status
from tests.conftest import client_for
from tests.support.rest import post_messages, pull


@pytest.fixture
def ordered(db_queue):
    db_queue.ordered = True
    db_queue.save()
    return db_queue


def publish(who, items):
    """POST a batch of (event, n, group) as `who`; the answer's messages."""
    body = {
        "messages": [{"event": "e", "payload": {"n": n}, **({"group": g} if g else {})} for n, g in items]
    }
    r = post_messages(who, body)
    assert r.status_code == 201, r.content
    return r.json()["messages"]


def ack(who, deliveries):
    r = client_for(who).post("/api/deliveries/ack", {"ids": [d["id"] for d in deliveries]}, format="json")
    assert r.status_code == 200, r.content


def heads_of(queue):
    return sorted(Delivery.objects.filter(queue=queue).heads().values_list("seq", flat=True))


def test_an_ordered_queue_hands_out_one_head_per_group_oldest_first_and_the_next_after_its_ack(
    owner, ordered
):
    # Given: a, b, a, c, b, default, a (seqs 1..7)
    publish(owner, [(1, "a"), (2, "b"), (3, "a"), (4, "c"), (5, "b"), (6, None), (7, "a")])

    # When: the subscriber pulls up to 10
    first = pull(owner, "?limit=10")

    # Then: each group's first message, in seq order; nothing more while they are in flight
    assert [(d["seq"], d["group"]) for d in first] == [(1, "a"), (2, "b"), (4, "c"), (6, None)]
    assert pull(owner, "?limit=10") == []

    # When: a's head is acked, then b's
    ack(owner, [first[0]])
    assert [(d["seq"], d["group"]) for d in pull(owner, "?limit=10")] == [(3, "a")]
    ack(owner, [first[1]])
    assert [d["seq"] for d in pull(owner, "?limit=10")] == [5]
    # Then: at most one per group in flight throughout, as the database holds it
    inflight = Delivery.objects.filter(queue=ordered, status=Status.INFLIGHT)
    groups = list(inflight.values_list("grp", flat=True))
    assert sorted(groups) == ["", "a", "b", "c"]


def test_the_window_limits_how_many_heads_go_and_the_rest_follow(owner, ordered):
    publish(owner, [(n, f"g{n}") for n in range(6)])
    got = pull(owner, "?limit=4")
    assert [d["group"] for d in got] == ["g0", "g1", "g2", "g3"]
    assert [d["group"] for d in pull(owner, "?limit=4")] == ["g4", "g5"]


def test_an_ordered_queue_without_groups_is_one_line_as_before(owner, ordered):
    publish(owner, [(1, None), (2, None), (3, None)])
    seen = []
    for _ in range(3):
        got = pull(owner, "?limit=10")
        assert len(got) == 1 and got[0]["group"] is None
        seen.append(got[0]["seq"])
        ack(owner, got)
    assert seen == [1, 2, 3]
    assert heads_of(ordered) == []


def test_in_an_unordered_queue_the_group_is_carried_and_changes_nothing(owner, db_queue):
    publish(owner, [(1, "a"), (2, "a"), (3, None)])
    got = pull(owner, "?limit=10")
    assert [(d["seq"], d["group"]) for d in got] == [(1, "a"), (2, "a"), (3, None)]
    assert not Delivery.objects.filter(head=True).exists()
    assert set(Delivery.objects.values_list("grp", flat=True)) == {None}


@pytest.mark.parametrize(
    "group",
    ["", "x" * 129, 5, ["a"], {"a": 1}, "nul\u0000"],
    ids=["empty", "129", "int", "list", "dict", "nul"],
)
def test_a_group_that_is_not_a_string_of_1_to_128_characters_is_a_400_naming_it(owner, group):
    r = post_messages(owner, {"event": "e", "payload": 1, "group": group})
    assert r.status_code == 400, r.content
    assert "group" in r.json()
    r = post_messages(owner, {"messages": [{"event": "e", "payload": 1, "group": group}]})
    assert r.status_code == 400, r.content
    assert not Delivery.objects.exists()


def test_a_group_of_128_characters_is_carried_whole(owner):
    post_messages(owner, {"event": "e", "payload": 1, "group": "é" * 128})
    assert pull(owner)[0]["group"] == "é" * 128


def test_a_dead_head_releases_its_group(owner, ordered):
    ordered.max_attempts = 1
    ordered.save()
    publish(owner, [(1, "a"), (2, "a"), (3, "b")])
    a1, b = pull(owner, "?limit=10")
    r = client_for(owner).post(f"/api/deliveries/{a1['id']}/nack", {"retry_in": 0}, format="json")
    assert r.json()["status"] == "dead"
    assert [d["seq"] for d in pull(owner, "?limit=10")] == [2]
    assert b["seq"] == 3


def test_a_head_waiting_for_its_retry_holds_its_group_only(owner, ordered):
    publish(owner, [(1, "a"), (2, "a"), (3, "b"), (4, "b")])
    a1, b1 = pull(owner, "?limit=10")
    client_for(owner).post(f"/api/deliveries/{a1['id']}/nack", {"retry_in": 60}, format="json")
    ack(owner, [b1])
    assert [d["seq"] for d in pull(owner, "?limit=10")] == [4]  # b goes on; a waits for 1


def test_a_redelivered_message_goes_before_its_groups_later_ones(owner, ordered, operator):
    publish(owner, [(1, "a"), (2, "a"), (3, "a")])
    (a1,) = pull(owner, "?limit=10")
    ledger.kill_deliveries(Delivery.objects.filter(pk=a1["id"]))  # dead: 2 goes on
    (a2,) = pull(owner, "?limit=10")
    ack(owner, [a2])
    # When: an operator redelivers 1 while 3 is the pending head
    ledger.redeliver(Delivery.objects.filter(pk=a1["id"]))
    # Then: 1 goes first, then 3
    assert [d["seq"] for d in pull(owner, "?limit=10")] == [1]
    assert heads_of(ordered) == [1]


def test_a_seek_replays_each_group_in_order(owner, ordered):
    publish(owner, [(1, "a"), (2, "b"), (3, "a"), (4, "b")])
    for _ in range(2):
        got = pull(owner, "?limit=10")
        ack(owner, got)
    sub = owner.subscriptions.get()
    ledger.replay(sub, ("all", None), reopen=True)
    assert [(d["seq"], d["group"]) for d in pull(owner, "?limit=10")] == [(1, "a"), (2, "b")]


def test_one_batch_with_several_messages_of_a_group_makes_one_head(owner, ordered):
    publish(owner, [(1, "a"), (2, "a"), (3, "a"), (4, "b")])
    assert heads_of(ordered) == [1, 4]


def test_a_queue_made_ordered_puts_its_backlog_in_lines(owner, db_queue):
    publish(owner, [(1, "a"), (2, "a"), (3, None)])
    db_queue.ordered = True
    db_queue.save()  # the admin's and createqueue's way: the save relines the backlog
    assert heads_of(db_queue) == [1, 3]
    assert [d["seq"] for d in pull(owner, "?limit=10")] == [1, 3]
    db_queue.ordered = False
    db_queue.save()
    assert [d["seq"] for d in pull(owner, "?limit=10")] == [2]
    assert not Delivery.objects.exclude(grp=None).exists()


def test_the_socket_publish_frame_and_the_python_publish_take_a_group(owner, ordered):
    from delivery import frames

    (o,), _ = frames.outgoing_of({"type": "publish", "event": "e", "payload": 1, "group": "g"})
    assert o.group == "g"
    with pytest.raises(frames.FrameError):
        frames.outgoing_of({"type": "publish", "event": "e", "payload": 1, "group": ""})
    publishing.publish(ordered, [publishing.prepare("e", 2, group="g")])
    assert pull(owner)[0]["group"] == "g"


def test_a_lease_ahead_of_a_retry_never_passes_the_groups_waiting_head(owner, ordered):
    publish(owner, [(1, "a"), (2, "a")])
    (a1,) = pull(owner)
    ledger.nack_deliveries(owner, [a1["id"]], retry_in=3600)
    later = timezone.now() + timedelta(seconds=10)
    assert ledger.lease_deliveries(owner, limit=10, now=later) == []
    subscribing.subscribe(owner, ordered)  # the same subscription again: nothing changes
    assert heads_of(ordered) == [1]


def test_queuestats_and_the_owed_report_count_the_groups_with_work(owner, ordered):
    import json
    from io import StringIO

    from django.core.management import call_command

    from delivery import reports

    publish(owner, [(1, "a"), (2, "a"), (3, "b"), (4, None), (5, "b")])
    pull(owner, "?limit=1")  # a's head in flight
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    (stats,) = json.loads(out.getvalue())["groups"]
    assert (stats["queue"], stats["groups"], stats["lines"]) == ("db", 3, 3)
    assert [(h["seq"], h["group"], h["status"]) for h in stats["oldest_heads"]] == [
        (1, "a", "inflight"),
        (3, "b", "pending"),
        (4, None, "pending"),
    ]
    (owed,) = reports.owed_to_subscriber(owner)
    assert owed.groups == 3
    blocked = [r for r in owed.reasons if r.code == "blocked"]
    assert len(blocked) == 1 and blocked[0].words.startswith("2 blocked")  # 2 and 5; 3 and 4 go
