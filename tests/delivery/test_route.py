"""Who would receive this: POST /api/queues/{queue}/route answers which subscriptions a message
would be owed to, and why, publishing nothing; and it says what a real publish then does."""

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delivery import publishing, routing, subscribing
from delivery.models import Delivery
from queues.models import Message, Queue
from subscribers import filters
from subscribers.models import Subscriber, Subscription
from tests.conftest import client_for
from tests.support.rest import subscribe

pytestmark = pytest.mark.django_db


def route(who, body, queue="db"):
    return who.post(f"/api/queues/{queue}/route", body, format="json")


def by_subscriber(answer):
    return {s["subscriber"]: (s["matches"], s["reason"]) for s in answer["subscriptions"]}


def test_an_operator_sees_every_subscription_and_why_and_nothing_is_published(
    logger, peer, make_subscriber, operator_client
):
    third = make_subscriber("third", publish=("db",), subscribe=("db",))
    fourth = make_subscriber("fourth", publish=("db",), subscribe=("db",))
    subscribe(logger, {"queue": "db", "filter": {"payload.kind": ["red"], "headers.tenant": ["acme"]}})
    subscribe(peer, {"queue": "db", "event": "other"})
    subscribe(third, {"queue": "db", "filter": {"headers.region": ["eu"]}})
    subscribe(fourth, {"queue": "db"})
    body = {"event": "paint", "payload": {"kind": "red"}, "headers": {"tenant": "zeta"}}
    r = route(operator_client, body)
    assert r.status_code == 200, r.content
    subs = r.json()["subscriptions"]
    assert [s["id"] for s in subs] == sorted(s["id"] for s in subs)
    assert set(subs[0]) == {"id", "subscriber", "event", "matches", "reason"}
    assert by_subscriber(r.json()) == {
        "logger": (False, 'filter key headers.tenant has "zeta"'),
        "peer": (False, "event differs"),
        "third": (False, "filter key headers.region is absent"),
        "fourth": (True, "owed"),
    }
    assert not Message.objects.exists() and not Delivery.objects.exists()
    body["headers"]["tenant"] = "acme"
    assert by_subscriber(route(operator_client, body).json())["logger"] == (True, "owed")


def test_a_subscriber_sees_only_its_own_and_a_stranger_nothing(logger, peer, outsider, operator_client):
    mine = subscribe(logger, {"queue": "db"}).json()
    subscribe(peer, {"queue": "db"})
    body = {"event": "x", "payload": 1}
    r = route(client_for(logger), body)
    assert r.status_code == 200
    assert r.json() == {
        "subscriptions": [
            {"id": mine["id"], "subscriber": "logger", "event": None, "matches": True, "reason": "owed"}
        ]
    }
    r = route(client_for(outsider), body)
    assert r.status_code == 404 and "subscriptions" not in r.json()
    assert route(client_for(outsider), body, queue="nope").status_code == 404
    assert route(client_for(), body).status_code == 401
    assert route(operator_client, body, queue="nope").status_code == 404


def test_a_publisher_that_may_not_subscribe_sees_an_empty_list(make_subscriber, logger):
    subscribe(logger, {"queue": "db"})
    publisher = make_subscriber("pub", publish=("db",), subscribe=())
    r = route(client_for(publisher), {"event": "x", "payload": 1})
    assert r.status_code == 200 and r.json() == {"subscriptions": []}


def test_the_body_is_checked_as_a_publishs(logger, db_queue):
    c = client_for(logger)
    assert route(c, {"event": "Bad Name!", "payload": 1}).status_code == 400
    assert route(c, {"payload": 1}).status_code == 400
    r = route(c, {"event": "x", "payload": 1, "headers": {"bad name": "v"}})
    assert r.status_code == 400 and "headers" in r.json()
    from queues import schemas
    from queues.models import Event

    event = Event.objects.create(queue=db_queue, name="typed")
    schemas.save_schema(event, {"type": "object", "required": ["id"]})
    r = route(c, {"event": "typed", "payload": {}})
    assert r.status_code == 400 and r.json()["code"] == "schema_mismatch"


