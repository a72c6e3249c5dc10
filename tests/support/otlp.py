"""A small OTLP/HTTP trace receiver on loopback, as a collector is to the server's exporter: it
decodes each export (protobuf, opentelemetry-proto) and keeps every span, and the raw bytes (a
test looks for a token anywhere in them, attribute or not)."""

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan


@dataclass
class Span:
    service: str
    name: str
    kind: str  # "PRODUCER", "CONSUMER", "SERVER", ...
    trace_id: str  # hex, as a traceparent writes it
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    links: list  # [(trace id, span id)]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Collector:
    def __init__(self):
        self.spans = []
        self.raw = []  # every export's bytes, as received (after gzip)
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    collector.raw.append(body)
                    collector.spans += list(_spans_of(request))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self):
        """The variables that point a server process's traces here, exported within 0.1 s."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def named(self, name):
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _spans_of(request):
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                yield Span(
                    service=resource.get("service.name", ""),
                    name=s.name,
                    kind=ProtoSpan.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                )
