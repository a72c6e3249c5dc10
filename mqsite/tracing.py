"""OpenTelemetry tracing, set up once per process from the standard `OTEL_*` variables.

On when an exporter is named (`OTEL_TRACES_EXPORTER`, other than `none`) or an OTLP endpoint is
set (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: the exporter is then
`otlp`), and `OTEL_SDK_DISABLED` is not `true`. Otherwise off: nothing of OpenTelemetry is
imported, and the span hooks (delivery.spans) find `tracer` None and call straight through.
The specification's default exporter would be `otlp` to localhost, which would have every
`make run` send spans nowhere: here no exporter named means no tracing.

Everything else is the SDK's own reading of the variables: `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES` (the resource), `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*` (the batch
processor), `OTEL_EXPORTER_OTLP_*` (endpoint, headers, timeout), `OTEL_PROPAGATORS` (what the
HTTP and Celery instrumentations read and write; messages carry W3C trace context whatever it
says). `otlp` is OTLP over HTTP/protobuf (the specification's default protocol; gRPC is not
installed); `console` prints spans as JSON to stdout.

Spans never carry a token: ScrubbingExporter blanks them in whatever an instrumentation
recorded (a ?token= query, an Authorization header captured on an operator's request) before
anything leaves the process.
"""

import logging
import re
import threading

from django.conf import settings

from mqsite.log_context import redact

log = logging.getLogger(__name__)

# The tracer of our own spans (delivery.spans); None while tracing is off.
tracer = None

# The default OTEL_SERVICE_NAME of each kind of process (the resource's service.name).
SERVICE_NAMES = {"web": "mqsite-web", "worker": "mqsite-worker"}

_lock = threading.Lock()
_configured = False


class BadTracingSetting(ValueError):
    pass


def wanted(environ=None):
    """Whether the OTEL_* variables (settings.OTEL_ENVIRON) ask for tracing (see the module's
    docstring)."""
    environ = settings.OTEL_ENVIRON if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(_exporter_names(environ))


def _exporter_names(environ):
    named = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if named:
        return [n for n in named if n != "none"]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return ["otlp"] if endpoint else []


def configure(process, environ=None):
    """Set up tracing for this process (`process`: "web" or "worker", the default service
    name), once; nothing when the variables do not ask for it. The web process calls it after
    django.setup() and before its handler loads the middleware (the Django instrumentation
    adds one); a Celery worker at worker_init, before its pool starts (a prefork child keeps
    the setup: the SDK restarts its export thread after a fork)."""
    global tracer, _configured
    environ = settings.OTEL_ENVIRON if environ is None else environ
    with _lock:
        if _configured or not wanted(environ):
            return False
        exporters = [_exporter(name, environ) for name in _exporter_names(environ)]

        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        defaults = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: SERVICE_NAMES[process]}
        provider = TracerProvider(resource=Resource.create(defaults))
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(ScrubbingExporter(exporter)))
        trace.set_tracer_provider(provider)
        _instrument(process, environ)
        tracer = trace.get_tracer("mqsite")
        _configured = True
        log.info("tracing on: %s spans to %s", process, ", ".join(_exporter_names(environ)))
        return True


# What a stopping process waits at most for its last spans to be exported.
FLUSH_SECS = 1


def flush():
    """Export the spans held for the next batch, waiting at most FLUSH_SECS: for a process that
    leaves by os._exit (Daphne's stop, mqsite/workarounds/daphne_shutdown.py), which skips the
    SDK's own flush at exit."""
    if tracer is None:
        return
    from opentelemetry import trace

    trace.get_tracer_provider().force_flush(timeout_millis=FLUSH_SECS * 1000)


def start(process):
    """configure() at a process's start: a setting it cannot serve stops the process with its
    message (as a malformed setting does), rather than a traceback or, in a Celery worker,
    whose signal handlers' errors are logged and passed over, a worker that silently does
    not trace."""
    try:
        return configure(process)
    except BadTracingSetting as exc:
        raise SystemExit(f"mqsite: {exc}") from None


