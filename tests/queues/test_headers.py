"""Headers (API.md, Extensions): names and text values beside the payload, checked on publish
(REST single and batch, `manage.py publish --header`, the admin's test publish), carried on
every delivery (pull, webhook body), shown and searched in the admin, in the dashboard's feed
and in the archive. The socket's frames are in tests/e2e/test_headers_socket.py."""

import io
import json

import duckdb
import jsonschema
import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from standardwebhooks import Webhook

from dashboard import snapshot
from delivery import publishing, subscribing, tasks
from delivery.models import Delivery, Status
from queues.models import Message
from subscribers.provisioning import create_subscriber
from tests.conftest import client_for
from tests.support.commands import command_output
from tests.support.fields import DELIVERY_FIELDS
from tests.support.history_rows import days_ago, publish_at, settle
from tests.support.rest import post_messages
from tests.support.trace_context import TRACEPARENT, TRACESTATE

pytestmark = pytest.mark.django_db

# W3C trace context, exactly as a tracer writes it: it must come back byte for byte.
HEADERS = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "Tenant-Id": "acme", "note": "café ☕"}


def pull_answer(who):
    r = client_for(who).get("/api/deliveries?limit=100")
    assert r.status_code == 200, r.content
    return r


@pytest.fixture
def peer_subscribed(logger, peer, db_queue):
    """The logger publishes; the peer takes every event of db."""
    subscribing.subscribe(peer, db_queue)
    return logger, peer


# --- REST publish and pull -------------------------------------------------------------------


def test_headers_published_over_rest_come_back_on_the_pull_exactly_as_sent(peer_subscribed):
    logger, peer = peer_subscribed
    r = post_messages(logger, {"event": "create", "payload": {"id": 7}, "headers": HEADERS})
    assert r.status_code == 201, r.content
    assert set(r.json()) == {
        "id",
        "queue",
        "event",
        "seq",
        "deliveries",
        "created_at",
    }  # the answer is as before

    message = Message.objects.get()
    assert json.loads(message.headers_json) == HEADERS
    assert list(json.loads(message.headers_json)) == list(HEADERS)  # in the order sent

    raw = pull_answer(peer)
    (delivery,) = raw.json()["deliveries"]
    assert delivery["headers"] == HEADERS and set(delivery) == DELIVERY_FIELDS | {"headers"}
    assert f'"traceparent":"{TRACEPARENT}"' in raw.content.decode().replace(" ", "")
    assert f'"tracestate":"{TRACESTATE}"' in raw.content.decode().replace(" ", "")


def test_a_batch_carries_each_messages_own_headers(peer_subscribed):
    logger, peer = peer_subscribed
    body = {
        "messages": [
            {"event": "create", "payload": 1, "headers": {"traceparent": TRACEPARENT}},
            {"event": "create", "payload": 2},
            {"event": "delete", "payload": 3, "headers": {"tenant": "b"}, "key": "k-3"},
        ]
    }
    r = post_messages(logger, body)
    assert r.status_code == 201, r.content

    stored = list(Message.objects.order_by("seq").values_list("headers_json", flat=True))
    assert stored == [json.dumps({"traceparent": TRACEPARENT}, separators=(",", ":")), None, '{"tenant":"b"}']
    pulled = pull_answer(peer).json()["deliveries"]
    assert [d.get("headers") for d in pulled] == [{"traceparent": TRACEPARENT}, None, {"tenant": "b"}]
    assert "headers" not in pulled[1]


@pytest.mark.parametrize("none", [None, {}])
def test_a_message_without_headers_stores_none_and_its_delivery_has_no_headers_key(peer_subscribed, none):
    logger, peer = peer_subscribed
    body = {"event": "create", "payload": 1} | ({"headers": none} if none is not None else {})
    assert post_messages(logger, body).status_code == 201
    assert post_messages(logger, {"event": "create", "payload": 2, "headers": None}).status_code == 201

    assert list(Message.objects.values_list("headers_json", flat=True)) == [None, None]
    for delivery in pull_answer(peer).json()["deliveries"]:
        assert set(delivery) == DELIVERY_FIELDS


