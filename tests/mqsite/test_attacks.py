"""Attacks, item by item of the OWASP API Security Top 10 (2023); each test names its item.
The second security review's findings (S1-S12) are attacked in tests of their topics, against
real servers; SECOND_REVIEW at the end is their matrix, finding by finding.

The personas (tests/conftest.py): the logger, who owns the objects under attack; a peer, a
subscriber of the same queue who must never see or touch them; an outsider, who may use no
queue; and an operator.
"""

import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from asgiref.testing import ApplicationCommunicator
from channels.testing import WebsocketCommunicator
from django.apps import apps
from django.db import models
from django.test import override_settings
from django.urls import reverse
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from delivery import ledger, publishing, subscribing, webhooks
from delivery.consumers import DeliveryConsumer
from delivery.models import Delivery, Status
from mqsite import urls as mqsite_urls
from mqsite.asgi import application, django_http
from queues.models import Message
from subscribers.models import Subscription
from subscribers.provisioning import create_subscriber
from tests.conftest import client_for
from tests.support.fields import DELIVERY_FIELDS
from tests.support.servers import ROOT, start_daphne
from tests.support.ssrf_urls import PRIVATE_NAMES, UNSAFE_URLS

# --- the objects under attack -----------------------------------------------------------------


class World:
    """The logger's and the peer's subscriptions to db, each with deliveries: some waiting, some
    leased to their owner (in flight)."""

    def __init__(self, logger, peer, outsider, queue):
        self.logger, self.peer, self.outsider, self.queue = logger, peer, outsider, queue
        self.subscription = subscribing.subscribe(logger, queue)[0]
        self.peer_subscription = subscribing.subscribe(peer, queue)[0]
        publishing.publish(queue, [publishing.prepare("create", {"n": i}) for i in range(4)])
        ledger.lease_deliveries(logger, limit=2)  # two in flight, two waiting
        self.deliveries = list(Delivery.objects.filter(subscriber=logger).values_list("id", flat=True))

    def statuses(self):
        # the deadline too: an extension by another must not move it
        return sorted(
            Delivery.objects.filter(subscriber=self.logger).values_list(
                "id", "status", "attempt", "ack_deadline"
            )
        )


@pytest.fixture
def personas(logger, peer, outsider, db_queue):
    return World(logger, peer, outsider, db_queue)


def api_routes():
    """(url name, method) of every route under /api/, from the URLconf itself."""
    found = []
    for pattern in mqsite_urls.api:
        view = getattr(pattern.callback, "view_class", None)
        for method in ("get", "post", "put", "patch", "delete"):
            if view is not None and hasattr(view, method):
                found.append((pattern.name, method))
    return found


PUBLIC = {("schema", "get"), ("docs", "get")}
EXAMPLE_ARGS = {
    "messages": {"queue": "db"},
    "event-catalog": {"queue": "db"},
    "route": {"queue": "db"},
    "subscription-detail": {"pk": 1},
    "subscription-seek": {"pk": 1},
    "subscription-pause": {"pk": 1},
    "subscription-resume": {"pk": 1},
    "delivery-nack": {"pk": 1},
    "message-detail": {"id": 1},
}


def url_of(name, **kwargs):
    return reverse(name, kwargs=kwargs or EXAMPLE_ARGS.get(name))


# --- API1:2023 Broken Object Level Authorization ----------------------------------------------


def peer_lists_subscriptions(w):
    ids = [s["id"] for s in client_for(w.peer).get(url_of("subscription-list")).json()["subscriptions"]]
    assert ids == [w.peer_subscription.pk]


def peer_deletes_the_loggers_subscription(w):
    r = client_for(w.peer).delete(url_of("subscription-detail", pk=w.subscription.pk))
    assert r.status_code == 404
    assert Subscription.objects.filter(pk=w.subscription.pk).exists()


def peer_changes_the_filter_of_the_loggers_subscription(w):
    r = client_for(w.peer).patch(
        url_of("subscription-detail", pk=w.subscription.pk), {"filter": {"payload.n": [1]}}, format="json"
    )
    assert r.status_code == 404
    assert Subscription.objects.get(pk=w.subscription.pk).filter is None


def peer_seeks_the_loggers_subscription(w):
    r = client_for(w.peer).post(url_of("subscription-seek", pk=w.subscription.pk), {"seq": 1}, format="json")
    assert r.status_code == 404


def peer_pauses_or_resumes_the_loggers_subscription(action):
    def attack(w):
        r = client_for(w.peer).post(url_of(f"subscription-{action}", pk=w.subscription.pk))
        assert r.status_code == 404
        assert Subscription.objects.get(pk=w.subscription.pk).paused is False

    return attack


def peer_subscribes(w):
    # The peer's own subscription comes back; the logger's is not touched or shown.
    r = client_for(w.peer).post(url_of("subscription-list"), {"queue": "db"}, format="json")
    assert r.status_code == 200 and r.json()["id"] == w.peer_subscription.pk


def peer_pulls(w):
    got = client_for(w.peer).get(url_of("delivery-list") + "?limit=1000").json()["deliveries"]
    assert got and not {d["id"] for d in got} & set(w.deliveries)


def peer_acks_the_loggers_deliveries(w):
    r = client_for(w.peer).post(url_of("delivery-ack"), {"ids": w.deliveries}, format="json")
    assert r.status_code == 200 and r.json() == {"acked": 0, "unknown": w.deliveries}


def peer_extends_the_loggers_deliveries(w):
    r = client_for(w.peer).post(
        url_of("delivery-extend"), {"ids": w.deliveries, "seconds": 3600}, format="json"
    )
    assert r.status_code == 200 and r.json() == {"extended": 0, "unknown": w.deliveries}


def peer_nacks_the_loggers_delivery(w):
    for delivery_id in w.deliveries:
        r = client_for(w.peer).post(url_of("delivery-nack", pk=delivery_id), {}, format="json")
        assert r.status_code == 404


def outsider_lists_queues(w):
    assert client_for(w.outsider).get(url_of("queue-list")).json() == {"queues": []}


def outsider_publishes(w):
    r = client_for(w.outsider).post(
        url_of("messages", queue="db"), {"event": "x", "payload": 1}, format="json"
    )
    assert r.status_code == 403 and Message.objects.count() == 4


def peer_reads_the_loggers_receipt(w):
    # A message the logger published: its receipt is the logger's alone (to others, a 404).
    mine = Message.objects.order_by("id").first().pk
    Message.objects.filter(pk=mine).update(publisher=w.logger)
    assert client_for(w.logger).get(url_of("message-detail", id=mine)).status_code == 200
    for caller in (w.peer, w.outsider):
        assert client_for(caller).get(url_of("message-detail", id=mine)).status_code == 404