def _exporter(name, environ):
    """An exporter by its OTEL_TRACES_EXPORTER name; BadTracingSetting for one not installed."""
    if name == "otlp":
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", ""
        )
        if protocol not in ("", "http/protobuf"):
            raise BadTracingSetting(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: only http/protobuf is installed "
                "(point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's OTLP/HTTP port, 4318)"
            )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    raise BadTracingSetting(f"OTEL_TRACES_EXPORTER={name}: this server exports to otlp, console or none")


def _instrument(process, environ):
    """The instrumentations of the libraries we use: a span per request (Django), per task and
    its enqueue (Celery: the trace goes on from the web process into the worker's job), per
    SQL statement (psycopg: PostgreSQL only, sync and async connections) and per webhook POST
    (httpx, which also writes the POST's traceparent: the receiver's trace goes on from ours)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

    if process == "web":
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        # Not /metrics nor /healthz unless asked: polled every few seconds, they would drown
        # the traces.
        excluded = environ.get("OTEL_PYTHON_DJANGO_EXCLUDED_URLS", "/metrics,/healthz")
        DjangoInstrumentor().instrument(excluded_urls=excluded)
    CeleryInstrumentor().instrument()
    PsycopgInstrumentor().instrument(enable_commenter=False)
    HTTPXClientInstrumentor().instrument()


# --- tokens never leave the process -------------------------------------------------------------

# Attribute names whose whole value is a secret: captured request and response headers
# (OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*) that authenticate or sign.
_SECRET_HEADERS = ("authorization", "cookie", "token", "signature", "secret", "api-key", "api_key")
# A `name=value` pair whose name says its value is a secret, wherever it stands: a URL's query
# (a websocket's ?token=, a webhook URL's own), a bare query (url.query), an exception's words.
_SECRET_PAIR = re.compile(
    r"(?<![\w.-])((?:[\w.-]*[_.-])?(?:token|apikey|key|secret|password|passwd|signature|sig|auth\w*)=)"
    r"[^&\s#'\"]+",
    re.IGNORECASE,
)
REDACTED = "[redacted]"


def scrub_value(name, value):
    """An attribute's value as it may leave the process."""
    if isinstance(value, str):
        if name.startswith(("http.request.header.", "http.response.header.")) and any(
            s in name for s in _SECRET_HEADERS
        ):
            return REDACTED
        return _SECRET_PAIR.sub(rf"\1{REDACTED}", redact(value))
    if isinstance(value, tuple | list) and value and isinstance(value[0], str):
        return tuple(scrub_value(name, v) for v in value)
    return value


def scrub_attributes(attributes):
    """The attributes with secrets blanked, or None when none held one."""
    if not attributes:
        return None
    clean = {k: scrub_value(k, v) for k, v in attributes.items()}
    # (The SDK keeps a sequence as a tuple, as scrub_value returns it.)
    return None if all(clean[k] == v for k, v in attributes.items()) else clean


def scrub_span(span):
    """The span, or a copy of it with the secrets of its name, attributes, events and status
    blanked."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import Status

    attributes = scrub_attributes(span.attributes)
    events = [(e, scrub_attributes(e.attributes)) for e in span.events]
    name = redact(span.name)
    status = span.status
    if status.description and (words := scrub_value("", status.description)) != status.description:
        status = Status(status.status_code, words)
    if (
        attributes is None
        and all(a is None for _, a in events)
        and name == span.name
        and status is span.status
    ):
        return span
    return ReadableSpan(
        name=name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes if attributes is None else attributes,
        events=[e if a is None else Event(e.name, a, e.timestamp) for e, a in events],
        links=span.links,
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class ScrubbingExporter:
    """Wraps an exporter: each span goes out with its secrets blanked (scrub_span). At export,
    in the batch processor's thread, so that it covers every instrumentation's attributes and
    events, whenever they were set, and costs the request nothing."""

    def __init__(self, exporter):
        self.exporter = exporter

    def export(self, spans):
        return self.exporter.export([scrub_span(s) for s in spans])

    def shutdown(self):
        return self.exporter.shutdown()

    def force_flush(self, timeout_millis=30000):
        return self.exporter.force_flush(timeout_millis)
