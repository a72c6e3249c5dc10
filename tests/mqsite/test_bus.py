"""The bus (mqsite.bus): one send(kind, ids), one on(kind, fn), heard here at once and by the
other processes through Redis. Its words in the services mode are in test_wakeups.py; these are
the rules every kind shares, with a kind of the test's own."""

import pytest

from mqsite import bus

KIND = "test-word"


@pytest.fixture
def heard(settings):
    """What a listener and a blocking listener of KIND hear, in order."""
    heard = []
    bus.on(KIND, lambda ids, source: heard.append(("listener", ids, source)))
    bus.on(KIND, lambda ids, source: heard.append(("blocking", ids, source)), blocking=True)
    bus.client.cache_clear()
    yield heard
    bus._listeners.pop(KIND, None)
    bus.client.cache_clear()


def test_without_redis_a_word_is_heard_here_at_once_then_by_the_blocking_listeners(settings, heard):
    settings.REDIS_URL = ""
    bus.send(KIND, (i for i in (3, 1, 2)))
    assert heard == [("listener", [3, 1, 2], bus.SENT), ("blocking", [3, 1, 2], bus.SENT)]


def test_a_word_of_nothing_is_not_said(settings, heard):
    settings.REDIS_URL = ""
    bus.send(KIND, [])
    bus.send_after_commit(KIND, set())
    assert heard == []


def test_a_word_whose_publish_fails_is_heard_as_the_echo_that_will_not_come(settings, heard):
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens there: the PUBLISH is refused
    bus.send(KIND, [7])
    assert heard == [
        ("listener", [7], bus.SENT),
        ("listener", [7], bus.ECHO),  # what the echo does (a shared subscriber's sockets) is done
        ("blocking", [7], bus.SENT),
    ]


def test_words_that_wait_to_be_sent_go_together_one_per_kind():
    words = [(bus.WAKE, [1, 2]), (bus.SETTLED, [9]), (bus.WAKE, [2, 3])]
    assert bus._merged(words) == [(bus.WAKE, [1, 2, 3]), (bus.SETTLED, [9])]