def peer_lists_connections(w):
    assert client_for(w.peer).get(url_of("connection-list")).status_code == 403


def peer_reads_the_analytics(w):
    # Operators' figures over every subscriber: a subscriber's token is refused.
    assert client_for(w.peer).get(url_of("analytics")).status_code == 403
    assert client_for(w.peer).get(url_of("analytics") + "?trends=hour").status_code == 403


def outsider_reads_the_event_catalog(w):
    # A queue it may neither publish nor subscribe to: as if there were none (its events and
    # their schemas are the publishers' and subscribers' business).
    r = client_for(w.outsider).get(url_of("event-catalog", queue="db"))
    assert r.status_code == 404 and "events" not in r.json()
    assert client_for(w.peer).get(url_of("event-catalog", queue="db")).status_code == 200


def peer_and_outsider_ask_who_would_receive(w):
    # The peer learns of its own subscription only; the outsider, of no queue at all.
    body = {"event": "create", "payload": {"n": 1}}
    r = client_for(w.peer).post(url_of("route"), body, format="json")
    assert r.status_code == 200
    assert [s["id"] for s in r.json()["subscriptions"]] == [w.peer_subscription.pk]
    r = client_for(w.outsider).post(url_of("route"), body, format="json")
    assert r.status_code == 404 and "subscriptions" not in r.json()
    assert Message.objects.count() == 4  # nothing published


ROUTE_ATTACKS = {
    ("subscription-list", "get"): peer_lists_subscriptions,
    ("subscription-list", "post"): peer_subscribes,
    ("subscription-detail", "delete"): peer_deletes_the_loggers_subscription,
    ("subscription-detail", "patch"): peer_changes_the_filter_of_the_loggers_subscription,
    ("subscription-seek", "post"): peer_seeks_the_loggers_subscription,
    ("subscription-pause", "post"): peer_pauses_or_resumes_the_loggers_subscription("pause"),
    ("subscription-resume", "post"): peer_pauses_or_resumes_the_loggers_subscription("resume"),
    ("delivery-list", "get"): peer_pulls,
    ("delivery-ack", "post"): peer_acks_the_loggers_deliveries,
    ("delivery-extend", "post"): peer_extends_the_loggers_deliveries,
    ("delivery-nack", "post"): peer_nacks_the_loggers_delivery,
    ("queue-list", "get"): outsider_lists_queues,
    ("messages", "post"): outsider_publishes,
    ("connection-list", "get"): peer_lists_connections,
    ("message-detail", "get"): peer_reads_the_loggers_receipt,
    ("analytics", "get"): peer_reads_the_analytics,
    ("event-catalog", "get"): outsider_reads_the_event_catalog,
    ("route", "post"): peer_and_outsider_ask_who_would_receive,
}


def test_api1_the_matrix_covers_every_route():
    """API1:2023 Broken Object Level Authorization: every route of the API is attacked below."""
    assert set(api_routes()) - PUBLIC == set(ROUTE_ATTACKS)


@pytest.mark.parametrize("route", sorted(ROUTE_ATTACKS), ids="-".join)
def test_api1_a_subscriber_never_reaches_anothers_objects_over_rest(personas, route):
    """API1:2023 Broken Object Level Authorization: another's subscription or delivery is a
    404 (or unknown), lists hold only the caller's rows, and nothing of the owner's moves."""
    before = personas.statuses()
    ROUTE_ATTACKS[route](personas)
    assert personas.statuses() == before
    assert Subscription.objects.filter(pk=personas.subscription.pk, subscriber=personas.logger).exists()


async def frame_attack(token, frames):
    """Send each frame and read up to its answer (deliveries pushed meanwhile are kept too)."""
    comm = WebsocketCommunicator(application, f"/ws/?token={token}")
    connected, _ = await comm.connect(timeout=5)
    assert connected
    answers = []
    for frame in frames:
        await comm.send_to(text_data=json.dumps(frame))
        while True:
            answers.append(json.loads(await comm.receive_from(timeout=3)))
            if answers[-1]["type"] != "message":
                break
    await comm.disconnect()
    return answers


FRAME_ATTACKS = {
    # frame type: (who sends it, what it carries, what it must answer)
    "ack": ("peer", lambda w: {"type": "ack", "ids": w.deliveries}, "unknown_ids"),
    "nack": ("peer", lambda w: {"type": "nack", "ids": w.deliveries}, "unknown_ids"),
    "extend": ("peer", lambda w: {"type": "extend", "ids": w.deliveries, "seconds": 3600}, "unknown_ids"),
    "subscribe": ("outsider", lambda w: {"type": "subscribe", "queue": "db"}, "forbidden"),
    "publish": (
        "outsider",
        lambda w: {"type": "publish", "queue": "db", "event": "x", "payload": 1},
        "forbidden",
    ),
    "unsubscribe": ("outsider", lambda w: {"type": "unsubscribe", "queue": "db"}, "not_subscribed"),
    "ping": ("peer", lambda w: {"type": "ping"}, "pong"),
    # Authenticated already: another's token does not make the socket theirs.
    "auth": ("peer", lambda w: {"type": "auth", "token": w.logger.token}, "bad_frame"),
}


def test_api1_the_frame_matrix_covers_every_frame():
    """API1:2023 Broken Object Level Authorization: every client frame is attacked below."""
    assert set(DeliveryConsumer.handlers) == set(FRAME_ATTACKS)


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("frame_type", sorted(FRAME_ATTACKS))
async def test_api1_a_subscriber_never_reaches_anothers_objects_over_the_websocket(
    logger, peer, outsider, db_queue, frame_type
):
    """API1:2023 Broken Object Level Authorization: frames naming another's deliveries, or a
    queue the sender may not use, are refused and move nothing; the sender's socket carries
    only its own deliveries."""
    from channels.db import database_sync_to_async

    w = await database_sync_to_async(World)(logger, peer, outsider, db_queue)
    before = await database_sync_to_async(w.statuses)()
    sender, frame, expected = FRAME_ATTACKS[frame_type]
    token = {"peer": peer.token, "outsider": outsider.token}[sender]
    answers = await frame_attack(token, [frame(w)])
    # the peer's socket may first be handed its own deliveries: none is the logger's
    pushed = [a for a in answers if a["type"] == "message"]
    assert not {a["id"] for a in pushed} & set(w.deliveries)
    last = answers[-1]
    assert last.get("code", last["type"]) == expected, answers
    assert await database_sync_to_async(w.statuses)() == before
    assert await database_sync_to_async(Message.objects.count)() == 4