def test_the_limits_themselves_are_accepted(peer_subscribed):
    logger, peer = peer_subscribed
    many = {f"h{i}": "v" for i in range(64)}
    # 8192 bytes in all: 2-byte "é"s fill a value to the byte.
    full = {"a": "x", "b" * 64: "é" * ((8192 - 1 - 1 - 64) // 2)}
    assert sum(len(k) + len(v.encode()) for k, v in full.items()) == 8192
    for headers in (many, full, {"empty": ""}, {"A-Z.a_z-0.9": "=:; ,\"'\\/\n\t"}):
        r = post_messages(logger, {"event": "create", "payload": None, "headers": headers})
        assert r.status_code == 201, r.content
    assert [d["headers"] for d in pull_answer(peer).json()["deliveries"]][:2] == [many, full]


def test_a_republish_with_the_same_key_answers_the_first_message_and_keeps_its_headers(peer_subscribed):
    logger, peer = peer_subscribed
    first = post_messages(logger, {"event": "create", "payload": 1, "key": "k", "headers": {"v": "1"}})
    again = post_messages(logger, {"event": "create", "payload": 1, "key": "k", "headers": {"v": "2"}})

    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert list(Message.objects.values_list("headers_json", flat=True)) == ['{"v":"1"}']
    assert [d["headers"] for d in pull_answer(peer).json()["deliveries"]] == [{"v": "1"}]


BAD_HEADERS = [
    pytest.param({"bad name": "x"}, "is not valid", id="space in name"),
    pytest.param({"": "x"}, "is not valid", id="empty name"),
    pytest.param({"x" * 65: "x"}, "is not valid", id="65-char name"),
    pytest.param({"café": "x"}, "is not valid", id="non-ascii name"),
    pytest.param({"a:b": "x"}, "is not valid", id="colon in name"),
    pytest.param({f"h{i}": "v" for i in range(65)}, "65 headers", id="65 headers"),
    pytest.param({"a": "x" * 8192}, "8192 bytes", id="8 KiB + 1"),
    pytest.param({"a": "é" * 4096}, "8192 bytes", id="8 KiB + 1 in UTF-8"),
    pytest.param({"a": 1}, "must be text", id="number value"),
    pytest.param({"a": None}, "must be text", id="null value"),
    pytest.param({"a": True}, "must be text", id="boolean value"),
    pytest.param({"a": ["x"]}, "must be text", id="list value"),
    pytest.param({"a": {"b": "c"}}, "must be text", id="object value"),
    pytest.param({"a": "x\x00y"}, "NUL", id="NUL in value"),
    pytest.param("traceparent=x", "must be an object", id="a string"),
    pytest.param([["a", "b"]], "must be an object", id="a list"),
    pytest.param(5, "must be an object", id="a number"),
]


@pytest.mark.parametrize(("headers", "words"), BAD_HEADERS)
def test_bad_headers_are_a_400_naming_the_field_and_nothing_is_written(peer_subscribed, headers, words):
    logger, peer = peer_subscribed
    r = post_messages(logger, {"event": "create", "payload": 1, "headers": headers})

    assert r.status_code == 400, r.content
    assert set(r.json()) == {"detail", "code", "headers"} and words in r.json()["headers"][0]
    assert Message.objects.count() == 0 and Delivery.objects.count() == 0


@pytest.mark.parametrize(("headers", "words"), BAD_HEADERS[::3])
def test_a_batch_with_one_bad_headers_is_a_400_naming_its_index_and_publishes_none(
    peer_subscribed, headers, words
):
    logger, _ = peer_subscribed
    good = {"event": "create", "payload": 1, "headers": {"ok": "yes"}}
    r = post_messages(logger, {"messages": [good, {**good, "headers": headers}, good]})

    assert r.status_code == 400, r.content
    assert set(r.json()) == {"detail", "code", "messages"} and list(r.json()["messages"]) == [
        "1"
    ]  # messages[1] ...
    (error,) = r.json()["messages"]["1"]["headers"]  # ... .headers
    assert words in error
    assert Message.objects.count() == 0 and Delivery.objects.count() == 0


def test_a_lone_surrogate_in_a_value_is_a_400(peer_subscribed):
    logger, _ = peer_subscribed
    raw = '{"event": "create", "payload": 1, "headers": {"a": "x\\ud800"}}'
    r = client_for(logger).generic("POST", "/api/queues/db/messages", raw, content_type="application/json")
    assert r.status_code == 400 and "headers" in r.json(), r.content
    assert Message.objects.count() == 0


def test_headers_beside_a_batchs_messages_are_refused_not_dropped(peer_subscribed):
    logger, _ = peer_subscribed
    r = post_messages(logger, {"messages": [{"event": "create", "payload": 1}], "headers": {"a": "b"}})
    assert r.status_code == 400 and "headers" in r.json(), r.content
    assert Message.objects.count() == 0


# --- the schema ----------------------------------------------------------------------------------


def publish_body_validator():
    document = client_for().get("/api/schema/?format=json").json()
    body = document["paths"]["/api/queues/{queue}/messages"]["post"]["requestBody"]["content"]
    # Draft 4, as Schemathesis reads an OpenAPI 3.0 schema: the name rule is patternProperties.
    return jsonschema.Draft4Validator(
        {**body["application/json"]["schema"], "components": document["components"]}
    )


def test_the_schema_allows_what_the_server_accepts_and_forbids_what_it_refuses(peer_subscribed):
    validator = publish_body_validator()
    assert validator.is_valid({"event": "create", "payload": 1, "headers": HEADERS})
    assert validator.is_valid({"messages": [{"event": "create", "payload": 1, "headers": HEADERS}]})
    for param in BAD_HEADERS:
        headers, _ = param.values
        if param.id in ("8 KiB + 1", "8 KiB + 1 in UTF-8"):
            continue  # a sum over names and values: the schema says it in words only
        assert not validator.is_valid({"event": "create", "payload": 1, "headers": headers}), param.id
    assert not validator.is_valid({"messages": [{"event": "create", "payload": 1}], "headers": {"a": "b"}})


def test_the_schema_says_a_delivery_may_carry_headers(db):
    document = client_for().get("/api/schema/?format=json").json()
    delivery = document["components"]["schemas"]["Delivery"]
    assert delivery["properties"]["headers"]["additionalProperties"] == {"type": "string"}
    assert "headers" not in delivery["required"]


# --- webhooks ------------------------------------------------------------------------------------


def test_a_webhook_body_carries_the_headers_under_a_valid_signature(db_queue, receiver, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    hooked, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(hooked, db_queue)
    publishing.publish(
        db_queue,
        [publishing.prepare("create", {"n": 1}, headers=HEADERS), publishing.prepare("create", {"n": 2})],
    )

    assert tasks.deliver_webhooks(hooked.pk) == 2

    (_, _, with_headers, body), (_, _, without_headers, plain) = receiver.requests
    frame = json.loads(body)
    assert frame["type"] == "message" and frame["headers"] == HEADERS
    assert f'"traceparent":"{TRACEPARENT}"' in body.decode()  # byte for byte
    Webhook(hooked.webhook_secret).verify(body, with_headers)  # the signature covers them
    with pytest.raises(Exception):  # noqa: B017 - the library raises its own WebhookVerificationError
        Webhook(hooked.webhook_secret).verify(body.replace(b"acme", b"evil"), with_headers)
    assert "headers" not in json.loads(plain)
    Webhook(hooked.webhook_secret).verify(plain, without_headers)
    assert set(Delivery.objects.values_list("status", flat=True)) == {Status.ACKED}


# --- manage.py publish --header --------------------------------------------------------------------


def test_the_publish_command_takes_repeated_headers(peer_subscribed):
    _, peer = peer_subscribed
    answer = json.loads(
        command_output(
            "publish",
            "db",
            "create",
            '{"a": 1}',
            "--header",
            f"traceparent={TRACEPARENT}",
            "--header",
            "q=a=b",
        )
    )

    message = Message.objects.get()
    assert answer["id"] == message.pk
    assert json.loads(message.headers_json) == {"traceparent": TRACEPARENT, "q": "a=b"}
    assert pull_answer(peer).json()["deliveries"][0]["headers"] == {"traceparent": TRACEPARENT, "q": "a=b"}


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--header", "no-equals-sign"], "not NAME=VALUE"),
        (["--header", "bad name=x"], "is not valid"),
        (["--header", "a=1", "--header", "a=2"], "given twice"),
        (["--header", "a=x\x00"], "NUL"),
    ],
)
def test_the_publish_command_refuses_bad_headers_and_publishes_nothing(peer_subscribed, flags, words):
    with pytest.raises(CommandError, match=words):
        command_output("publish", "db", "create", "1", *flags)
    assert Message.objects.count() == 0


# --- the admin -----------------------------------------------------------------------------------


def test_the_admins_message_and_delivery_pages_show_the_headers(staff, db_queue, logger):
    subscribing.subscribe(logger, db_queue)
    [(with_h, _), (without, _)] = publishing.publish(
        db_queue,
        [
            publishing.prepare("create", 1, headers={"traceparent": TRACEPARENT, "x": "<b>"}),
            publishing.prepare("create", 2),
        ],
    )

    html = staff.get(reverse("admin:queues_message_change", args=[with_h["id"]])).content.decode()
    assert "headers" in html and TRACEPARENT in html
    assert "&lt;b&gt;" in html and "<b>" not in html  # shown as text
    html = staff.get(reverse("admin:queues_message_change", args=[without["id"]])).content.decode()
    assert TRACEPARENT not in html
    delivery = Delivery.objects.get(message_id=with_h["id"])
    html = staff.get(reverse("admin:delivery_delivery_change", args=[delivery.pk])).content.decode()
    assert TRACEPARENT in html


def test_the_admins_message_search_finds_messages_by_header_name_and_value(staff, db_queue):
    def make(headers, key=None):
        [(answer, _)] = publishing.publish(db_queue, [publishing.prepare("create", 1, key, headers)])
        return answer["id"]

    traced = make({"traceparent": TRACEPARENT, "tenant": "acme"})
    other_tenant = make({"tenant": "acme-corp"})
    keyed = make(None, key="order-17")
    make(None)

    def found(term):
        r = staff.get(reverse("admin:queues_message_changelist"), {"q": term})
        assert r.status_code == 200
        return sorted(m.pk for m in r.context["cl"].result_list)

    assert found("traceparent") == [traced]  # a name
    assert found("4bf92f3577b34da6") == [traced]  # part of a value
    assert found("ACME") == sorted([traced, other_tenant])  # case-insensitive
    assert found("tenant=acme") == [traced]  # that header with exactly that value
    assert found("tenant=acme-corp") == [other_tenant]
    assert found("order-17") == [keyed]  # keys still found
    assert found(str(keyed)) == [keyed]  # and ids
    assert found("nowhere") == []


PUBLISH = "/admin/tools/publish/"


def test_the_admins_test_publish_takes_headers_as_lines_or_json(staff, db_queue):
    form = {"queue": db_queue.pk, "event": "test", "payload": "{}"}
    r = staff.post(PUBLISH, {**form, "headers": f"traceparent={TRACEPARENT}\r\ntenant=a=b\r\n"})
    assert r.status_code == 302, r.content
    r = staff.post(PUBLISH, {**form, "headers": json.dumps({"tracestate": TRACESTATE})})
    assert r.status_code == 302, r.content
    r = staff.post(PUBLISH, {**form, "headers": ""})
    assert r.status_code == 302, r.content

    stored = [
        json.loads(h) if h else None
        for h in Message.objects.order_by("seq").values_list("headers_json", flat=True)
    ]
    assert stored == [{"traceparent": TRACEPARENT, "tenant": "a=b"}, {"tracestate": TRACESTATE}, None]


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ("no equals sign", "not NAME=VALUE"),
        ("bad name=1", "is not valid"),
        ('{"a": 1}', "must be text"),
        ('{"a": ', "not a JSON object"),
        ("\n".join(f"h{i}=v" for i in range(65)), "65 headers"),
    ],
)
def test_the_admins_test_publish_refuses_bad_headers_on_the_field(staff, db_queue, headers, words):
    r = staff.post(PUBLISH, {"queue": db_queue.pk, "event": "test", "payload": "{}", "headers": headers})
    assert r.status_code == 200
    assert words in " ".join(r.context["form"].errors["headers"])
    assert Message.objects.count() == 0


