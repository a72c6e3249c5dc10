"""Headers: names and string values a message may carry beside its payload (trace context, a
tenant, a content type), as the API's Extensions section states them.

Checked here once, for every way in (REST, the socket, `manage.py publish`, the admin), and
stored as their JSON text as sent, like the payload: a message without headers stores NULL and
its deliveries carry no `headers` key at all, so a client that uses none sees nothing new.
"""

import json
import re

from mqsite.values import storable_text

NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
NAME_RE = re.compile(rf"\A{NAME_PATTERN}\Z")
SCHEMA_NAME_PATTERN = f"^{NAME_PATTERN}$"  # for OpenAPI (ECMA: no \A, \Z)
NAME_HELP = "header names are 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-'"
MAX_HEADERS = 64
# "8 KiB in all": the UTF-8 bytes of every name and value together (no JSON quoting counted).
MAX_HEADERS_BYTES = 8192
# A value alone can be at most this long in characters (a name takes at least one byte): the
# bound the schema can state, where it cannot state the sum.
MAX_VALUE_CHARS = MAX_HEADERS_BYTES - 1


_AS_STORED = {"ensure_ascii": False, "separators": (",", ":")}


class BadHeaders(ValueError):
    """Headers that cannot be published as given (the caller answers 400 naming `headers`)."""


def encode_headers(headers):
    """The JSON text to store for these headers, or None when there are none (absent, null or
    an empty object). BadHeaders says what is wrong, in words a person reads."""
    if headers is None:
        return None
    if not isinstance(headers, dict):
        raise BadHeaders("headers must be an object of names to text values")
    if not headers:
        return None
    if len(headers) > MAX_HEADERS:
        raise BadHeaders(f"{len(headers)} headers, over the limit of {MAX_HEADERS}")
    size = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise BadHeaders(f"header name {_short(name)} is not valid: {NAME_HELP}")
        if not isinstance(value, str):
            raise BadHeaders(f"header {name!r} must be text, not {type(value).__name__}")
        # Databases cannot store NUL in text, nor a lone surrogate as UTF-8: refuse, don't fail.
        if not storable_text(value):
            raise BadHeaders(f"header {name!r} may not contain NUL or invalid Unicode")
        size += len(name) + len(value.encode("utf-8"))  # a valid name is ASCII: one byte each
        if size > MAX_HEADERS_BYTES:
            break
    if size > MAX_HEADERS_BYTES:
        raise BadHeaders(
            f"headers are over {MAX_HEADERS_BYTES} bytes (UTF-8 of every name and value together)"
        )
    return json.dumps(headers, **_AS_STORED)


def headers_of_pairs(pairs):
    """Headers from NAME=VALUE texts (`manage.py publish --header`, the admin's test publish):
    split at the first '=', so a value may hold '='; a name given twice is refused rather than
    one of its values dropped. encode_headers() checks the rest."""
    headers = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise BadHeaders(f"{_short(pair)} is not NAME=VALUE")
        if name in headers:
            raise BadHeaders(f"header {_short(name)} is given twice")
        headers[name] = value
    return headers


def stored_pair(name, value):
    """One header as the stored text holds it ("name":"value"): what a search for exactly
    that header looks for."""
    return json.dumps({name: value}, **_AS_STORED)[1:-1]


def decode_headers(text):
    """The stored text back as the object sent; None when the message has none."""
    return json.loads(text) if text else None


def _short(name):
    text = repr(name) if isinstance(name, str) else f"of type {type(name).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."