# --- API2:2023 Broken Authentication ------------------------------------------------------------
# Also: a revoked token, subscriber or right reaches open sockets in every process within 2 s
# (tests/subscribers/test_revocation.py, tests/e2e/test_revocation.py), REST at once, and failed token
# attempts are throttled per address (tests/subscribers/test_revocation_rest.py; API4 too).


@pytest.mark.parametrize("route", sorted(set(api_routes()) - PUBLIC), ids="-".join)
@pytest.mark.parametrize("authorization", [None, "Bearer mq_not-a-real-token", "Bearer", "Basic b3A6b3A="])
def test_api2_every_non_public_route_refuses_a_caller_without_a_valid_token(personas, route, authorization):
    """API2:2023 Broken Authentication: no token, a bad one, or another scheme: 401, with the
    scheme to use, and nothing of the caller's doing happens."""
    name, method = route
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization else {}
    before = (Message.objects.count(), Subscription.objects.count(), personas.statuses())
    r = getattr(client_for(), method)(url_of(name), {}, format="json", **headers)
    assert r.status_code == 401, r.content
    assert r.json()["code"] == "unauthenticated"
    assert r["WWW-Authenticate"].startswith("Bearer")
    assert (Message.objects.count(), Subscription.objects.count(), personas.statuses()) == before


def test_api2_an_inactive_subscribers_token_is_refused(personas):
    """API2:2023 Broken Authentication: a deactivated subscriber's token stops working."""
    personas.logger.is_active = False
    personas.logger.save()
    assert client_for(personas.logger).get(url_of("delivery-list")).status_code == 401


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "query, header",
    [("?token=mq_not-a-real-token", None), ("", b"Bearer mq_not-a-real-token")],
    ids=["query", "header"],
)
async def test_api2_a_websocket_with_a_bad_token_is_closed_with_4401(query, header):
    """API2:2023 Broken Authentication: the handshake is accepted and the socket closed at once."""
    headers = [(b"authorization", header)] if header else []
    comm = WebsocketCommunicator(application, f"/ws/{query}", headers=headers)
    connected, _ = await comm.connect(timeout=5)
    assert connected
    assert await comm.receive_output(timeout=3) == {"type": "websocket.close", "code": 4401}


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("query", ["", "?token="])
async def test_api2_a_websocket_without_a_token_serves_nothing_until_a_valid_auth_frame(
    query, logger, db_queue, monkeypatch
):
    """API2:2023 Broken Authentication: with no token (API.md, Extensions: authentication after
    open), every frame but `auth` is refused `unauthenticated`, a bad `auth` closes it with
    4401, and one that never authenticates is closed with 4401 too."""
    from delivery import consumers

    comm = WebsocketCommunicator(application, f"/ws/{query}")
    connected, _ = await comm.connect(timeout=5)
    assert connected
    for frame in ({"type": "subscribe", "queue": "db"}, {"type": "ack", "ids": [1]}, {"type": "ping"}):
        await comm.send_to(text_data=json.dumps(frame))
        assert json.loads(await comm.receive_from(timeout=3))["code"] == "unauthenticated"
    await comm.send_to(text_data=json.dumps({"type": "auth", "token": "mq_not-a-real-token"}))
    assert await comm.receive_output(timeout=3) == {"type": "websocket.close", "code": 4401}
    monkeypatch.setattr(consumers, "AUTH_WAIT_SECS", 0.2)
    silent = WebsocketCommunicator(application, f"/ws/{query}")
    assert (await silent.connect(timeout=5))[0]
    assert await silent.receive_output(timeout=3) == {"type": "websocket.close", "code": 4401}


def text_fields():
    for model in apps.get_models():
        for field in model._meta.get_fields():
            if isinstance(field, models.CharField | models.TextField) and field.concrete:
                yield model, field.name


def test_api2_tokens_are_kept_hashed_never_in_plaintext(db, make_subscriber):
    """API2:2023 Broken Authentication: after a subscriber is made (by the service or the
    command), no column of any table holds its token; only its SHA-256."""
    from django.core.management import call_command

    tokens = [make_subscriber("by-service").token]
    out = io.StringIO()
    call_command("createsubscriber", "by-command", stdout=out)
    tokens.append(out.getvalue().strip().splitlines()[-1])
    for token in tokens:
        assert token.startswith("mq_") and len(token) > 40
        for model, name in text_fields():
            assert not model._default_manager.filter(**{f"{name}__contains": token}).exists(), (model, name)
    from subscribers.models import Subscriber

    for name, token in zip(("by-service", "by-command"), tokens, strict=True):
        assert Subscriber.objects.get(name=name).token_hash == hashlib.sha256(token.encode()).hexdigest()


