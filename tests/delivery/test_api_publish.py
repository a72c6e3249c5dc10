"""POST /api/queues/{queue}/messages and GET /api/queues, call by call."""

import json

import pytest
from django.test import override_settings

from delivery.models import Delivery, Status
from queues.models import Event, Message
from tests.conftest import client_for
from tests.support.fields import PUBLISHED_FIELDS
from tests.support.rest import post_messages


@pytest.fixture
def split_subscribers(logger, peer):
    """logger takes db/create, peer takes every event of db."""
    client_for(logger).post("/api/subscriptions", {"queue": "db", "event": "create"}, format="json")
    client_for(peer).post("/api/subscriptions", {"queue": "db"}, format="json")
    return logger, peer


def test_it_answers_201_with_the_message_and_its_fan_out(split_subscribers):
    logger, _ = split_subscribers
    r = post_messages(logger, {"event": "create", "payload": {"id": 7, "name": "Ann"}})
    assert r.status_code == 201
    body = r.json()
    assert set(body) == PUBLISHED_FIELDS
    assert body["queue"] == "db" and body["event"] == "create" and body["seq"] == 1
    assert body["deliveries"] == 2
    message = Message.objects.get(pk=body["id"])
    assert json.loads(message.payload_json) == {"id": 7, "name": "Ann"}
    assert Delivery.objects.filter(message=message, status=Status.PENDING).count() == 2


def test_it_fans_out_only_to_matching_events(split_subscribers):
    logger, peer = split_subscribers
    r = post_messages(logger, {"event": "delete", "payload": 1})
    assert r.json()["deliveries"] == 1
    assert list(Delivery.objects.values_list("subscriber__name", flat=True)) == ["peer"]


@pytest.mark.parametrize(
    "payload", [None, 0, "text", [1, "two", None], {"nested": {"a": [True, False]}}, "\u0000 é 😀"]
)
def test_it_keeps_any_json_payload_as_given(split_subscribers, payload):
    logger, _ = split_subscribers
    r = post_messages(logger, {"event": "create", "payload": payload})
    assert r.status_code == 201
    leased = client_for(logger).get("/api/deliveries").json()["deliveries"]
    assert leased[0]["payload"] == payload


def test_it_numbers_messages_in_order_per_queue(split_subscribers, make_queue):
    logger, _ = split_subscribers
    make_queue("network")
    seqs = [post_messages(logger, {"event": "create", "payload": i}).json()["seq"] for i in range(3)]
    assert seqs == [1, 2, 3]
    r = client_for(logger).post("/api/queues/network/messages", {"event": "up", "payload": 1}, format="json")
    assert r.status_code == 403  # logger may not publish to network
    r = post_messages(logger, {"event": "create", "payload": 4})
    assert r.json()["seq"] == 4


def test_it_lower_cases_names(split_subscribers):
    logger, _ = split_subscribers
    r = post_messages(logger, {"event": "CREATE", "payload": 1}, queue="DB")
    assert r.status_code == 201
    assert r.json()["queue"] == "db" and r.json()["event"] == "create"


def test_a_batch_is_published_in_order(split_subscribers):
    logger, _ = split_subscribers
    messages = [{"event": "create", "payload": i} for i in range(5)] + [{"event": "delete", "payload": "x"}]
    r = post_messages(logger, {"messages": messages})
    assert r.status_code == 201
    answers = r.json()["messages"]
    assert [a["seq"] for a in answers] == [1, 2, 3, 4, 5, 6]
    assert [a["deliveries"] for a in answers] == [2, 2, 2, 2, 2, 1]
    assert Message.objects.count() == 6
    assert Delivery.objects.count() == 11


def test_a_batch_with_one_bad_message_publishes_nothing(split_subscribers):
    logger, _ = split_subscribers
    r = post_messages(
        logger, {"messages": [{"event": "create", "payload": 1}, {"event": "bad name!", "payload": 2}]}
    )
    assert r.status_code == 400
    assert "messages" in r.json()
    assert Message.objects.count() == 0 and Delivery.objects.count() == 0


