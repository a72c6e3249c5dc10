"""Subscription filters (the API's Extensions, "Filters"): a subscription owes only the messages
whose headers and payload fields hold one of the listed values; checked once when set (400
bad_filter naming the key), evaluated by the fan-out statement in SQL on both databases."""

import pytest

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery
from subscribers import filters, replay
from subscribers.models import FilterClause, Subscription
from tests.conftest import client_for
from tests.support.rest import post_messages, pull, subscribe

pytestmark = pytest.mark.django_db


def publish(who, messages, queue="db"):
    """Publish a batch over REST; the answers."""
    r = post_messages(who, {"messages": messages}, queue)
    assert r.status_code == 201, r.content
    return r.json()["messages"]


def owed_payloads(subscription_id):
    return [
        d.message.payload_json
        for d in Delivery.objects.filter(subscription_id=subscription_id)
        .select_related("message")
        .order_by("seq")
    ]


# --- checked when set -----------------------------------------------------------------------------

TOO_MANY_KEYS = {f"payload.k{i}": [i] for i in range(17)}

BAD_FILTERS = [
    (TOO_MANY_KEYS, "payload.k16"),
    ({"payload.a.b.c.d.e": [1]}, "payload.a.b.c.d.e"),
    ({"payload.kind": list(range(65))}, "payload.kind"),
    ({"payload.kind": [{"a": 1}]}, "payload.kind"),
    ({"payload.kind": [[1]]}, "payload.kind"),
    ({"body.kind": ["x"]}, "body.kind"),
    ({"payload": ["x"]}, "payload"),
    ({"headers.bad name": ["x"]}, "headers.bad name"),
    ({"payload.a..b": ["x"]}, "payload.a..b"),
    ({'payload.a"b': ["x"]}, 'payload.a"b'),
    ({"payload.kind": "x"}, "payload.kind"),
    ({"payload.kind": []}, "payload.kind"),
    ({"payload.kind": ["a\x00b"]}, "payload.kind"),
]


@pytest.mark.parametrize(("bad", "key"), BAD_FILTERS, ids=[k for _, k in BAD_FILTERS])
def test_a_malformed_filter_is_a_400_bad_filter_naming_the_key_and_makes_nothing(logger, bad, key):
    r = subscribe(logger, {"queue": "db", "filter": bad})
    assert r.status_code == 400, r.content
    body = r.json()
    assert body["code"] == "bad_filter" and repr(key) in body["detail"], body
    assert not Subscription.objects.exists()


def test_a_filter_that_is_no_object_is_a_400(logger):
    r = subscribe(logger, {"queue": "db", "filter": ["payload.kind"]})
    assert r.status_code == 400 and r.json()["code"] == "bad_filter"


def test_the_limits_themselves_are_allowed(logger):
    most = {f"payload.k{i}": list(range(64)) for i in range(15)} | {"payload.a.b.c.d": [None]}
    r = subscribe(logger, {"queue": "db", "filter": most})
    assert r.status_code == 201, r.content
    assert r.json()["filter"] == most
    assert FilterClause.objects.count() == 16


# --- what a filtered subscription is owed ---------------------------------------------------------


def filtered(who, flt, event=None):
    body = {"queue": "db", "filter": flt} | ({"event": event} if event else {})
    r = subscribe(who, body)
    assert r.status_code == 201, r.content
    return r.json()["id"]


def test_only_matching_messages_are_owed_and_the_publish_counts_only_those(logger, peer):
    sub = filtered(logger, {"payload.kind": ["red", "blue"]})
    subscribe(peer, {"queue": "db"})  # unfiltered: owed everything
    answers = publish(
        peer,
        [
            {"event": "paint", "payload": {"kind": "red"}},
            {"event": "paint", "payload": {"kind": "green"}},
            {"event": "paint", "payload": {"kind": "blue", "n": 2}},
            {"event": "paint", "payload": {"other": "red"}},
        ],
    )
    assert [a["deliveries"] for a in answers] == [2, 1, 2, 1]
    assert owed_payloads(sub) == ['{"kind":"red"}', '{"kind":"blue","n":2}']
    assert [d["payload"]["kind"] for d in pull(logger)] == ["red", "blue"]


VALUE_CASES = [
    # (allowed, payload value or ABSENT, matches)
    ([1], 1.0, True),
    ([1.0], 1, True),
    ([1], True, False),
    ([True], 1, False),
    ([False], 0, False),
    ([0], False, False),
    (["1"], 1, False),
    ([1], "1", False),
    ([None], None, True),
    ([None], "ABSENT", True),
    (["x"], "ABSENT", False),
    (["x", None], "ABSENT", True),
    ([None], "", False),
    ([2.5], 2.5, True),
    ([-3], -3, True),
    ([10**15], 10**15, True),
    (["x"], {"a": "x"}, False),
    (["x"], ["x"], False),
    ([None], [], False),
    (["é"], "é", True),
    ([True, False], False, True),
]


