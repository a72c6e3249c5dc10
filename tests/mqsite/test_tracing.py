"""Tracing's rules in process: when the OTEL_* variables turn it on, that no secret leaves in a
span, and where our spans join a message's trace (tests/e2e/test_tracing.py follows them
through real processes to a collector)."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from delivery import group_commit, publishing
from mqsite import tracing
from tests.support.trace_context import TRACEPARENT, TRACESTATE

TOKEN = "mq_" + "A1b2" * 11  # looks like one (subscribers.tokens)


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),  # nothing named: off (not the specification's default of otlp to localhost)
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_it_traces_only_when_an_exporter_is_named(environ, on):
    assert tracing.wanted(environ) is on


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER=zipkin: this server exports to otlp"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "only http/protobuf"),
    ],
)
def test_it_refuses_an_exporter_it_does_not_have_before_setting_anything_up(environ, words, settings):
    with pytest.raises(tracing.BadTracingSetting, match=words):
        tracing.configure("web", environ)
    assert tracing.tracer is None
    # A process starting with it stops with the words (a Celery worker too: its signal
    # handlers' exceptions are only logged, SystemExit is not caught)
    settings.OTEL_ENVIRON = environ
    with pytest.raises(SystemExit, match=f"mqsite: .*{words}"):
        tracing.start("worker")
    assert tracing.tracer is None


@pytest.fixture
def exported():
    """Spans as the server exports them (through ScrubbingExporter), from a provider of the test's own."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.ScrubbingExporter(memory)))
    yield provider.get_tracer("test"), memory
    provider.shutdown()


def test_no_token_leaves_in_a_span(exported):
    tracer, memory = exported
    with tracer.start_as_current_span(
        "GET /ws/",
        attributes={
            "http.url": f"http://h/ws/?token={TOKEN}&limit=5",
            "http.target": "/api/deliveries?access_token=abc&wait=1",
            "url.query": "token=plain&n=2",
            "http.request.header.authorization": (f"Bearer {TOKEN}",),
            "http.request.header.webhook_signature": ("v1,abc",),
            "note": f"a careless {TOKEN} in words",
            "words": "design=1 token_type=bearer monkey=2",
        },
    ) as span:
        span.add_event(
            "exception",
            {
                "exception.message": f"failed for {TOKEN}",
                "exception.stacktrace": "Traceback:\n  line 1\nConnectError: http://h/hook?api_key=abc&n=1\n",
            },
        )
        span.set_status(trace.StatusCode.ERROR, "ConnectError: http://h/hook?sig=abc")
    with tracer.start_as_current_span("plain", attributes={"http.target": "/api/queues?limit=5"}):
        pass

    scrubbed, plain = memory.get_finished_spans()
    assert dict(scrubbed.attributes) == {
        "http.url": "http://h/ws/?token=[redacted]&limit=5",
        "http.target": "/api/deliveries?access_token=[redacted]&wait=1",
        "url.query": "token=[redacted]&n=2",
        "http.request.header.authorization": ("[redacted]",),
        "http.request.header.webhook_signature": ("[redacted]",),
        "note": "a careless mq_[redacted] in words",
        "words": "design=1 token_type=bearer monkey=2",  # not secrets by their names
    }
    assert dict(scrubbed.events[0].attributes) == {
        "exception.message": "failed for mq_[redacted]",
        "exception.stacktrace": "Traceback:\n  line 1\nConnectError: http://h/hook?api_key=[redacted]&n=1\n",
    }
    assert scrubbed.status.description == "ConnectError: http://h/hook?sig=[redacted]"
    assert plain.attributes["http.target"] == "/api/queues?limit=5"
    assert tracing.scrub_span(plain) is plain  # nothing to blank: exported as it is, not copied


@pytest.fixture
def traced(exported, monkeypatch):
    tracer, memory = exported
    monkeypatch.setattr(tracing, "tracer", tracer)
    return memory


def headers(trace_id, span_id):
    return {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": TRACESTATE}


@pytest.mark.django_db(transaction=True)
def test_a_publish_continues_its_message_s_trace_and_links_the_others(traced, db_queue, owner):
    # Given a batch: a message with the publisher's traceparent, one without, one of another trace
    other = headers("c" * 32, "d" * 16)
    batch = [
        publishing.prepare("create", 1, headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE}),
        publishing.prepare("create", 2),
        publishing.prepare("create", 3, headers=other),
    ]
    caller = tracing.tracer.start_span("caller's request")  # e.g. Django's span

    # When it is published inside the caller's span
    with trace.use_span(caller, end_on_exit=True):
        group_commit.publish(db_queue, batch)

    # Then the publish span is a child of the first message's trace, linked to the rest
    [span] = [s for s in traced.get_finished_spans() if s.name == "publish db"]
    _, trace_id, span_id, _ = TRACEPARENT.split("-")
    assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (trace_id, span_id)
    assert span.context.trace_state.to_header() == TRACESTATE
    assert span.kind == trace.SpanKind.PRODUCER
    assert span.attributes["messaging.batch.message_count"] == 3
    linked = {(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links}
    assert linked == {
        ("c" * 32, "d" * 16),
        (f"{caller.context.trace_id:032x}", f"{caller.context.span_id:016x}"),
    }


@pytest.mark.django_db(transaction=True)
def test_a_message_without_a_trace_is_published_in_the_caller_s(traced, db_queue, owner):
    caller = tracing.tracer.start_span("caller's request")
    with trace.use_span(caller, end_on_exit=True):
        [(answer, _)] = group_commit.publish(db_queue, [publishing.prepare("create", 1)])
    [span] = [s for s in traced.get_finished_spans() if s.name == "publish db"]
    assert span.parent.span_id == caller.get_span_context().span_id and not span.links
    assert span.attributes["messaging.message.id"] == str(answer["id"])
