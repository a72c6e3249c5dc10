"""The one rule for queue and event names (docs/index.md, "Words")."""

import re

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
# What a client may send, before it is lower-cased: the API's schema publishes this pattern,
# so it must be exactly what clean_name accepts (ASCII only, no surrounding blanks).
INPUT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
INPUT_RE = re.compile(rf"\A{INPUT_PATTERN}\Z")
# The same rule for OpenAPI, whose patterns are ECMA regular expressions (no \A, \Z).
SCHEMA_PATTERN = f"^{INPUT_PATTERN}$"
NAME_HELP = "names are 1 to 64 characters of a-z, 0-9, '_', '.' and '-', starting with a letter or digit"


class BadName(ValueError):
    pass


def clean_name(value, what="name"):
    """Check a queue or event name and lower-case it; BadName says what is wrong."""
    if not isinstance(value, str):
        raise BadName(f"{what} must be a string")
    if not INPUT_RE.match(value):
        raise BadName(f"{what} {value!r} is not valid: {NAME_HELP}")
    return value.lower()
