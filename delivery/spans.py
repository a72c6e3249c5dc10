"""Our own OpenTelemetry spans: publish, deliver and ack, each continuing the trace its message
carries (its `traceparent` and `tracestate` headers, W3C Trace Context).

Each is a decorator, one line at the site it traces. While tracing is off (mqsite.tracing:
no OTEL_* exporter) a decorated call costs one check of `tracing.tracer` and goes straight
through; nothing of OpenTelemetry is imported.

OpenTelemetry's messaging conventions: span names "{operation} {queue}", attributes
`messaging.system` (mqsite), `messaging.destination.name` (the queue),
`messaging.operation.name` (publish, deliver, ack), `messaging.operation.type` (send,
process, settle: the conventions' current names for publish, deliver and settle) and
`messaging.message.id`; ours beside them: `mq.delivery.id`, `mq.transport` (rest, socket,
pull, webhook) and `messaging.consumer.group.name`, the subscriber. Kinds: publish PRODUCER,
deliver and ack CONSUMER.

- publish: a span around the publish call (its commit included), child of the message's trace
  (of the first message's, in a batch; the others' and the caller's own trace, e.g. the HTTP
  request's, are links).
- deliver: a span per delivery handed out (a socket frame, a pull, a webhook POST), child of
  its message's trace. A webhook POST is made inside it, so that the httpx span, and the
  traceparent the POST carries, continue the message's trace (its tracestate kept).
- ack: a span per acknowledged delivery, child of its message's trace, spanning the ack call.
  The ack knows only ids: the message, queue and trace headers of each are read after it, in
  one query (only while tracing is on).
"""

import contextlib
import contextvars
import functools
import json
import logging
import time

from mqsite import adb, tracing
from queues.models import Message, Queue

from .models import Delivery

log = logging.getLogger(__name__)

SYSTEM = "mqsite"
TRACE_HEADERS = ("traceparent", "tracestate")  # as delivery.webhooks sends them

# Set while a decorated call runs: the same operation's sync twin inside it (the async one run
# in a thread, in the embedded mode) records nothing more.
_inside = contextvars.ContextVar("inside", default=False)


@contextlib.contextmanager
def _outermost():
    held = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(held)


@contextlib.contextmanager
def _never_failing():
    """Recording spans after an operation never fails it (it has happened): an error is logged."""
    try:
        yield
    except Exception:
        log.warning("spans not recorded", exc_info=True)


# --- the message's trace ----------------------------------------------------------------------


def context_of(headers):
    """The trace context a message's headers (a dict) carry, or None (none, or not valid)."""
    if not headers or not isinstance(headers.get("traceparent"), str):
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k: headers[k] for k in TRACE_HEADERS if isinstance(headers.get(k), str)}
    context = TraceContextTextMapPropagator().extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def _context_of_json(headers_json):
    if not headers_json or "traceparent" not in headers_json:
        return None
    return context_of(json.loads(headers_json))


def _attributes(operation, queue, **more):
    kinds = {"publish": "send", "deliver": "process", "ack": "settle"}
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": queue,
        "messaging.operation.name": operation,
        "messaging.operation.type": kinds[operation],
    }
    attributes.update((k, v) for k, v in more.items() if v is not None)
    return attributes


def _links(contexts, also_current=False):
    from opentelemetry import trace

    seen, links = set(), []
    spans = [trace.get_current_span()] if also_current else []
    spans += [trace.get_current_span(c) for c in contexts]
    for span in spans:
        sc = span.get_span_context()
        if sc.is_valid and (sc.trace_id, sc.span_id) not in seen:
            seen.add((sc.trace_id, sc.span_id))
            links.append(trace.Link(sc))
    return links


# --- publish ------------------------------------------------------------------------------------


