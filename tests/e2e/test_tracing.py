"""Traces an on-call engineer can follow, from real processes as `make run` starts them, exporting
over OTLP/HTTP to a collector the test runs: a message published with a traceparent is
published, delivered (over a websocket and by a webhook POST) and acked in its own trace; the
webhook POST carries the trace on as HTTP headers; the Django and Celery instrumentations add
their spans; and no token appears anywhere in what is exported, even with every request header
captured (OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*) and a token in a URL."""

import json
import signal

import httpx
import pytest
from websockets.sync.client import connect

from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Queue
from subscribers.provisioning import create_subscriber
from tests.support.otlp import Collector
from tests.support.receivers import Receiver
from tests.support.servers import eventually, start_as_make_run, start_daphne
from tests.support.trace_context import TRACEPARENT, TRACESTATE

pytestmark = pytest.mark.django_db(transaction=True)

TRACE_ID, PARENT_ID = TRACEPARENT.split("-")[1:3]  # the publisher's trace, and its span
# The caller's own HTTP request trace (its HTTP client's instrumentation), not the message's.
REQUEST_TRACEPARENT = "00-11111111111111111111111111111111-2222222222222222-01"


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_a_message_s_trace_goes_on_through_publish_deliver_and_ack(collector, settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver()
    queue = Queue.objects.create(name="db")
    _, app_token = create_subscriber("app", publish=["db"])
    sock, sock_token = create_subscriber("sock", subscribe=["db"])
    hooked, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    puller, pull_token = create_subscriber("puller", subscribe=["db"])
    for subscriber in (sock, hooked, puller):
        subscribing.subscribe(subscriber, queue)
    env = {
        **collector.env(),
        "REDIS_URL": "",
        "MQ_WEBHOOK_ALLOW_PRIVATE": "true",
        "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST": ".*",
        "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_REQUEST": ".*",
    }
    worker = start_as_make_run("worker", env)
    web = start_daphne(env, daphne_args=["-v", "0"])
    try:
        # Given a message published over REST with a traceparent (and a token in the URL too)
        r = httpx.post(
            f"{web.http}/api/queues/db/messages?token={app_token}",
            json={
                "event": "create",
                "payload": {"n": 1},
                "headers": {"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
            },
            headers={"Authorization": f"Bearer {app_token}", "traceparent": REQUEST_TRACEPARENT},
        )
        assert r.status_code == 201, r.text
        message_id = str(r.json()["id"])

        # When a socket takes it and acks it, and the webhook's receiver answers 200
        with connect(f"{web.ws}?token={sock_token}", open_timeout=5) as ws:
            frame = json.loads(ws.recv(timeout=10))
            assert frame["type"] == "message" and frame["headers"]["traceparent"] == TRACEPARENT
            ws.send(json.dumps({"type": "ack", "ids": [frame["id"]]}))
            assert eventually(lambda: Delivery.objects.get(pk=frame["id"]).status == Status.ACKED)
        # ... and a REST consumer pulls it and acks it
        as_puller = {"Authorization": f"Bearer {pull_token}"}
        [pulled] = httpx.get(f"{web.http}/api/deliveries", headers=as_puller).json()["deliveries"]
        acked = httpx.post(f"{web.http}/api/deliveries/ack", json={"ids": [pulled["id"]]}, headers=as_puller)
        assert acked.json()["acked"] == 1
        assert eventually(lambda: receiver.requests, timeout=30), worker.output()[-3000:]

        def ours(operation, transport):
            return [
                s for s in collector.named(f"{operation} db") if s.attributes.get("mq.transport") == transport
            ]

        wanted = [
            ("publish", "rest"),
            ("deliver", "socket"),
            ("ack", "socket"),
            ("deliver", "webhook"),
            ("ack", "webhook"),
            ("deliver", "pull"),
            ("ack", "rest"),
        ]
        got = collector.spans
        assert eventually(lambda: all(ours(*w) for w in wanted), timeout=15), [
            (s.name, s.service, s.attributes.get("mq.transport")) for s in got
        ]

        # Then each is a span of the message's trace, a child of the publisher's span
        for operation, transport in wanted:
            [span] = ours(operation, transport)
            assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID), (operation, transport)
            assert span.attributes["messaging.system"] == "mqsite"
            assert span.attributes["messaging.destination.name"] == "db"
            assert span.attributes["messaging.message.id"] == message_id
            assert span.attributes["messaging.operation.name"] == operation
            assert span.kind == ("PRODUCER" if operation == "publish" else "CONSUMER")
        assert {ours(o, t)[0].attributes["messaging.operation.type"] for o, t in wanted} == {
            "send",
            "process",
            "settle",
        }
        assert ours("deliver", "socket")[0].attributes["messaging.consumer.group.name"] == "sock"
        # ... the publish linked to the HTTP request's own trace, whose server span Django's
        # instrumentation made
        [publish] = ours("publish", "rest")
        request = [
            s for s in collector.spans if s.kind == "SERVER" and s.trace_id == REQUEST_TRACEPARENT[3:35]
        ]
        assert request and (request[0].trace_id, request[0].span_id) in publish.links

        # ... the webhook POST carries the trace on: its traceparent names the httpx span of
        # the webhook's deliver span, in the message's trace; its tracestate is the message's
        headers = {k.lower(): v for k, v in receiver.requests[0][2].items()}
        _, trace_id, post_span_id, _ = headers["traceparent"].split("-")
        assert trace_id == TRACE_ID and headers["tracestate"] == TRACESTATE
        assert eventually(lambda: any(s.span_id == post_span_id for s in collector.spans))
        [post] = [s for s in collector.spans if s.span_id == post_span_id]
        assert post.kind == "CLIENT" and post.parent_span_id == ours("deliver", "webhook")[0].span_id
        assert post.service == "mqsite-worker" and publish.service == "mqsite-web"

        # ... and Celery's instrumentation carries a job's trace from its enqueue in the web
        # process into the worker's run of it (a job serves whatever is owed, of any message:
        # its deliveries' spans are in their messages' traces, above)
        def run_of(enqueued):
            runs = collector.named("run/delivery.tasks.deliver_webhooks")
            return [
                s for s in runs if (s.trace_id, s.parent_span_id) == (enqueued.trace_id, enqueued.span_id)
            ]

        [enqueued, *_] = collector.named("apply_async/delivery.tasks.deliver_webhooks")
        assert enqueued.service == "mqsite-web" and eventually(lambda: run_of(enqueued))
        assert run_of(enqueued)[0].service == "mqsite-worker"
    finally:
        worker.stop(signal.SIGKILL)
        web.stop()
        receiver.close()

    # No token anywhere: not in the attributes (the URL's ?token=, the captured Authorization
    # header), nor anywhere else in the bytes exported
    exported = b"".join(collector.raw)
    for token in (app_token, sock_token, pull_token):
        assert token.encode() not in exported and token[3:].encode() not in exported
    # ... though the headers were captured (blanked) and the URLs recorded (their ?token= blanked)
    attributes = [s.attributes for s in collector.spans]
    assert {"Bearer [redacted]", "[redacted]"} & {
        v for a in attributes for v in a.get("http.request.header.authorization", ())
    }
    assert any("?token=[redacted]" in str(v) for a in attributes for v in a.values())


def test_a_web_process_that_stops_exports_the_spans_it_held(collector):
    Queue.objects.create(name="db")
    _, token = create_subscriber("app", publish=["db"])
    # Spans held for a minute before export: only the stop sends them
    web = start_daphne({**collector.env(), "OTEL_BSP_SCHEDULE_DELAY": "60000"}, daphne_args=["-v", "0"])
    try:
        r = httpx.post(
            f"{web.http}/api/queues/db/messages",
            json={"event": "create", "payload": 1},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 201 and not collector.named("publish db")
    finally:
        web.stop(signal.SIGTERM)
    assert web.proc.returncode == 0 and collector.named("publish db")