def test_api2_tokens_are_compared_in_constant_time(personas, monkeypatch):
    """API2:2023 Broken Authentication: the token is looked up by its hash and then compared
    with hmac.compare_digest, so timing says nothing about how much of a guess was right."""
    from subscribers import tokens

    compared = []
    real = tokens.hmac.compare_digest
    monkeypatch.setattr(tokens.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert client_for(personas.logger).get(url_of("subscription-list")).status_code == 200
    digest = hashlib.sha256(personas.logger.token.encode()).hexdigest()
    assert compared == [(digest, digest)]


# --- API3:2023 Broken Object Property Level Authorization -------------------------------------

FORGED = {"id": 999, "seq": 999, "status": "acked", "attempt": 99, "subscriber": 1, "publisher": 1}


def test_api3_a_publish_cannot_set_seq_status_attempt_or_subscriber(personas):
    """API3:2023 Broken Object Property Level Authorization: mass assignment has no effect."""
    forged = {**FORGED, "subscriber": personas.peer.pk, "publisher": personas.peer.pk}
    r = client_for(personas.logger).post(
        url_of("messages", queue="db"), {"event": "create", "payload": 1, **forged}, format="json"
    )
    assert r.status_code == 201
    message = Message.objects.get(pk=r.json()["id"])
    assert message.pk != 999 and message.seq == 5 and message.publisher == personas.logger
    fanned = Delivery.objects.filter(message=message)
    assert {(d.status, d.attempt) for d in fanned} == {(Status.PENDING, 0)}
    assert {d.subscriber_id for d in fanned} == {
        personas.logger.pk,
        personas.peer.pk,
    }  # its subscribers, no more
    batch = {"messages": [{"event": "create", "payload": 2, **forged}], **forged}
    r = client_for(personas.logger).post(url_of("messages", queue="db"), batch, format="json")
    assert r.status_code == 201 and r.json()["messages"][0]["seq"] == 6


def test_api3_a_subscription_cannot_be_made_for_someone_else(personas):
    """API3:2023 Broken Object Property Level Authorization: the subscriber is the caller."""
    forged = {**FORGED, "subscriber": personas.peer.pk, "id": personas.peer_subscription.pk}
    r = client_for(personas.logger).post(
        url_of("subscription-list"), {"queue": "db", "event": "other", **forged}, format="json"
    )
    assert r.status_code == 201
    made = Subscription.objects.get(pk=r.json()["id"])
    assert made.subscriber == personas.logger and made.pk != personas.peer_subscription.pk
    assert list(personas.peer.subscriptions.all()) == [personas.peer_subscription]


def test_api3_ack_and_nack_cannot_set_status_or_attempt(personas):
    """API3:2023 Broken Object Property Level Authorization: only the verb moves a delivery."""
    inflight = Delivery.objects.filter(subscriber=personas.logger, status=Status.INFLIGHT).first()
    r = client_for(personas.logger).post(
        url_of("delivery-nack", pk=inflight.pk), {"retry_in": 60, **FORGED}, format="json"
    )
    assert r.status_code == 200
    inflight.refresh_from_db()
    assert (
        inflight.status == Status.PENDING and inflight.attempt == 1 and inflight.subscriber == personas.logger
    )
    pending = Delivery.objects.filter(subscriber=personas.logger).exclude(pk=inflight.pk).first()
    r = client_for(personas.logger).post(
        url_of("delivery-ack"), {"ids": [pending.pk], **FORGED}, format="json"
    )
    pending.refresh_from_db()
    assert r.json()["acked"] == 1 and pending.status == Status.ACKED and pending.subscriber == personas.logger


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_api3_frames_cannot_set_seq_status_attempt_or_subscriber(logger, peer, outsider, db_queue):
    """API3:2023 Broken Object Property Level Authorization, over the websocket."""
    from channels.db import database_sync_to_async

    w = await database_sync_to_async(World)(logger, peer, outsider, db_queue)
    forged = {**FORGED, "subscriber": peer.pk}
    answers = await frame_attack(
        logger.token,
        [
            {"type": "publish", "queue": "db", "event": "create", "payload": 1, "ref": "r", **forged},
            {"type": "subscribe", "queue": "db", "event": "other", **forged},
        ],
    )
    published = next(a for a in answers if a["type"] == "published")
    subscribed = next(a for a in answers if a["type"] == "subscribed")
    assert published["seq"] == 5 and published["id"] != 999

    def check():
        message = Message.objects.get(pk=published["id"])
        assert message.publisher_id == logger.pk
        assert Subscription.objects.get(pk=subscribed["subscription"]).subscriber_id == logger.pk
        assert set(Delivery.objects.filter(message=message).values_list("attempt", flat=True)) <= {0, 1}

    await database_sync_to_async(check)()
    assert w.deliveries


def test_api3_answers_carry_no_other_subscribers_properties(personas):
    """API3:2023 Broken Object Property Level Authorization: a delivery shows the contract's
    fields, never its subscriber, lease holder or errors; a queue never its subscribers."""
    delivery = client_for(personas.peer).get(url_of("delivery-list")).json()["deliveries"][0]
    assert set(delivery) == DELIVERY_FIELDS
    body = client_for(personas.peer).get(url_of("queue-list")).content.decode()
    for secret in (personas.logger.name, personas.logger.token_hash, personas.logger.webhook_secret):
        assert secret not in body


# --- API4:2023 Unrestricted Resource Consumption ----------------------------------------------


@override_settings(MQ_MAX_BODY_BYTES=1000)
def test_api4_a_body_over_the_limit_is_refused_before_it_is_parsed(personas):
    """API4:2023 Unrestricted Resource Consumption: a 413, not a 400, for a body that is not
    even JSON: it was refused before being read and parsed."""
    client = client_for(personas.logger)
    url = url_of("messages", queue="db")
    r = client.generic("POST", url, b"{" * 5000, content_type="application/json")
    assert r.status_code == 413
    # a Content-Length that says more than the limit is refused on its word
    r = client.generic("POST", url, b"{}", content_type="application/json", CONTENT_LENGTH="10000000")
    assert r.status_code == 413
    for name in ("delivery-ack", "subscription-list"):
        assert (
            client.generic("POST", url_of(name), b"[" * 5000, content_type="application/json").status_code
            == 413
        )


def test_api4_json_nested_too_deep_is_refused(personas):
    """API4:2023 Unrestricted Resource Consumption: nesting past MQ_MAX_JSON_DEPTH is a 400."""
    client = client_for(personas.logger)

    def nested(depth):
        return {"event": "create", "payload": json.loads("[" * (depth - 1) + "]" * (depth - 1))}

    assert client.post(url_of("messages", queue="db"), nested(64), format="json").status_code == 201
    r = client.post(url_of("messages", queue="db"), nested(65), format="json")
    assert r.status_code == 400 and "deeper" in r.json()["detail"]
    deep = b'{"ids": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert (
        client.generic("POST", url_of("delivery-ack"), deep, content_type="application/json").status_code
        == 400
    )


@pytest.mark.parametrize(
    "name, query, body",
    [
        ("delivery-list", "?limit=1001", None),
        ("delivery-list", "?wait=31", None),
        ("delivery-ack", "", {"ids": list(range(1, 10002))}),
        ("messages", "", {"messages": [{"event": "e", "payload": 1}] * 1001}),
    ],
)
def test_api4_every_size_a_client_chooses_is_capped(personas, name, query, body):
    """API4:2023 Unrestricted Resource Consumption: limit, wait, ids and batch sizes have caps."""
    client = client_for(personas.logger)
    url = url_of(name) + query
    r = client.get(url) if body is None else client.post(url, body, format="json")
    assert r.status_code == 400


@override_settings(MQ_THROTTLE_RATE="5/min")
def test_api4_a_subscriber_over_its_rate_is_throttled_on_every_route(personas):
    """API4:2023 Unrestricted Resource Consumption: the rate counts every call of the caller."""
    from django.core.cache import cache

    cache.clear()
    client = client_for(personas.peer)
    codes = [client.get(url_of("subscription-list")).status_code for _ in range(3)]
    codes += [client.post(url_of("delivery-ack"), {"ids": [1]}, format="json").status_code for _ in range(3)]
    cache.clear()
    assert codes == [200, 200, 200, 200, 200, 429]


