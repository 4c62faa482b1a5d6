"""A DuplexClient that records all it receives (`RecordingClient`), the conversations of
echo turns it holds (`Conversation`: `turn_audio` said with `speak`, `wait_answer`, `drain`)
and the checks of what it received: lost and duplicated events, and audio that is not the
echo of what was said (`check`). Used by the tests that drive sessions through real
processes (tests/e2e, tests/bench) and by the chaos benchmarks (bench/chaos.py and its
native mode, bench/fuzz.py, bench/exhaustion.py, bench/native_failover.py)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import re
import time
from typing import Any

import numpy as np

from plugins.echo.stage import resample_whole
from shared.client.duplex_client import DuplexClient, DuplexClientError
from shared.protocol.duplex import float_to_pcm16, pcm16_to_float

ECHO_MS = re.compile(r"echo (\d+) ms")


def turn_audio(duration_ms: int) -> bytes:
    """A tone whose pitch and length are the turn's own, swelling so that no two of its
    20 ms appends are alike (a missing append shows where it was missing)."""
    t = np.arange(16 * duration_ms) / 16000
    hz = 200 + duration_ms % 997
    swell = 0.15 + 0.15 * t / t[-1]
    return float_to_pcm16((swell * np.sin(2 * np.pi * hz * t)).astype(np.float32))


def expected_echo(pcm: bytes) -> bytes:
    return float_to_pcm16(resample_whole(pcm16_to_float(pcm), 16000, 24000))


class RecordingClient(DuplexClient):
    """A DuplexClient that keeps every frame it received and assembles every response."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frames: list[dict[str, Any]] = []  # as received, duplicates included
        self.delivered: list[dict[str, Any]] = []  # as handed to the application
        self.audio: dict[str, list[bytes]] = {}
        self.transcripts: dict[str, str] = {}
        self.done: list[tuple[str, str, int | None]] = []  # (response id, status, echo ms)
        self.answered: set[int] = set()
        self.received_at: list[float] = []  # monotonic time each delivered frame arrived
        self.completed_at: list[float] = []  # ... of each completed response.done
        self.worker_lost: list[str] = []  # responses that failed with worker_lost
        self.input_lost = 0  # error{input_lost}: commands lost while the session moved
        self.progress = asyncio.Event()
        self.ended: str | None = None  # the code that ended the session, or a client failure

    def _deliver(self, data: dict[str, Any]) -> None:
        self.frames.append(data)
        before = self.last_seq
        super()._deliver(data)
        seq = data.get("server_event_seq")
        if seq is not None and seq <= before:
            return  # dropped by the client as already delivered
        self.delivered.append(data)
        self.received_at.append(time.monotonic())
        kind, response_id = data.get("type"), data.get("response_id")
        if kind == "response.output_audio.delta":
            self.audio.setdefault(response_id, []).append(base64.b64decode(data["delta"]))
        elif kind == "response.output_audio_transcript.done":
            self.transcripts[response_id] = data.get("transcript", "")
        elif kind == "response.done":
            response = data.get("response") or {}
            rid = response.get("id", "")
            match = ECHO_MS.fullmatch(self.transcripts.get(rid, ""))
            ms = int(match.group(1)) if match else None
            self.done.append((rid, response.get("status", ""), ms))
            if response.get("status") == "completed":
                self.completed_at.append(time.monotonic())
                if ms is not None:
                    self.answered.add(ms)
            error = ((response.get("status_details") or {}).get("error") or {}).get("code")
            if response.get("status") == "failed" and error == "worker_lost":
                self.worker_lost.append(rid)
        elif kind == "error" and (data.get("error") or {}).get("code") == "input_lost":
            self.input_lost += 1
        elif kind == "session.closed" and self.ended is None:
            self.ended = closed_reason(self)
        self.progress.set()


@dataclasses.dataclass
class Conversation:
    client: RecordingClient
    index: int
    spoken: dict[int, bytes] = dataclasses.field(default_factory=dict)  # echo ms -> input
    # turns a resume or a worker's loss cut into
    resumed_in: set[int] = dataclasses.field(default_factory=set)
    turns: int = 0
    respoken: int = 0
    ended_by: str | None = None  # "worker_lost", or an unexpected failure
    # a native session's audio is the model's own: only its events are checked
    audio_checked: bool = True


async def speak(client: RecordingClient, pcm: bytes) -> None:
    await client.send({"type": "input_audio_buffer.clear"})
    for i in range(0, len(pcm), 640):
        await client.append_audio(pcm[i : i + 640])
    await client.send({"type": "input.commit"})


def disruptions_of(client: RecordingClient) -> int:
    """What tells a client its turn was cut by a lost worker: its response failed with
    worker_lost, or its input was lost while the session moved."""
    return len(client.worker_lost) + client.input_lost