def test_a_batch_with_a_messages_fields_beside_it_is_a_400_and_publishes_nothing(
    split_subscribers,
):
    logger, _ = split_subscribers
    r = post_messages(
        logger, {"messages": [{"event": "create", "payload": 1}], "event": "create", "payload": 2}
    )
    assert r.status_code == 400
    assert set(r.json()) >= {"event", "payload"}
    assert Message.objects.count() == 0


def test_a_batch_has_at_most_1000_messages_and_at_least_one(split_subscribers):
    logger, _ = split_subscribers
    r = post_messages(logger, {"messages": [{"event": "create", "payload": i} for i in range(1001)]})
    assert r.status_code == 400
    r = post_messages(logger, {"messages": []})
    assert r.status_code == 400
    r = post_messages(logger, {"messages": [{"event": "create", "payload": i} for i in range(1000)]})
    assert r.status_code == 201 and len(r.json()["messages"]) == 1000
    assert Message.objects.count() == 1000


def test_the_same_key_answers_200_with_the_first_message_and_delivers_nothing_new(
    split_subscribers,
):
    logger, peer = split_subscribers
    first = post_messages(logger, {"event": "create", "payload": 1, "key": "order-42"})
    assert first.status_code == 201
    again = post_messages(peer, {"event": "create", "payload": 2, "key": "order-42"})
    assert again.status_code == 200
    assert again.json() == first.json()
    assert Message.objects.count() == 1 and Delivery.objects.count() == 2


def test_keys_are_per_queue(split_subscribers, make_queue):
    logger, _ = split_subscribers
    make_queue("fs")
    assert post_messages(logger, {"event": "create", "payload": 1, "key": "k"}).status_code == 201
    r = client_for(logger).post(
        "/api/queues/fs/messages", {"event": "x", "payload": 1, "key": "k"}, format="json"
    )
    assert r.status_code == 403  # not allowed; an allowed publisher:
    logger.publish_all = True
    logger.save()
    r = client_for(logger).post(
        "/api/queues/fs/messages", {"event": "x", "payload": 1, "key": "k"}, format="json"
    )
    assert r.status_code == 201


def test_keys_repeat_inside_a_batch_and_across_batches(split_subscribers):
    logger, _ = split_subscribers
    post_messages(logger, {"event": "create", "payload": 0, "key": "a"})
    r = post_messages(
        logger,
        {
            "messages": [
                {"event": "create", "payload": 1, "key": "a"},
                {"event": "create", "payload": 2, "key": "b"},
                {"event": "create", "payload": 3, "key": "b"},
                {"event": "create", "payload": 4},
            ]
        },
    )
    assert r.status_code == 201
    seqs = [m["seq"] for m in r.json()["messages"]]
    assert seqs == [1, 2, 2, 3]
    assert Message.objects.count() == 3


def test_an_operator_may_publish_to_any_queue(operator_client, db_queue):
    r = operator_client.post("/api/queues/db/messages", {"event": "create", "payload": {}}, format="json")
    assert r.status_code == 201
    assert Message.objects.get().publisher is None


@pytest.mark.parametrize(
    "body",
    [
        {"payload": 1},
        {"event": "create"},
        {"event": "", "payload": 1},
        {"event": "-starts-with-dash", "payload": 1},
        {"event": "has space", "payload": 1},
        {"event": "x" * 65, "payload": 1},
        {"event": 5, "payload": 1},
        {"event": "create", "payload": 1, "key": ""},
        {"event": "create", "payload": 1, "key": "k" * 256},
        {"messages": "not a list"},
        {"messages": [1, 2]},
        [1, 2, 3],
        "just a string",
    ],
)
def test_malformed_messages_get_400_with_words(split_subscribers, body):
    logger, _ = split_subscribers
    r = post_messages(logger, body)
    assert r.status_code == 400, r.content
    assert r.json()  # names the problem
    assert Message.objects.count() == 0


