"""Fixtures shared by the whole suite."""

import pytest

from tests.sessions import make_harness


@pytest.fixture
async def harness():
    """A SessionManager with the echo model (max 4 sessions) and an inline client."""
    h = make_harness()
    yield h
    await h.manager.shutdown()
