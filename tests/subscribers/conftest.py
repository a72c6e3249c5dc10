import pytest

from subscribers.throttling import counters


@pytest.fixture(autouse=True)
def _no_failures_counted():
    """The failed-token counts are this process's: a test starts and ends without any."""
    counters().clear()
    yield
    counters().clear()
