"""Fixtures of the analytics tests."""

import pytest

from tests.support.spark import new_session


@pytest.fixture(scope="session")
def spark():
    """The run's one local SparkSession (tests.support.spark), started by the first test that
    asks for it and stopped at the end of the run."""
    session = new_session()
    yield session
    session.stop()