@override_settings(MQ_MAX_LONG_POLLS=1)
def test_api4_a_subscriber_cannot_hold_more_than_its_long_polls(personas):
    """API4:2023 Unrestricted Resource Consumption: each waiting long poll holds a server thread,
    so past MQ_MAX_LONG_POLLS waiting (one here, already held) the next that would wait is a
    429; a plain pull is still served, and another subscriber's polls count apart. A poll with
    deliveries ready never waits, so it is answered even then."""
    from delivery import long_polls

    Delivery.objects.filter(subscriber=personas.peer).delete()  # caught up: its polls would wait
    with long_polls.slot(personas.peer.pk, 5):
        refused = client_for(personas.peer).get(url_of("delivery-list") + "?wait=1")
        assert refused.status_code == 429 and refused["Retry-After"] == "1"
        assert client_for(personas.peer).get(url_of("delivery-list")).status_code == 200
    with long_polls.slot(personas.logger.pk, 5):
        answered = client_for(personas.logger).get(url_of("delivery-list") + "?wait=1")
        assert answered.status_code == 200 and answered.json()["deliveries"]
    assert client_for(personas.peer).get(url_of("delivery-list") + "?wait=0.1").status_code == 200


@pytest.mark.django_db(transaction=True)
def test_api4_an_oversized_websocket_frame_closes_the_socket_on_the_real_server(logger):
    """API4:2023 Unrestricted Resource Consumption: Daphne itself, not a test double: the
    socket is closed with 4413 (the standard 1009 is one Daphne refuses to send)."""
    web = start_daphne({"MQ_MAX_BODY_BYTES": "1000"})
    try:
        with connect(f"{web.ws}?token={logger.token}") as ws:
            ws.send("x" * 5000)
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=5)
        assert closed.value.rcvd.code == 4413
    finally:
        web.stop()


def test_api4_a_nack_of_many_ids_costs_as_many_statements_as_one(personas):
    """API4:2023 Unrestricted Resource Consumption: a nack of 10,000 ids was 10,000
    transactions; it is one UPDATE now (tests/mqsite/test_limits.py times it against real Daphne)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as one:
        ledger.nack_deliveries(personas.logger, personas.deliveries[:1])
    with CaptureQueriesContext(connection) as many:
        ledger.nack_deliveries(personas.logger, [*personas.deliveries, *range(10**6, 10**6 + 9990)])
    assert len(many.captured_queries) == len(one.captured_queries) + 1  # + which ids were unknown


@override_settings(MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER=2, MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER=2)
def test_api4_a_subscriber_cannot_pile_up_subscriptions_or_event_names(personas):
    """API4:2023 Unrestricted Resource Consumption: each subscription is fanned out to and each
    event name is a row and a metrics label forever: both are capped per subscriber (and
    sockets, and frames a second: tests/mqsite/test_limits.py, against real Daphne)."""
    client = client_for(personas.logger)  # holds one subscription already
    assert (
        client.post(url_of("subscription-list"), {"queue": "db", "event": "a"}, format="json").status_code
        == 201
    )
    assert (
        client.post(url_of("subscription-list"), {"queue": "db", "event": "b"}, format="json").status_code
        == 409
    )
    url = url_of("messages", queue="db")
    assert client.post(url, {"event": "b", "payload": 1}, format="json").status_code == 201
    r = client.post(url, {"event": "c", "payload": 1}, format="json")
    assert r.status_code == 429 and r["Retry-After"]
    assert not Message.objects.filter(event__name="c").exists()


def read_answer(sock, timeout):
    """What the server sends until it closes or `timeout` passes (seconds)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def json_of(answer):
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


@pytest.mark.django_db(transaction=True)
def test_api4_a_declared_body_over_the_limit_is_refused_before_it_is_sent(personas):
    """API4:2023 Unrestricted Resource Consumption: Daphne reads a whole body before it calls
    the application. A Content-Length over the route's limit (MQ_MAX_BODY_BYTES for a publish,
    MQ_MAX_SMALL_BODY_BYTES, 1 MiB, for the rest) is answered 413 as the headers end: the client
    sends no body at all, no token (so it is not authentication first, nor the database)."""
    web = start_daphne()
    try:
        for path, size in [
            ("/api/queues/db/messages", 100 * 1024 * 1024),
            ("/api/deliveries/ack", 2 * 1024 * 1024),
            ("/api/subscriptions", 2 * 1024 * 1024),
            ("/admin/login/", 2 * 1024 * 1024),
        ]:
            with socket.create_connection(("127.0.0.1", web.port)) as sock:
                started = time.monotonic()
                sock.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {size}\r\n\r\n".encode()
                )
                answer = read_answer(sock, 5)
                elapsed = time.monotonic() - started
            assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
            assert elapsed < 1, (path, elapsed)
            assert f"{size} bytes" in json_of(answer)["detail"]
        # a publish of 2 MiB (over the small limit) is taken, and one of 3 MB, past Django's
        # in-memory 2.5 MiB, is spooled to disk on its way, as before
        for payload in ("x" * 2000, "x" * 3000):
            batch = {"messages": [{"event": "create", "payload": payload} for _ in range(1000)]}
            r = httpx.post(
                f"{web.http}/api/queues/db/messages",
                json=batch,
                headers={"Authorization": f"Bearer {personas.logger.token}"},
                timeout=30,
            )
            assert r.status_code == 201 and len(r.json()["messages"]) == 1000
        r = httpx.post(
            f"{web.http}/api/deliveries/ack",
            json={"ids": list(range(1, 10001))},
            headers={"Authorization": f"Bearer {personas.logger.token}"},
            timeout=30,
        )
        assert r.status_code == 200  # 10,000 ids fit in the small limit
    finally:
        web.stop()