def test_each_reason_that_stops_a_delivery_and_paused_ones_are_owed(
    logger, peer, make_subscriber, operator_client, db_queue
):
    inactive = make_subscriber("inactive", publish=("db",), subscribe=("db",))
    revoked = make_subscriber("revoked", publish=("db",), subscribe=("db",))
    leaving = make_subscriber("leaving", publish=("db",), subscribe=("db",))
    for s in (logger, peer, inactive, revoked, leaving):
        subscribe(s, {"queue": "db"})
    Subscriber.objects.filter(pk=inactive.pk).update(is_active=False)
    revoked.subscribe_queues.clear()
    Subscription.objects.filter(subscriber=leaving).update(leaving=True)
    subscribing.pause(Subscription.objects.filter(subscriber=logger))
    body = {"event": "x", "payload": {"n": 1}}
    assert by_subscriber(route(operator_client, body).json()) == {
        "logger": (True, routing.HELD_SUBSCRIPTION),
        "peer": (True, "owed"),
        "inactive": (False, "subscriber inactive"),
        "revoked": (False, "no right to subscribe"),
        "leaving": (False, "being unsubscribed"),
    }
    Queue.objects.filter(pk=db_queue.pk).update(paused=True)
    assert by_subscriber(route(operator_client, body).json())["peer"] == (True, routing.HELD_QUEUE)
    # And a publish agrees: the two paused ones are owed, the others not.
    [(answer, _)] = publishing.publish(db_queue, [publishing.prepare("x", {"n": 1})])
    assert answer["deliveries"] == 2
    owed = set(Delivery.objects.values_list("subscriber__name", flat=True))
    assert owed == {"logger", "peer"}


# --- the route says what a publish does -----------------------------------------------------------

VALUES = st.sampled_from([None, True, False, 0, 1, 1.0, 2, 2.5, "a", "b", "1", ""])
FIELDS = st.sampled_from(["a", "b"])
PAYLOADS = st.one_of(
    VALUES,
    st.lists(VALUES, max_size=2),
    st.dictionaries(
        FIELDS,
        st.one_of(VALUES, st.dictionaries(FIELDS, VALUES, max_size=2), st.lists(VALUES, max_size=2)),
        max_size=2,
    ),
)
HEADERS = st.one_of(
    st.none(), st.dictionaries(st.sampled_from(["t", "u"]), st.sampled_from(["a", "b", "1", ""]))
)
KEYS = st.sampled_from(["payload.a", "payload.b", "payload.a.a", "payload.a.b", "headers.t", "headers.u"])
FILTERS = st.one_of(
    st.none(), st.dictionaries(KEYS, st.lists(VALUES, min_size=1, max_size=3), min_size=1, max_size=3)
)
SUBSCRIPTIONS = st.lists(st.tuples(st.sampled_from([None, "x", "y"]), FILTERS), min_size=4, max_size=4)


class RolledBack(Exception):
    pass


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(subscriptions=SUBSCRIPTIONS, event=st.sampled_from(["x", "y"]), payload=PAYLOADS, headers=HEADERS)
def test_the_route_says_exactly_what_a_publish_owes(
    make_subscriber, db_queue, subscriptions, event, payload, headers
):
    try:
        with transaction.atomic():
            subs = []
            for n, (sub_event, flt) in enumerate(subscriptions):
                subscriber = make_subscriber(f"s{n}", publish=("db",), subscribe=("db",))
                sub, _ = subscribing.subscribe(subscriber, db_queue, sub_event)
                subscribing.set_filter(sub, filters.check_filter(flt))
                subs.append(sub.pk)
            outgoing = publishing.prepare(event, payload, headers=headers)
            routed = {s["id"]: s["matches"] for s in routing.route(db_queue, outgoing)}
            [(answer, _)] = publishing.publish(db_queue, [outgoing])
            owed = set(
                Delivery.objects.filter(message_id=answer["id"]).values_list("subscription_id", flat=True)
            )
            assert routed == {pk: pk in owed for pk in subs}
            assert answer["deliveries"] == sum(routed.values())
            raise RolledBack
    except RolledBack:
        pass