@pytest.mark.parametrize(("allowed", "value", "matches"), VALUE_CASES)
def test_values_are_compared_as_json_values(logger, peer, allowed, value, matches):
    sub = filtered(logger, {"payload.v": allowed})
    payload = {} if value == "ABSENT" else {"v": value}
    [answer] = publish(peer, [{"event": "x", "payload": payload}])
    assert answer["deliveries"] == int(matches)
    assert Delivery.objects.filter(subscription_id=sub).count() == int(matches)


def test_nested_fields_and_headers_all_must_hold(logger, peer):
    sub = filtered(logger, {"payload.order.customer.tier": ["gold"], "headers.tenant": ["acme"]})
    answers = publish(
        peer,
        [
            {
                "event": "x",
                "payload": {"order": {"customer": {"tier": "gold"}}},
                "headers": {"tenant": "acme"},
            },
            {
                "event": "x",
                "payload": {"order": {"customer": {"tier": "gold"}}},
                "headers": {"tenant": "other"},
            },
            {"event": "x", "payload": {"order": {"customer": {"tier": "gold"}}}},  # no headers
            {"event": "x", "payload": {"order": {"customer": "gold"}}, "headers": {"tenant": "acme"}},
            # An array on the way is not looked into (both databases alike).
            {
                "event": "x",
                "payload": {"order": [{"customer": {"tier": "gold"}}]},
                "headers": {"tenant": "acme"},
            },
            {"event": "x", "payload": "gold", "headers": {"tenant": "acme"}},
        ],
    )
    assert [a["deliveries"] for a in answers] == [1, 0, 0, 0, 0, 0]
    assert len(owed_payloads(sub)) == 1


def test_an_absent_header_matches_where_null_is_listed(logger, peer):
    filtered(logger, {"headers.tenant": [None, "acme"]})
    answers = publish(
        peer,
        [
            {"event": "x", "payload": 1},
            {"event": "x", "payload": 1, "headers": {"other": "y"}},
            {"event": "x", "payload": 1, "headers": {"tenant": "acme"}},
            {"event": "x", "payload": 1, "headers": {"tenant": "zzz"}},
        ],
    )
    assert [a["deliveries"] for a in answers] == [1, 1, 1, 0]


def test_a_payload_holding_a_nul_is_published_and_filtered_like_any_other(logger, peer):
    # PostgreSQL's jsonb refuses the escape \u0000: the filters must not fail the publish.
    filtered(logger, {"payload.kind": ["a"]})
    answers = publish(
        peer,
        [
            {"event": "x", "payload": {"kind": "a", "note": "x\u0000y"}},
            {"event": "x", "payload": {"kind": "a\u0000"}},
            {"event": "x", "payload": {"kind": "a", "note": "\\u0000 as text"}},
        ],
    )
    assert [a["deliveries"] for a in answers] == [1, 0, 1]


def test_a_filter_and_an_event_both_hold(logger, peer):
    filtered(logger, {"payload.kind": ["a"]}, event="made")
    answers = publish(
        peer,
        [{"event": "made", "payload": {"kind": "a"}}, {"event": "gone", "payload": {"kind": "a"}}],
    )
    assert [a["deliveries"] for a in answers] == [1, 0]


def test_every_publish_path_applies_the_filter(logger, peer, db_queue):
    """The keyed publish (ledger.fan_out), the one-statement publish and a batch all agree."""
    sub = filtered(logger, {"payload.n": [1, 3]})
    keyed = [publishing.prepare("x", {"n": i}, key=f"k{i}") for i in range(4)]
    plain = [publishing.prepare("x", {"n": i}) for i in range(4)]
    counts = [a["deliveries"] for a, _ in publishing.publish(db_queue, keyed)]
    counts += [a["deliveries"] for a, _ in publishing.publish(db_queue, plain)]
    assert counts == [0, 1, 0, 1] * 2
    assert owed_payloads(sub) == ['{"n":1}', '{"n":3}'] * 2


def test_unfiltered_subscriptions_of_a_queue_with_filters_are_owed_everything(logger, peer, make_subscriber):
    third = make_subscriber("third", publish=("db",), subscribe=("db",))
    filtered(logger, {"payload.kind": ["a"]})
    subscribe(peer, {"queue": "db"})
    subscribe(third, {"queue": "db", "filter": None})
    answers = publish(peer, [{"event": "x", "payload": {"kind": k}} for k in ("a", "b")])
    assert [a["deliveries"] for a in answers] == [3, 2]


# --- set, changed, cleared ------------------------------------------------------------------------