def _publish_span(queue, outgoing, transport):
    from opentelemetry import trace

    contexts = [c for o in outgoing if (c := _context_of_json(o.headers_json)) is not None]
    parent = contexts[0] if contexts else None
    return tracing.tracer.start_as_current_span(
        f"publish {queue.name}",
        context=parent,
        kind=trace.SpanKind.PRODUCER,
        links=_links(contexts[1:], also_current=parent is not None),
        attributes=_attributes(
            "publish",
            queue.name,
            **{
                "mq.transport": transport,
                "messaging.batch.message_count": len(outgoing) if len(outgoing) > 1 else None,
            },
        ),
    )


def _published(span, answers):
    if len(answers) == 1:
        span.set_attribute("messaging.message.id", str(answers[0][0]["id"]))


def published(transport):
    """Decorates a publish(queue, outgoing, ...) that returns [(answer, created)]."""

    def decorate(fn):
        @functools.wraps(fn)
        def traced(queue, outgoing, *args, **kwargs):
            if tracing.tracer is None or _inside.get() or not outgoing:
                return fn(queue, outgoing, *args, **kwargs)
            with _publish_span(queue, outgoing, transport) as span, _outermost():
                answers = fn(queue, outgoing, *args, **kwargs)
                _published(span, answers)
                return answers

        return traced

    return decorate


def apublished(transport):
    """published() of an async publish."""

    def decorate(fn):
        @functools.wraps(fn)
        async def traced(queue, outgoing, *args, **kwargs):
            if tracing.tracer is None or not outgoing:
                return await fn(queue, outgoing, *args, **kwargs)
            with _publish_span(queue, outgoing, transport) as span, _outermost():
                answers = await fn(queue, outgoing, *args, **kwargs)
                _published(span, answers)
                return answers

        return traced

    return decorate


# --- deliver ------------------------------------------------------------------------------------


def _about(delivery):
    """(delivery id, message id, queue, headers) of a leased delivery: a dict as the ledger
    gives it, or one with its frame as text (a socket's framed lease)."""
    if delivery.get("frame") is not None:
        delivery = json.loads(delivery["frame"])
    return delivery["id"], delivery["message_id"], delivery["queue"], delivery.get("headers")


def _record(operation, transport, subscriber, abouts, start, end):
    """A span per delivery (its `_about`), from `start` to `end` (ns), each child of its
    message's trace (or of the current span, for a message without one)."""
    from opentelemetry import trace

    current = trace.get_current_span()
    for delivery_id, message_id, queue, headers in abouts:
        parent = context_of(headers)
        span = tracing.tracer.start_span(
            f"{operation} {queue}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            links=_links([], also_current=True) if parent is not None and current.is_recording() else (),
            attributes=_attributes(operation, queue, **_ids(transport, subscriber, delivery_id, message_id)),
            start_time=start,
        )
        span.end(end_time=end)


def _ids(transport, subscriber, delivery_id, message_id):
    return {
        "mq.transport": transport,
        "messaging.consumer.group.name": getattr(subscriber, "name", None),
        "mq.delivery.id": delivery_id,
        "messaging.message.id": str(message_id),
    }


def sent_frames(fn):
    """Decorates a socket's send_deliveries(consumer, leased): a deliver span per delivery sent."""

    @functools.wraps(fn)
    async def traced(consumer, leased, *args, **kwargs):
        if tracing.tracer is None or not leased:
            return await fn(consumer, leased, *args, **kwargs)
        start = time.time_ns()
        try:
            return await fn(consumer, leased, *args, **kwargs)
        finally:
            with _never_failing():
                abouts = [_about(d) for d in leased]
                _record("deliver", "socket", consumer.subscriber, abouts, start, time.time_ns())

    return traced