def test_bad_json_gets_400(logger):
    r = client_for(logger).generic(
        "POST", "/api/queues/db/messages", b'{"event": "create", "payload": ', content_type="application/json"
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["detail"]


@pytest.mark.parametrize(
    "raw", [b'{"event":"create","payload":NaN}', b'{"event":"create","payload":Infinity}']
)
def test_non_json_numbers_get_400(logger, raw):
    r = client_for(logger).generic("POST", "/api/queues/db/messages", raw, content_type="application/json")
    assert r.status_code == 400


def test_deeply_nested_json_gets_400(logger):
    raw = b'{"event":"create","payload":' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = client_for(logger).generic("POST", "/api/queues/db/messages", raw, content_type="application/json")
    assert r.status_code == 400
    assert "deep" in r.json()["detail"]


@override_settings(MQ_MAX_PAYLOAD_BYTES=100)
def test_a_payload_over_the_limit_gets_413(split_subscribers):
    logger, _ = split_subscribers
    r = post_messages(logger, {"event": "create", "payload": "x" * 99})  # 101 bytes of JSON with quotes
    assert r.status_code == 413
    assert "limit" in r.json()["detail"]
    r = post_messages(logger, {"event": "create", "payload": "x" * 98})  # exactly 100 bytes
    assert r.status_code == 201


@override_settings(MQ_MAX_PAYLOAD_BYTES=100)
def test_payload_size_counts_utf8_bytes(split_subscribers):
    logger, _ = split_subscribers
    r = post_messages(logger, {"event": "create", "payload": "é" * 49})  # 98 bytes + 2 quotes
    assert r.status_code == 201
    r = post_messages(logger, {"event": "create", "payload": "é" * 50})
    assert r.status_code == 413


@override_settings(MQ_MAX_BODY_BYTES=1000)
def test_a_body_over_the_limit_gets_413_before_parsing(logger):
    raw = b"{" + b" " * 2000  # not even JSON: refused on its size alone
    r = client_for(logger).generic("POST", "/api/queues/db/messages", raw, content_type="application/json")
    assert r.status_code == 413


def test_an_unknown_queue_is_404_whatever_the_permissions(logger, outsider):
    for who in (logger, outsider):
        r = post_messages(who, {"event": "create", "payload": 1}, queue="nope")
        assert r.status_code == 404
        assert "nope" in r.json()["detail"]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", ""])
def test_a_json_body_is_read_as_json_whatever_its_declared_type(logger, db_queue, content_type):
    body = json.dumps({"event": "create", "payload": {"id": 7}})
    r = client_for(logger).generic("POST", "/api/queues/db/messages", body, content_type=content_type)
    assert r.status_code == 201, r.content
    assert Message.objects.get().payload_json == '{"id":7}'


def test_a_body_that_is_not_json_is_400_whatever_its_declared_type(logger, db_queue):
    r = client_for(logger).generic(
        "POST",
        "/api/queues/db/messages",
        "event=create&payload=1",
        content_type="application/x-www-form-urlencoded",
    )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["detail"]
    assert Message.objects.count() == 0


def test_a_queue_name_that_breaks_the_naming_rule_is_400_not_404(logger):
    r = post_messages(logger, {"event": "create", "payload": 1}, queue="Bad!name")
    assert r.status_code == 400
    assert "is not valid" in r.json()["queue"][0]
    assert Message.objects.count() == 0


def test_a_subscriber_without_publish_rights_gets_403(outsider, db_queue):
    r = post_messages(outsider, {"event": "create", "payload": 1})
    assert r.status_code == 403
    assert Message.objects.count() == 0


def test_no_token_or_a_bad_token_gets_401(db_queue):
    r = client_for().post("/api/queues/db/messages", {"event": "create", "payload": 1}, format="json")
    assert r.status_code == 401
    c = client_for()
    c.credentials(HTTP_AUTHORIZATION="Bearer mq_not-a-real-token")
    assert (
        c.post("/api/queues/db/messages", {"event": "create", "payload": 1}, format="json").status_code == 401
    )
    c.credentials(HTTP_AUTHORIZATION="Bearer")
    assert c.get("/api/queues").status_code == 401


def test_an_inactive_subscriber_is_refused(logger):
    logger.is_active = False
    logger.save()
    assert client_for(logger).get("/api/queues").status_code == 401


def test_publish_inside_the_callers_transaction_exists_only_if_it_commits(db_queue, logger):
    from django.db import transaction

    from delivery import publishing

    with pytest.raises(RuntimeError), transaction.atomic():
        publishing.publish(db_queue, [publishing.prepare("create", 1)])
        raise RuntimeError("the caller's own work failed")
    assert Message.objects.count() == 0
    with transaction.atomic():
        publishing.publish(db_queue, [publishing.prepare("create", 1)])
    assert Message.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_event_made_in_a_rolled_back_transaction_is_not_taken_for_made(db_queue):
    from django.db import transaction

    from delivery import publishing

    with pytest.raises(RuntimeError), transaction.atomic():
        publishing.publish(db_queue, [publishing.prepare("brandnew", 1)])
        raise RuntimeError("the caller's own work failed")
    # In a transaction of the caller's, a publish cannot try again: the event must be made anew.
    with transaction.atomic():
        ((answer, created),) = publishing.publish(db_queue, [publishing.prepare("brandnew", 2)])
    assert created and answer["event"] == "brandnew"
    assert Event.objects.filter(queue=db_queue, name="brandnew").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_publish_to_an_event_deleted_since_it_was_last_used_makes_it_again(db_queue):
    from delivery import publishing

    publishing.publish(db_queue, [publishing.prepare("create", 1)])
    Event.objects.filter(queue=db_queue, name="create").delete()  # an operator, in the admin

    ((answer, created),) = publishing.publish(db_queue, [publishing.prepare("create", 2)])

    assert created and answer["event"] == "create"
    assert Message.objects.get().event == Event.objects.get(queue=db_queue, name="create")


class TestQueueList:
    def test_a_subscriber_sees_the_queues_it_may_use(self, logger, make_queue):
        make_queue("secret")
        post_messages(logger, {"event": "create", "payload": 1})
        r = client_for(logger).get("/api/queues")
        assert r.status_code == 200
        queues = r.json()["queues"]
        assert [q["name"] for q in queues] == ["db"]
        q = queues[0]
        assert q["events"] == ["create"] and q["ordered"] is False
        assert q["max_attempts"] == 10 and q["ack_timeout"] == 30 and q["retention_days"] == 7
        assert q["may_publish"] and q["may_subscribe"]

    def test_an_outsider_sees_none_and_an_operator_all(self, outsider, operator_client, make_queue):
        make_queue("a")
        make_queue("b")
        assert client_for(outsider).get("/api/queues").json() == {"queues": []}
        assert [q["name"] for q in operator_client.get("/api/queues").json()["queues"]] == ["a", "b"]

    def test_a_subscriber_with_every_queue_sees_every_queue(self, make_subscriber, make_queue):
        make_queue("a")
        make_queue("b")
        everyone = make_subscriber("everyone", publish=("*",), subscribe=())
        assert [q["name"] for q in client_for(everyone).get("/api/queues").json()["queues"]] == ["a", "b"]


def test_a_key_is_kept_as_sent_and_unstorable_keys_get_400(logger):
    c = client_for(logger)
    r = c.post("/api/queues/db/messages", {"event": "e", "payload": 1, "key": "  "}, format="json")
    assert r.status_code == 201  # whitespace is a key like any other, not trimmed to blank
    assert Message.objects.get().key == "  "
    r = c.post("/api/queues/db/messages", {"event": "e", "payload": 1, "key": "a\u0000b"}, format="json")
    assert r.status_code == 400
    raw = b'{"event": "e", "payload": 1, "key": "\\ud800x"}'
    r = c.generic("POST", "/api/queues/db/messages", raw, content_type="application/json")
    assert r.status_code == 400
    assert Message.objects.count() == 1
