"""The chaos runs' sessions: their session object, timeouts and worker counts, and the loop
that talks one conversation of echo turns until the run ends (`converse`), shared by
bench/chaos.py, its native mode (bench/chaos_native.py) and the other benchmarks that drive
sessions the same way. The client, its conversations and the checks of what it received are
harness/recording_client.py's (the tests use them too)."""

from __future__ import annotations

import asyncio
import time

from harness.recording_client import (
    Conversation,
    RecordingClient,
    disruptions_of,
    speak,
    turn_audio,
    wait_answer,
)
from shared.client.duplex_client import DuplexClientError

SESSION = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "extra_body": {"pace": 4},
}
# api mode: a resume takes well under a second, an answer at 4x real time half a second.
# worker modes: a lost worker is noticed after its heartbeat TTL (5 s) + a janitor tick,
# or when it restarts; a drain waits for the response in flight.
ANSWER_TIMEOUT_S = {"api": 5.0, "kill": 15.0, "rolling": 15.0}
WORKERS = {"api": 2, "kill": 3, "rolling": 3}
SEND_TIMEOUT_S = 30.0


async def converse(
    conversation: Conversation,
    deadline: float,
    answer_timeout: float,
    until: asyncio.Event | None = None,
) -> None:
    """Turns until the deadline, and past it until `until` is set (the chaos finished
    what it must do under talking sessions, however slow the machine)."""
    client = conversation.client
    next_ms = 200 + 20 * (conversation.index % 7)
    try:
        while time.monotonic() < deadline or (until is not None and not until.is_set()):
            duration = next_ms
            next_ms += 20
            pcm = turn_audio(duration)
            conversation.spoken[duration] = pcm
            resumes, disruptions = client.resumes, disruptions_of(client)
            # a send waits while the client resumes; one that never returns is a failure
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await speak(client, pcm)
            answered = await wait_answer(client, duration, answer_timeout, disruptions)
            cut = client.resumes > resumes or disruptions_of(client) > disruptions
            if cut:
                conversation.resumed_in.add(duration)
            if answered:
                conversation.turns += 1
            elif cut:
                conversation.respoken += 1  # its input went down with a killed pod or worker
            else:
                conversation.ended_by = f"turn of {duration} ms never answered"
                return
    except ENDINGS as exc:
        conversation.ended_by = ended_by(exc, client)


#: what ends a conversation's client early (`ended_by` says it)
ENDINGS = (DuplexClientError, TimeoutError, ConnectionError)


def ended_by(exc: BaseException, client: RecordingClient) -> str:
    """Why a conversation ended early, from what its client raised (one of `ENDINGS`)."""
    if isinstance(exc, DuplexClientError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return client.ended or "a send never completed"
    return f"connection: {exc}"