# --- the dashboard's feed ------------------------------------------------------------------------


def test_the_dashboards_feed_shows_a_messages_headers_when_it_has_some(db_queue):
    publishing.publish(
        db_queue,
        [
            publishing.prepare("create", 1, headers={"traceparent": TRACEPARENT, "tenant": "acme"}),
            publishing.prepare("create", 2),
            publishing.prepare("create", 3, headers={"big": "x" * 5000}),
        ],
    )

    big, plain, traced = snapshot.newest_messages()
    assert traced["headers"] == f"traceparent={TRACEPARENT}  tenant=acme"
    assert "headers" not in plain
    assert len(big["headers"]) <= snapshot.HEADERS_PREVIEW_CHARS + 1 and big["headers"].endswith("…")


# --- the archive ---------------------------------------------------------------------------------


def test_the_archives_parquet_messages_have_a_headers_column(tmp_path, settings, db_queue, logger):
    settings.MQ_ARCHIVE_DIR = str(tmp_path / "archive")
    subscribing.subscribe(logger, db_queue)
    with_h = publish_at(db_queue, "create", days_ago(10))
    Message.objects.filter(id=with_h).update(
        headers_json=publishing.prepare("create", 1, headers=HEADERS).headers_json
    )
    plain = publish_at(db_queue, "create", days_ago(10))
    for m in (with_h, plain):
        settle(m, {logger: Status.ACKED})

    out = io.StringIO()
    call_command("archive", stdout=out)
    assert json.loads(out.getvalue())["messages"] == 2

    rows = (
        duckdb.connect()
        .sql(f"SELECT id, headers FROM read_parquet('{tmp_path}/archive/messages/**/*.parquet') ORDER BY id")
        .fetchall()
    )
    assert rows == [(with_h, json.dumps(HEADERS, ensure_ascii=False, separators=(",", ":"))), (plain, None)]
    assert json.loads(rows[0][1])["traceparent"] == TRACEPARENT
