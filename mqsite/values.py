"""Ground-floor value rules that every layer asks: whether a number could be a row id, whether
a text can be stored. They import no app (and no part of the API), so that the services and the
checks of frames and headers can ask them from any layer."""

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