def test_a_repeat_post_with_another_filter_changes_it_and_answers_200(logger, peer):
    first = subscribe(logger, {"queue": "db", "filter": {"payload.kind": ["a"]}}).json()
    assert first["filter"] == {"payload.kind": ["a"]}
    publish(peer, [{"event": "x", "payload": {"kind": "b"}}])
    r = subscribe(logger, {"queue": "db", "filter": {"payload.kind": ["b"]}})
    assert r.status_code == 200 and r.json()["id"] == first["id"]
    assert r.json()["filter"] == {"payload.kind": ["b"]}
    # From when it is set: the message published before stays unowed.
    publish(peer, [{"event": "x", "payload": {"kind": "b"}}, {"event": "x", "payload": {"kind": "a"}}])
    assert owed_payloads(first["id"]) == ['{"kind":"b"}']
    # A repeat without "filter" keeps it (a client that knows no filters clears nothing).
    r = subscribe(logger, {"queue": "db"})
    assert r.status_code == 200 and r.json()["filter"] == {"payload.kind": ["b"]}
    listed = client_for(logger).get("/api/subscriptions").json()["subscriptions"]
    assert [s["filter"] for s in listed] == [{"payload.kind": ["b"]}]
    # null clears it: every message again.
    r = subscribe(logger, {"queue": "db", "filter": None})
    assert r.status_code == 200 and r.json()["filter"] is None
    assert not FilterClause.objects.exists()
    [answer] = publish(peer, [{"event": "x", "payload": {"kind": "zzz"}}])
    assert answer["deliveries"] == 1


def test_a_bad_repeat_changes_nothing(logger):
    sub = subscribe(logger, {"queue": "db", "filter": {"payload.kind": ["a"]}}).json()
    r = subscribe(logger, {"queue": "db", "filter": {"payload.kind": [{}]}})
    assert r.status_code == 400 and r.json()["code"] == "bad_filter"
    assert Subscription.objects.get(pk=sub["id"]).filter == {"payload.kind": ["a"]}


def test_patch_sets_and_clears_the_filter(logger, peer):
    sub = subscribe(logger, {"queue": "db"}).json()
    assert sub["filter"] is None
    c = client_for(logger)
    r = c.patch(f"/api/subscriptions/{sub['id']}", {"filter": {"payload.n": [1]}}, format="json")
    assert r.status_code == 200 and r.json() == {**sub, "filter": {"payload.n": [1]}}
    assert [
        a["deliveries"] for a in publish(peer, [{"event": "x", "payload": {"n": n}} for n in (1, 2)])
    ] == [1, 0]
    r = c.patch(f"/api/subscriptions/{sub['id']}", {"filter": {"payload.n": [True]}}, format="json")
    assert r.json()["filter"] == {"payload.n": [True]}  # True is not 1: a change
    r = c.patch(f"/api/subscriptions/{sub['id']}", {"filter": None}, format="json")
    assert r.status_code == 200 and r.json()["filter"] is None
    assert [a["deliveries"] for a in publish(peer, [{"event": "x", "payload": {"n": 2}}])] == [1]
    r = c.patch(f"/api/subscriptions/{sub['id']}", {"filter": {"nope": [1]}}, format="json")
    assert r.status_code == 400 and r.json()["code"] == "bad_filter" and "'nope'" in r.json()["detail"]
    r = c.patch(f"/api/subscriptions/{sub['id']}", {}, format="json")  # names nothing, changes nothing
    assert r.status_code == 200 and r.json()["filter"] is None


def test_patch_of_anothers_subscription_is_404_and_untouched_and_an_operator_may(
    logger, peer, operator_client, django_user_model
):
    theirs = subscribe(peer, {"queue": "db"}).json()
    body = {"filter": {"payload.n": [1]}}
    for pk in (theirs["id"], 999999, 2**70):
        assert client_for(logger).patch(f"/api/subscriptions/{pk}", body, format="json").status_code == 404
    assert client_for().patch(f"/api/subscriptions/{theirs['id']}", body, format="json").status_code == 401
    viewer = django_user_model.objects.create_user("viewer", password="viewer-password-1", is_staff=True)
    c = client_for()
    c.force_login(viewer)
    assert c.patch(f"/api/subscriptions/{theirs['id']}", body, format="json").status_code == 403
    assert Subscription.objects.get(pk=theirs["id"]).filter is None
    r = operator_client.patch(f"/api/subscriptions/{theirs['id']}", body, format="json")
    assert r.status_code == 200 and r.json()["filter"] == body["filter"]


def test_an_operator_cannot_unsubscribe_over_rest_still(logger, operator_client):
    sub = subscribe(logger, {"queue": "db"}).json()
    assert operator_client.delete(f"/api/subscriptions/{sub['id']}").status_code == 403


# --- replay ---------------------------------------------------------------------------------------


