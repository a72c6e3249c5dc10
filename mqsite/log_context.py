"""What a log line is about, and the words it must never hold.

Every line any process logs passes two filters (settings.LOGGING): `Context` adds the ids of the
request, subscriber, message and delivery being served, from context variables that the code
serving them binds (`bound()`), so that one request's lines, or one delivery's, can be found
among thousands; `Redact` blanks tokens and webhook secrets wherever a line holds one. With
MQ_LOG_FORMAT=json each line is one JSON object (python-json-logger) with those ids as fields.

Context variables, because a Daphne process serves many connections at once on one event loop
(each socket's consumer is a task of its own, which gets its own copy) and REST requests in
threads (mqsite.asgi_handler runs each inside the context it was received in).
"""

import contextlib
import contextvars
import logging
import logging.config
import re

from pythonjsonlogger import json as jsonlogger

# The ids a line may carry, as the record's attributes and the JSON's fields.
FIELDS = ("request_id", "task_id", "subscriber", "message_id", "delivery_id")

_vars = {name: contextvars.ContextVar(name, default=None) for name in FIELDS}


@contextlib.contextmanager
def bound(**ids):
    """Log lines within carry these ids (of FIELDS); the outer ones come back after."""
    tokens = [(_vars[name], _vars[name].set(value)) for name, value in ids.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def bind(**ids):
    """Set ids for the rest of this context (a task or a request thread of its own)."""
    for name, value in ids.items():
        _vars[name].set(value)


def current(name):
    return _vars[name].get()


class Context(logging.Filter):
    """Adds FIELDS to every record (None when unbound), so that a format may name them."""

    def filter(self, record):
        for name, var in _vars.items():
            if not hasattr(record, name):
                setattr(record, name, var.get())
        return True


# A token (subscribers.tokens: "mq_" and 43 url-safe characters) or a webhook secret ("whsec_"
# and base64): what a careless line (an exception's text, a URL with ?token=) could hold.
_SECRET = re.compile(r"\b(mq_|whsec_)[A-Za-z0-9_\-+/=]{8,}")


def redact(text):
    return _SECRET.sub(r"\1[redacted]", text)


class Redact(logging.Filter):
    """Blanks secrets in the line as it will be written: its message with its arguments, and
    its exception's text."""

    def filter(self, record):
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


class JsonFormatter(jsonlogger.JsonFormatter):
    """One JSON object per line: time, level, logger and message, and of FIELDS those bound."""

    def add_fields(self, log_data, record, message_dict):
        super().add_fields(log_data, record, message_dict)  # with every extra, FIELDS included
        # Django's request log passes the request object itself (for its mail handler): its
        # repr is the URL, query and all, which may hold a token; the request id names it.
        log_data.pop("request", None)
        for name in FIELDS:
            if log_data.get(name) is None:
                log_data.pop(name, None)
        for name, value in log_data.items():  # any other extra a line was given
            if isinstance(value, str):
                log_data[name] = redact(value)


def configure(config):
    """settings.LOGGING_CONFIG: Django's dictConfig, and Python's warnings logged as lines too
    (py.warnings), so that they come in the same format."""
    logging.config.dictConfig(config)
    logging.captureWarnings(True)