@pytest.mark.django_db(transaction=True)
def test_api4_a_chunked_body_is_refused_as_it_passes_the_limit(personas):
    """API4:2023 Unrestricted Resource Consumption: a chunked body (no length to check) is
    counted as it arrives: the 413 comes once it passes 1 MiB, while the client still sends."""
    web = start_daphne()
    try:
        with socket.create_connection(("127.0.0.1", web.port)) as sock:
            sock.sendall(
                b"POST /api/deliveries/ack HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"[" * 65536
            sent, answered_at, answer = 0, [], []

            def read():
                answer.append(read_answer(sock, 10))

            reader = threading.Thread(target=read)
            reader.start()
            # a body without end, paced so that the socket buffers stay near empty: what was
            # sent when the answer came is what the server had read
            try:
                while reader.is_alive() and sent < 64 * 1024 * 1024:
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent += len(chunk)
                    time.sleep(0.005)
            except OSError:  # the server closed after its answer
                pass
            answered_at.append(sent)
            reader.join()
            answer = answer[0]
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert "1048576 bytes" in json_of(answer)["detail"]
        assert answered_at[0] < 4 * 1024 * 1024  # it did not wait for the end (there is none)
        # the server is fine afterwards
        assert httpx.get(f"{web.http}/healthz", timeout=5).status_code == 200
    finally:
        web.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("declared", [True, False])
async def test_api4_the_asgi_handler_applies_the_limits_under_any_server(declared):
    """API4:2023 Unrestricted Resource Consumption: the same rule in the ASGI handler, for a
    server that streams the body to the application: a declared length over the limit is
    answered before any body is sent; an undeclared one as soon as it passes the limit."""
    headers = [(b"content-type", b"application/json")]
    if declared:
        headers.append((b"content-length", b"2000000"))
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": "/api/deliveries/ack",
        "raw_path": b"/api/deliveries/ack",
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": headers,
        "client": ["127.0.0.1", 5000],
        "server": ["127.0.0.1", 8000],
    }
    comm = ApplicationCommunicator(django_http, scope)
    if not declared:
        for _ in range(17):  # 17 x 64 KiB: past 1 MiB with the last chunk
            await comm.send_input({"type": "http.request", "body": b"[" * 65536, "more_body": True})
    start = await comm.receive_output(timeout=5)
    body = await comm.receive_output(timeout=5)
    assert start["status"] == 413
    assert "1048576 bytes" in json.loads(body["body"])["detail"]
    await comm.wait(timeout=5)


@pytest.mark.django_db(transaction=True)
def test_api4_an_ack_of_a_million_empty_arrays_is_refused_cheaply(personas):
    """API4:2023 Unrestricted Resource Consumption: 1 MiB of `{"ids": [[],[],...]}` (350,000
    arrays) cost 7 s, 500 MB and a 12 MB answer of one error per item; now its brackets are
    counted before it is decoded (a route other than publish takes at most 4096)."""
    web = start_daphne()
    try:
        n = (1024 * 1024 - 20) // 3
        body = b'{"ids": [' + b",".join([b"[]"] * n) + b"]}"

        def peak_mb():
            with open(f"/proc/{web.proc.pid}/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

        before = peak_mb()
        started = time.monotonic()
        r = httpx.post(
            f"{web.http}/api/deliveries/ack",
            content=body,
            headers={"Authorization": f"Bearer {personas.logger.token}", "Content-Type": "application/json"},
            timeout=30,
        )
        elapsed = time.monotonic() - started
        grew = peak_mb() - before
        assert r.status_code == 400 and len(r.content) < 500, r.content[:300]
        assert "4096 arrays and objects" in r.json()["detail"]
        assert elapsed < 1 and grew < 20, (elapsed, grew)
    finally:
        web.stop()


def test_api4_a_list_over_its_length_is_one_error_not_one_per_item(personas):
    """API4:2023 Unrestricted Resource Consumption: a list's length is checked before its items
    (DRF's ListField validated every item first, and answered an error for each)."""
    client = client_for(personas.logger)
    r = client.post(url_of("messages", queue="db"), {"messages": [1] * 1001}, format="json")
    assert r.status_code == 400 and r.json() == {
        "detail": "messages: Ensure this field has no more than 1000 elements.",
        "code": "bad_request",
        "messages": ["Ensure this field has no more than 1000 elements."],
    }
    r = client.post(url_of("delivery-ack"), {"ids": ["1"] * 10001}, format="json")
    assert r.status_code == 400 and r.json() == {
        "detail": "ids: Ensure this field has no more than 10000 elements.",
        "code": "bad_request",
        "ids": ["Ensure this field has no more than 10000 elements."],
    }


# --- API5:2023 Broken Function Level Authorization --------------------------------------------


def test_api5_operator_only_routes_refuse_a_subscriber_token(personas):
    """API5:2023 Broken Function Level Authorization: a subscriber's token opens no operator
    route: the API answers 403, the admin and the dashboard send it to the login page."""
    client = client_for(personas.logger)
    assert client.get(url_of("connection-list")).status_code == 403
    for name, method in [
        ("admin:index", "get"),
        ("admin:delivery_delivery_changelist", "get"),
        ("dashboard", "get"),
        ("mq-head-of-line", "get"),
        ("mq-publish", "post"),
    ]:
        r = getattr(client, method)(reverse(name))
        assert r.status_code in (302, 403), (name, r.status_code)
        if r.status_code == 302:
            assert "/login/" in r["Location"]
    d = personas.deliveries[0]
    Delivery.objects.filter(pk=d).update(status=Status.DEAD)
    assert client.post(reverse("dashboard-redeliver", kwargs={"pk": d})).status_code in (302, 403)
    assert Delivery.objects.get(pk=d).status == Status.DEAD


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_api5_the_operators_dashboard_socket_refuses_a_subscriber(logger):
    """API5:2023 Broken Function Level Authorization: /ws/dashboard/ takes only a staff login."""
    comm = WebsocketCommunicator(application, f"/ws/dashboard/?token={logger.token}")
    connected, _ = await comm.connect(timeout=5)
    assert not connected


def test_api5_a_subscriber_may_not_publish_or_subscribe_beyond_its_rights(personas, make_queue):
    """API5:2023 Broken Function Level Authorization: rights are per queue and per verb."""
    make_queue("secret")
    client = client_for(personas.logger)
    assert (
        client.post(
            url_of("messages", queue="secret"), {"event": "e", "payload": 1}, format="json"
        ).status_code
        == 403
    )
    assert client.post(url_of("subscription-list"), {"queue": "secret"}, format="json").status_code == 403


# --- API6:2023 Unrestricted Access to Sensitive Business Flows ---------------------------------


def test_api6_a_replayed_publish_fans_out_once(personas):
    """API6:2023 Unrestricted Access to Sensitive Business Flows: a publish replayed with its
    idempotency key (a retry, or a replay by someone who captured it) delivers nothing new."""
    client = client_for(personas.logger)
    body = {"event": "create", "payload": {"order": 1}, "key": "order-1"}
    first = client.post(url_of("messages", queue="db"), body, format="json")
    deliveries = Delivery.objects.count()
    for _ in range(5):
        again = client.post(url_of("messages", queue="db"), body, format="json")
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert Delivery.objects.count() == deliveries


def test_api6_subscribing_again_does_not_replay_history(personas):
    """API6:2023 Unrestricted Access to Sensitive Business Flows: unsubscribe and subscribe
    again is no way to have messages delivered twice: a new subscription is owed only what is
    published after it."""
    client = client_for(personas.peer)
    client.post(
        url_of("delivery-ack"), {"ids": list(Delivery.objects.values_list("id", flat=True))}, format="json"
    )
    client.delete(url_of("subscription-detail", pk=personas.peer_subscription.pk))
    client.post(url_of("subscription-list"), {"queue": "db"}, format="json")
    assert client.get(url_of("delivery-list")).json()["deliveries"] == []


# --- API7:2023 Server Side Request Forgery ------------------------------------------------------


def test_api7_at_least_fifty_unsafe_webhook_urls_are_refused():
    """API7:2023 Server Side Request Forgery: the literal URLs of tests/support/ssrf_urls.py are refused
    by tests/delivery/test_webhooks.py::test_unsafe_webhook_urls_are_refused; the names, below."""
    assert len(set(UNSAFE_URLS)) + len(PRIVATE_NAMES) >= 50


@pytest.fixture
def stub_dns(monkeypatch):
    """Names resolve as tests/support/ssrf_urls.PRIVATE_NAMES says; addresses as they are."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host in PRIVATE_NAMES:
            return [
                (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in PRIVATE_NAMES[host]
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("name", sorted(PRIVATE_NAMES))
def test_api7_names_that_resolve_to_private_addresses_are_refused(stub_dns, settings, name):
    """API7:2023 Server Side Request Forgery: a DNS name is judged by every address it
    resolves to (one private answer among public ones is enough), at send time."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(webhooks.UnsafeURL, match="loopback, private or link-local"):
        webhooks.resolve_safe(f"https://{name}/hook")


def test_api7_a_private_webhook_url_is_refused_where_it_is_entered(db, settings, stub_dns):
    """API7:2023 Server Side Request Forgery: making a subscriber with one fails."""
    from django.core.exceptions import ValidationError

    settings.MQ_WEBHOOK_ALLOW_PRIVATE = False
    for i, url in enumerate(
        ("http://metadata.google.internal/", "http://[::127.0.0.1]/", "http://db.internal/")
    ):
        with pytest.raises(ValidationError, match="private"):
            create_subscriber(f"ssrf-{i}", webhook_url=url)


# --- API8:2023 Security Misconfiguration --------------------------------------------------------


def test_api8_the_deploy_check_is_clean_with_production_settings():
    """API8:2023 Security Misconfiguration: `manage.py check --deploy` finds nothing with
    SECRET_KEY set, DEBUG off and MQ_HTTPS on."""
    env = {
        **os.environ,
        "SECRET_KEY": "k" * 20 + "-production-secret-of-sufficient-length-and-variety-8f3b2a",
        "DEBUG": "false",
        "MQ_HTTPS": "true",
        "ALLOWED_HOSTS": "mq.example.com",
    }
    env.pop("DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout


def test_api8_the_defaults_serve_plain_http_for_make_run(settings):
    """API8:2023 Security Misconfiguration: the HTTPS settings are opt-in, so that the
    embedded mode on 127.0.0.1 works over http."""
    assert not settings.SECURE_SSL_REDIRECT and not settings.SESSION_COOKIE_SECURE and not settings.DEBUG


def test_api8_errors_say_what_is_wrong_without_a_traceback_and_with_safe_headers(personas):
    """API8:2023 Security Misconfiguration: JSON errors in words, hardened headers."""
    client = client_for(personas.logger)
    for r in (
        client.get("/api/nothing"),
        client.post(url_of("messages", queue="db"), b"{", content_type="application/json"),
        client.get(url_of("delivery-list") + "?limit=x"),
    ):
        assert r["Content-Type"] == "application/json" and r.status_code in (400, 404)
        assert "Traceback" not in r.content.decode() and r.json()
    ok = client.get(url_of("queue-list"))
    assert ok["X-Content-Type-Options"] == "nosniff" and ok["X-Frame-Options"] == "DENY"
    assert ok["Referrer-Policy"] == "same-origin"


def test_api8_metrics_are_private_by_default(personas, settings):
    """API8:2023 Security Misconfiguration: /metrics names every subscriber and its backlog; by
    default it answers neither an anonymous client nor a subscriber's token (401), only the
    scraper's MQ_METRICS_TOKEN or a staff login (tests/dashboard/test_metrics.py)."""
    settings.MQ_METRICS_TOKEN = "scraper-token"
    for client in (client_for(), client_for(personas.logger)):
        r = client.get("/metrics")
        assert r.status_code == 401 and personas.logger.name not in r.content.decode()
    assert client_for().get("/metrics", HTTP_AUTHORIZATION="Bearer scraper-token").status_code == 200


@pytest.mark.django_db(transaction=True)
def test_api8_a_cross_origin_websocket_handshake_is_refused_by_the_real_server(logger):
    """API8:2023 Security Misconfiguration: a page on another site cannot drive a browser's
    websocket (Origin outside ALLOWED_HOSTS: refused); a service sending no Origin is let in."""
    web = start_daphne()
    try:
        with pytest.raises(InvalidStatus) as refused:
            connect(f"{web.ws}?token={logger.token}", origin="http://evil.example")
        assert refused.value.response.status_code == 403
        with connect(f"{web.ws}?token={logger.token}", origin=f"http://localhost:{web.port}") as ws:
            ws.send(json.dumps({"type": "ping"}))
            assert json.loads(ws.recv(timeout=5))["type"] == "pong"
    finally:
        web.stop()


# --- API9:2023 Improper Inventory Management ---------------------------------------------------


def test_api9_the_schema_lists_every_api_route_and_no_other(db):
    """API9:2023 Improper Inventory Management: no undocumented route, no documented ghost."""
    schema = client_for().get("/api/schema/?format=json").json()
    documented = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    routes = {p.name: "/api/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(p.pattern)) for p in mqsite_urls.api}
    served = {(routes[name].replace("{pk}", "{id}"), method) for name, method in set(api_routes()) - PUBLIC}
    assert documented == served


# --- API10:2023 Unsafe Consumption of APIs ------------------------------------------------------


class EndlessAnswer(BaseHTTPRequestHandler):
    """A webhook endpoint that answers 500 and then never stops sending."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"A" * 65536)
                time.sleep(0.01)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_api10_a_webhook_answer_is_read_capped_and_time_limited(settings, monkeypatch):
    """API10:2023 Unsafe Consumption of APIs: what a subscriber's endpoint answers is not
    trusted: the worker reads at most MAX_RESPONSE_BYTES of it, for at most the timeout,
    keeps 200 characters of it, and follows no redirect (tests/delivery/test_webhooks.py)."""
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    settings.MQ_WEBHOOK_TIMEOUT_SECS = 2
    server = ThreadingHTTPServer(("127.0.0.1", 0), EndlessAnswer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        frame = {"id": 1, "type": "message", "payload": None}
        outcome = webhooks.post(
            f"http://127.0.0.1:{server.server_address[1]}/hook", "whsec_" + "A" * 32, frame
        )
        assert time.monotonic() - started < 5
        assert not outcome.ok and outcome.status == 500 and len(outcome.error) <= 220
    finally:
        server.shutdown()
        server.server_close()


def test_api4_a_body_under_the_limit_but_over_djangos_default_is_taken(personas):
    """API4:2023 Unrestricted Resource Consumption: the limit is MQ_MAX_BODY_BYTES (8 MiB), not
    Django's 2.5 MiB: a 3 MB batch is published (it was a 500)."""
    batch = {"messages": [{"event": "create", "payload": "x" * 3000} for _ in range(1000)]}
    r = client_for(personas.logger).post(url_of("messages", queue="db"), batch, format="json")
    assert r.status_code == 201 and len(r.json()["messages"]) == 1000


# --- The second review (issue 26): each finding, its OWASP item, and the tests that attack it ----
# against real server processes. The finding's number is the review's; the matrix is checked
# below, so that a test renamed or moved takes its line here with it.

SECOND_REVIEW = {
    "S1 API4 tokenless frames decoded on the event loop": [
        "tests/e2e/test_socket_floods.py::test_it_closes_big_frames_before_auth_unparsed_while_healthz_stays_fast",
        "tests/e2e/test_socket_floods.py::test_an_authenticated_socket_gets_an_error_for_a_frame_of_too_many_arrays",
    ],
    "S2 API4 replay, seek and unsubscribe hold the writer": [
        "tests/e2e/test_replay_load.py::test_a_loop_of_replays_of_the_whole_backlog_leaves_other_publishers_fast_and_owes_each_message_once",
    ],
    "S3 API1 a repeated key takes over another's receipt": [
        "tests/e2e/test_receipts.py::test_a_repeated_key_does_not_take_the_publishers_receipt",
        "tests/delivery/test_receipts.py::test_another_publishers_repeat_of_a_key_marks_nothing",
    ],
    "S4 API4 publish bodies parsed whole before the payload cap": [
        "tests/mqsite/test_limits.py::test_a_publish_body_bomb_is_refused_before_it_is_parsed",
    ],
    "S5 API4 login flood, schema rebuilt per call, X-Forwarded-For trusted": [
        "tests/e2e/test_login_lockout.py::test_a_login_flood_is_locked_out_before_the_password_hasher",
        "tests/mqsite/test_api_misc.py::test_the_schema_is_built_once_per_process",
        "tests/e2e/test_client_address.py::test_a_forged_x_forwarded_for_escapes_no_throttle",
        "tests/e2e/test_nginx.py::test_behind_nginx_the_admin_rest_websocket_and_failed_token_limit_work",
    ],
    "S6 API10 the clients follow a cross-origin redirect with the token": [
        "tests/clients/test_client_python.py::test_listen_refuses_a_socket_redirect_to_another_origin_and_never_sends_it_the_token",
        "tests/clients/test_client_python.py::test_rest_calls_follow_no_redirect_and_say_so",
        "tests/clients/test_client_js.py::test_node_never_sends_its_token_to_another_origin_a_redirect_points_at",
        "tests/clients/test_client_js.py::test_a_browser_page_never_sends_its_token_to_another_origin_a_redirect_points_at",
    ],
    "S7 API4 unauthenticated sockets uncapped, headers dripped forever": [
        "tests/e2e/test_socket_floods.py::test_unauthenticated_sockets_of_one_address_are_capped_while_a_token_still_connects",
        "tests/e2e/test_socket_floods.py::test_an_http_client_dripping_its_headers_is_cut_off_at_the_deadline",
    ],
    "S8 API2 a long poll outlives its token's revocation": [
        "tests/e2e/test_long_poll_revocation.py::test_it_ends_a_waiting_long_poll_of_a_revoked_token_with_401_and_leases_nothing",
    ],
    "S9 API4 receipts capped per socket only": [
        "tests/e2e/test_receipts.py::test_the_receipts_awaited_are_capped_per_subscriber_not_per_socket",
    ],
    "S10 API5 any staff user is an operator": [
        "tests/e2e/test_operator_permissions.py::test_it_refuses_a_staff_user_without_model_permissions_every_operator_route",
        "tests/e2e/test_operator_permissions.py::test_it_serves_each_operator_route_to_a_staff_user_with_its_permission",
    ],
    "S11 API8 a webhook's answer forges log lines": [
        "tests/delivery/test_webhook_hardening.py::test_it_logs_an_endpoints_answer_escaped_on_one_line_and_truncated",
    ],
    "S12 API8 secrets, rates, passwords, files and pages": [
        "tests/e2e/test_webhook_secrets.py::test_a_receiver_verifies_with_the_old_secret_during_the_grace_and_only_the_new_after",
        "tests/dashboard/test_admin.py::test_staff_who_may_only_view_subscribers_never_see_the_webhook_secret",
        "tests/e2e/test_throttle.py::test_the_default_rate_is_a_limit_a_loop_meets_and_a_prompt_consumer_never_does",
        "tests/mqsite/test_commands.py::test_it_makes_the_first_operator_once_and_prints_the_password_only_then",
        "tests/mqsite/test_secret_files.py::test_it_makes_the_secret_key_file_private_from_its_first_moment",
        "tests/clients/test_client_python.py::test_an_http_url_of_a_remote_host_warns_once_per_client_that_the_token_goes_in_clear",
        "tests/clients/test_client_js.py::test_node_warns_once_when_its_token_would_cross_the_network_in_clear",
        "tests/e2e/test_csp.py::test_the_pages_carry_a_policy_that_runs_no_inline_script",
    ],
    "listen() dies when the server closes a socket cleanly": [
        "tests/clients/test_client_python.py::test_listen_connects_again_when_the_server_closes_the_socket_cleanly",
    ],
}


def test_every_finding_of_the_second_review_names_tests_that_exist():
    for finding, tests in SECOND_REVIEW.items():
        for test in tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{finding}: {test} is gone"