async def wait_answer(
    client: RecordingClient, duration: int, timeout: float, disruptions: int = 0
) -> bool:
    """True once the turn is answered; False at the timeout, or as soon as a lost worker
    cut the turn (it is spoken again)."""
    deadline = time.monotonic() + timeout
    while duration not in client.answered:
        if client.ended is not None:
            raise DuplexClientError(client.ended, "session ended")
        if disruptions_of(client) > disruptions:
            return False
        client.progress.clear()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            async with asyncio.timeout(remaining):
                await client.progress.wait()
        except TimeoutError:
            return False
    return True


def closed_reason(client: RecordingClient) -> str:
    codes = [
        (f.get("error") or {}).get("code") for f in client.delivered if f.get("type") == "error"
    ]
    return codes[-1] if codes else "session_closed"


async def drain(client: RecordingClient) -> None:
    """Keep the client's event queue empty (the checks read the recorded frames); a resume
    the server refused ends the session for the conversation."""
    try:
        while True:
            await client.recv(timeout=None)
    except DuplexClientError as exc:
        client.ended = client.ended or f"resume refused: {exc.code}"
        client.progress.set()


def check(conversation: Conversation) -> dict[str, Any]:
    """Lost and duplicated events and audio mismatches of one session."""
    client = conversation.client
    seqs = [f["server_event_seq"] for f in client.delivered if "server_event_seq" in f]
    head = max(seqs, default=0)
    cancelled = {rid for rid, status, _ in client.done if status == "cancelled"}
    missing = [
        seq
        for seq in sorted(set(range(1, head + 1)) - set(seqs))
        if not cancelled_audio(client, seq, cancelled)
    ]
    lost = len(missing)
    duplicated = len(seqs) - len(set(seqs))
    by_id: dict[str, set[int]] = {}
    for frame in client.frames:
        if "server_event_seq" in frame and frame.get("event_id"):
            by_id.setdefault(frame["event_id"], set()).add(frame["server_event_seq"])
    duplicated += sum(len(s) - 1 for s in by_id.values())
    created = [f["response"]["id"] for f in client.delivered if f["type"] == "response.created"]
    duplicated += len(created) - len(set(created))
    done_ids = [rid for rid, _, _ in client.done]
    duplicated += len(done_ids) - len(set(done_ids))
    mismatched = partial = 0
    for rid, status, ms in client.done:
        if status != "completed" or not conversation.audio_checked:
            continue
        audio = b"".join(client.audio.get(rid, []))
        pcm = conversation.spoken.get(ms) if ms is not None else None
        if pcm is not None and audio == expected_echo(pcm):
            continue
        if ms is not None and answers_a_cut_turn(conversation, ms, audio):
            partial += 1
        else:
            mismatched += 1
    return {
        "lost": lost,
        "missing": missing[:5],
        "duplicated": duplicated,
        "mismatched": mismatched,
        "partial": partial,
        "events": head,
    }


def cancelled_audio(client: RecordingClient, seq: int, cancelled: set[str]) -> bool:
    """Whether a seq the client never got was audio of a response that ended cancelled:
    an API pod drops the still-queued audio deltas of a cancelled response (the seed's
    output policy: a barge-in must not keep playing), so their seqs never reach the client.
    Known by its neighbours: the events just before and after it belong to that response."""
    sequenced = [f for f in client.delivered if f.get("server_event_seq")]  # not errors
    before = max(
        (f for f in sequenced if f["server_event_seq"] < seq),
        key=lambda f: f["server_event_seq"],
        default=None,
    )
    after = min(
        (f for f in sequenced if f["server_event_seq"] > seq),
        key=lambda f: f["server_event_seq"],
        default=None,
    )
    return any(f is not None and f.get("response_id") in cancelled for f in (before, after))


def around(client: RecordingClient, seq: int) -> str:
    """What the client got around a lost seq (a clue for whoever reads the failure)."""
    got = [f.get("type") for f in client.frames if f.get("server_event_seq") == seq]
    before = [
        f"{f.get('server_event_seq')}:{f.get('type')}"
        for f in client.delivered
        if seq - 3 <= (f.get("server_event_seq") or 0) <= seq + 3
    ]
    statuses = {rid: status for rid, status, _ in client.done}
    near = {
        f.get("response_id"): statuses.get(f.get("response_id"))
        for f in client.delivered
        if seq - 3 <= (f.get("server_event_seq") or 0) <= seq + 3 and f.get("response_id")
    }
    return f"received as {got or 'nothing'}; delivered around it: {before}; responses {near}"


def answers_a_cut_turn(conversation: Conversation, ms: int, audio: bytes) -> bool:
    """Whether `audio` (an answer naming `ms`) is the echo of a turn a resume cut into,
    less one contiguous run of its 20 ms appends: the ones written to the socket of the
    pod that was killed. Client input in flight is not journaled (docs/reliability.md);
    what the server did accept must still come back exactly."""
    for duration in conversation.resumed_in:
        missing, rest = divmod(duration - ms, 20)
        if missing <= 0 or rest:
            continue
        chunks = [conversation.spoken[duration][i : i + 640] for i in range(0, 32 * duration, 640)]
        for start in range(len(chunks) - missing + 1):
            kept = b"".join(chunks[:start] + chunks[start + missing :])
            if audio == expected_echo(kept):
                return True
    return False
