"""Ground-floor value rules that every layer asks: whether a number could be a row id, whether
a text can be stored, what time a text names. They import no app (and no part of the API), so
that the services and the checks of frames and headers can ask them from any layer."""

from datetime import UTC

from django.utils import timezone
from django.utils.dateparse import parse_datetime

BIGINT_MAX = 2**63 - 1


def is_db_id(value):
    """Whether `value` could be a row id (ids past the bigint range would make the database
    fail instead of finding nothing)."""
    return isinstance(value, int) and 0 < value <= BIGINT_MAX


def storable_text(text):
    """Whether a database can store this text: no NUL, no lone surrogate (JSON allows both)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# The longest text taken for a time: a time is never longer, and parsing has no bound of its own.
MAX_TIME_CHARS = 64


def iso_time(text):
    """An ISO 8601 date and time (text of at most MAX_TIME_CHARS) as a datetime, UTC when it
    names no offset; None when it is not one (or names no such time: month 13). An offset that
    puts it outside what a datetime holds in UTC is left to the caller (astimezone)."""
    if not isinstance(text, str) or len(text) > MAX_TIME_CHARS:
        return None
    try:
        when = parse_datetime(text.strip())
    except ValueError:  # well formed, but no such time
        return None
    if when is not None and timezone.is_naive(when):
        when = when.replace(tzinfo=UTC)
    return when
