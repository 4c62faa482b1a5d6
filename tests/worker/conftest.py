"""Fixtures of the worker's session tests: one session's parts, without a runner."""

import pytest

from tests.worker.session_parts import close_parts, make_parts

#: server VAD with round numbers: speech starts after 2 loud 32 ms frames, stops after 2 quiet
VAD_SESSION = {
    "turn_detection": {
        "type": "server_vad",
        "prefix_padding_ms": 0,
        "min_speech_duration_ms": 64,
        "silence_duration_ms": 64,
    },
    "extra_body": {"pace": 0},
}


@pytest.fixture
async def parts():
    made = await make_parts()
    yield made
    await close_parts(made)


@pytest.fixture
async def vad_parts():
    made = await make_parts(VAD_SESSION, vad=True)
    yield made
    await close_parts(made)


@pytest.fixture
async def parts_for():
    """Session parts for a session object (unpaced) and a plugin; closed at the end."""
    made = []

    async def make(session, plugin, *, vad=False, state=None):
        parts = await make_parts(
            {"extra_body": {"pace": 0}, **session}, vad=vad, plugin=plugin, state=state
        )
        made.append(parts)
        return parts

    yield make
    for parts in made:
        await close_parts(parts)
