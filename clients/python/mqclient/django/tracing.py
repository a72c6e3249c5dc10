"""The current trace context (W3C traceparent, tracestate) into a message's headers, when
OpenTelemetry is installed and a span is active; nothing otherwise."""

from __future__ import annotations

try:
    from opentelemetry import propagate
except ImportError:  # OpenTelemetry is optional
    propagate = None

TRACE_HEADERS = ("traceparent", "tracestate")


def with_trace_context(headers: dict[str, str] | None) -> dict[str, str] | None:
    if propagate is None or (headers and "traceparent" in headers):
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    found = {k: v for k, v in carrier.items() if k in TRACE_HEADERS}
    return {**found, **(headers or {})} if found else headers