def test_a_replay_owes_what_the_filter_allows_now(logger, peer, db_queue):
    publish(peer, [{"event": "x", "payload": {"n": n}} for n in range(6)])
    r = subscribe(logger, {"queue": "db", "from": "all", "filter": {"payload.n": [1, 4]}})
    assert r.status_code == 201 and r.json()["replay"]["deliveries"] == 2
    sub = r.json()["id"]
    assert owed_payloads(sub) == ['{"n":1}', '{"n":4}']
    # A seek with another filter: what it lacks and matches is added; acked ones that match
    # are handed out again, those that no longer match are not.
    got = pull(logger)
    client_for(logger).post("/api/deliveries/ack", {"ids": [d["id"] for d in got]}, format="json")
    subscription = Subscription.objects.get(pk=sub)
    subscribing.set_filter(subscription, filters.check_filter({"payload.n": [4, 5]}))
    replayed = subscribing.seek(subscription, replay.Point("all", None))
    assert replayed.deliveries == 2  # 5 added, 4 reopened; 1 stays acked
    assert [d["payload"]["n"] for d in pull(logger)] == [4, 5]


def test_an_unfiltered_replay_is_as_before(logger, peer, db_queue):
    publish(peer, [{"event": "x", "payload": {"n": n}} for n in range(3)])
    sub = subscribing.subscribe(logger, db_queue)[0]
    assert ledger.replay(sub, replay.Point("all", None)).deliveries == 3


# --- manage.py listen --filter --------------------------------------------------------------------


def test_listen_sets_the_filter_before_its_replay(logger, peer):
    from django.core.management.base import CommandError

    from tests.support.commands import listen

    publish(peer, [{"event": "x", "payload": {"n": n}} for n in range(4)])
    got = listen("logger", "db", "--count", "2", "--from", "all", "--filter", '{"payload.n": [1, 3]}')
    assert [d["payload"]["n"] for d in got] == [1, 3]
    assert Subscription.objects.get(subscriber=logger).filter == {"payload.n": [1, 3]}
    listen("logger", "db", "--count", "1", "--from", "all", "--filter", "null")  # clears it, seeks back
    assert Subscription.objects.get(subscriber=logger).filter is None
    for bad, words in (("{", "not JSON"), ('{"payload.a.b.c.d.e": [1]}', "payload.a.b.c.d.e")):
        with pytest.raises(CommandError, match=words):
            listen("logger", "db", "--count", "1", "--filter", bad)


# --- the admin ------------------------------------------------------------------------------------


def test_the_admin_sets_a_checked_filter_and_writes_it_in_the_history(staff, logger, peer):
    from django.contrib.admin.models import LogEntry

    from tests.support.admin import change

    sub = Subscription.objects.get(pk=subscribe(logger, {"queue": "db"}).json()["id"])
    r = staff.post(change(sub), {"filter_json": '{"payload.a.b.c.d.e": [1]}'})
    assert r.status_code == 200 and "at most 4 levels" in r.content.decode()
    assert Subscription.objects.get(pk=sub.pk).filter is None
    r = staff.post(change(sub), {"filter_json": '{"payload.kind": ["red"]}'})
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Subscription.objects.get(pk=sub.pk).filter == {"payload.kind": ["red"]}
    assert [
        a["deliveries"] for a in publish(peer, [{"event": "x", "payload": {"kind": k}} for k in "rb"])
    ] == [0, 0]
    assert [a["deliveries"] for a in publish(peer, [{"event": "x", "payload": {"kind": "red"}}])] == [1]
    assert "payload.kind" in staff.get(change(sub)).content.decode()
    assert LogEntry.objects.filter(object_id=str(sub.pk)).last().get_change_message() == "Changed filter."
    staff.post(change(sub), {"filter_json": ""})
    assert Subscription.objects.get(pk=sub.pk).filter is None and not FilterClause.objects.exists()


def test_the_queues_page_asks_who_would_receive_a_message(staff, logger, peer, db_queue):
    from django.urls import reverse

    from tests.support.admin import change

    mine = subscribe(logger, {"queue": "db", "filter": {"payload.kind": ["red"]}}).json()
    subscribe(peer, {"queue": "db", "event": "other"})
    url = reverse("admin:queues_queue_route", args=[db_queue.pk])
    assert url in staff.get(change(db_queue)).content.decode()
    assert staff.get(url).status_code == 200
    page = staff.post(url, {"event": "paint", "payload": '{"kind": "blue"}', "headers": ""}).content.decode()
    assert "filter key payload.kind has &quot;blue&quot;" in page and "event differs" in page
    assert f"/admin/subscribers/subscription/{mine['id']}/change/" in page
    page = staff.post(url, {"event": "Bad Name!", "payload": "1"}).content.decode()
    assert "errorlist" in page
    from queues.models import Message

    assert not Message.objects.exists()
    from tests.conftest import client_for as anonymous

    assert anonymous().get(url).status_code == 302  # to the login page: staff only