def pulled(subscriber):
    """Decorates a pull's lease(...) that returns the deliveries it leased: a deliver span each."""

    def decorate(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if tracing.tracer is None:
                return fn(*args, **kwargs)
            start = time.time_ns()
            leased = fn(*args, **kwargs)
            with _never_failing():
                _record("deliver", "pull", subscriber, [_about(d) for d in leased], start, time.time_ns())
            return leased

        return traced

    return decorate


def posted(fn):
    """Decorates a webhook post(subscriber, delivery, client): the POST inside a deliver span,
    child of the message's trace, so that the httpx span and the POST's traceparent go on
    from it."""

    @functools.wraps(fn)
    def traced(subscriber, delivery, *args, **kwargs):
        if tracing.tracer is None:
            return fn(subscriber, delivery, *args, **kwargs)
        from opentelemetry import trace

        delivery_id, message_id, queue, headers = _about(delivery)
        with tracing.tracer.start_as_current_span(
            f"deliver {queue}",
            context=context_of(headers),
            kind=trace.SpanKind.CONSUMER,
            attributes=_attributes("deliver", queue, **_ids("webhook", subscriber, delivery_id, message_id)),
        ) as span:
            outcome = fn(subscriber, delivery, *args, **kwargs)
            if outcome.status is not None:
                span.set_attribute("http.response.status_code", outcome.status)
            if not outcome.ok:
                span.set_status(trace.StatusCode.ERROR, outcome.error[:200])
            return outcome

    return traced


# --- ack ----------------------------------------------------------------------------------------


def _of_deliveries(ids):
    """Sans I/O (mqsite.adb): (delivery id, message id, queue, headers) of each of `ids`."""
    if not ids:
        return []
    of_ids, params = adb.one_of("d.id", ids)
    rows = yield (
        f"""
        SELECT d.id, d.message_id, q.name, m.headers_json
        FROM {Delivery._meta.db_table} d
        JOIN {Message._meta.db_table} m ON m.id = d.message_id
        JOIN {Queue._meta.db_table} q ON q.id = m.queue_id
        WHERE {of_ids}
        """,
        params,
    )
    return [(d, m, q, json.loads(h) if h else None) for d, m, q, h in rows]


def acked(transport):
    """Decorates ack_deliveries(subscriber, ids, ...) -> (acked, unknown): an ack span per
    delivery of `ids` that is the subscriber's."""

    def decorate(fn):
        @functools.wraps(fn)
        def traced(subscriber, ids, *args, **kwargs):
            if tracing.tracer is None or _inside.get() or not ids:
                return fn(subscriber, ids, *args, **kwargs)
            start = time.time_ns()
            with _outermost():
                result = fn(subscriber, ids, *args, **kwargs)
            end = time.time_ns()
            mine = [i for i in ids if i not in set(result[1])]
            with _never_failing():
                _record("ack", transport, subscriber, adb.run_sync(_of_deliveries(mine)), start, end)
            return result

        return traced

    return decorate


def aacked(transport):
    """acked() of the async ack (above its adb.twin: in the embedded mode too)."""

    def decorate(fn):
        @functools.wraps(fn)
        async def traced(subscriber, ids, *args, **kwargs):
            if tracing.tracer is None or not ids:
                return await fn(subscriber, ids, *args, **kwargs)
            start = time.time_ns()
            with _outermost():
                result = await fn(subscriber, ids, *args, **kwargs)
            end = time.time_ns()
            mine = [i for i in ids if i not in set(result[1])]
            with _never_failing():
                _record("ack", transport, subscriber, await _arows(_of_deliveries(mine)), start, end)
            return result

        return traced

    return decorate


async def _arows(op):
    if adb.enabled():
        return await adb.run(op)
    return await adb.thread(adb.run_sync)(op)


def settled(fn):
    """Decorates settle_posts(subscriber, posted, ...): an ack span per successful POST."""

    @functools.wraps(fn)
    def traced(subscriber, posts, *args, **kwargs):
        if tracing.tracer is None or _inside.get():
            return fn(subscriber, posts, *args, **kwargs)
        start = time.time_ns()
        with _outermost():
            result = fn(subscriber, posts, *args, **kwargs)
        end = time.time_ns()
        ok = [p.delivery_id for p in posts if p.ok]
        if ok:
            with _never_failing():
                _record("ack", "webhook", subscriber, adb.run_sync(_of_deliveries(ok)), start, end)
        return result

    return traced
