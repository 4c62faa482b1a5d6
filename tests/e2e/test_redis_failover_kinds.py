"""Redis failing over under sessions of every kind, with real processes: two `duplex api`
pods, two echo (cascade) workers and a native frame-model worker
(harness.frame_models:EchoFramePlugin) on a `redis+sentinel://` URL (a primary, its replica,
three sentinels), the primary SIGKILLed while

- a cascade session takes echo turns (duplex surface, 4x real time);
- a native session takes turns of its own: each utterance a tone of its own pitch, said
  back by the frame model (the pitch of the answer names the turn it answers);
- a resume is in progress: a client whose connection was dropped (its pod wrote the
  detach) before the kill resumes while no primary is named, a response of its having
  gone on meanwhile;
- a drain is in progress: the owner of a session playing a long response was SIGTERMed and
  said so in its registration before the kill; the session moves to the other echo worker.

No session may close; every session must talk again (a turn spoken after the kill
answered) before a generous deadline; no client may see an event seq twice or going
backwards, nor miss one silently; the resumed client gets every event it missed, once and
in order, or is told `session.resync_required`; the drained session ends up on the other
worker. The figures (kill to promotion, kill to each kind talking again, the resume's
outcome, refused turns, the processes' WARNING, ERROR and Traceback lines) are printed
(`pytest -s` shows them), never asserted. The same failover under cascade sessions only,
and the helpers this test shares: tests/e2e/test_redis_failover.py."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import time
import uuid
from typing import Any

import numpy as np

from bench.chaos_sessions import ENDINGS, SESSION, ended_by
from harness.frame_models import FRAME_SAMPLES, RATE, tone
from harness.processes import Process, start_api, start_worker
from harness.recording_client import Conversation, RecordingClient, check, disruptions_of
from harness.redis_sentinel import RedisSentinelSet
from shared.protocol.duplex import pcm16_to_float
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from tests.e2e import waits
from tests.e2e.failover_figures import log_figures, record, seconds_after, session_figures
from tests.e2e.native_moves import CHECKOUT
from tests.e2e.test_frame_clocked import PLUGIN, send_pcm
from tests.e2e.test_redis_failover import (
    RECOVERY_TIMEOUT_S,
    SEND_TIMEOUT_S,
    Talker,
    count_lines,
    errors_of,
    receive,
    stop_talking,
    strictly_increasing,
    talk,
    until,
    wait_turn,
)
from tests.e2e.test_worker_moves import REAL_TIME, answered_turn, response_playing
from tests.redis.test_sentinel import close, promotion

CASCADE = {"model": "echo", **SESSION}
#: answered in real time, so a long turn keeps a response in flight across the kill
CASCADE_REAL_TIME = {"model": "echo", **REAL_TIME}
NATIVE = {"model": "frame_echo"}
#: the native turns' pitches: apart by more than the analysis can confuse
PITCH_STEP_HZ = 40
PITCHES = [320 + PITCH_STEP_HZ * i for i in range(10)]
#: the resumed and drained sessions' long turns: 10 ms off the 20 ms grid the talking
#: loop's turns are on, so no later turn has the same length (its answer names its length)
RESUMED_TURN_MS = 3010
DRAINED_TURN_MS = 6010


def utterance(pitch_hz: int) -> np.ndarray:
    """Half a second of a tone, then a second of quiet (whole frames: the next utterance
    starts on a frame), which the frame model says back and then stops."""
    return np.concatenate([tone(6, freq_hz=pitch_hz), np.zeros(13 * FRAME_SAMPLES, np.float32)])


def pitch_of(pcm: bytes) -> int:
    """The strongest frequency of a response's audio, to the nearest pitch step."""
    samples = pcm16_to_float(pcm)
    spectrum = np.abs(np.fft.rfft(samples))
    hz = (int(np.argmax(spectrum[1:])) + 1) * RATE / samples.size
    return round(hz / PITCH_STEP_HZ) * PITCH_STEP_HZ


class NativeClient(RecordingClient):
    """A native session's recording client: a completed response is an answer to the turn
    of its pitch (`answered` holds pitches, as it holds echo lengths for a cascade one)."""

    def _deliver(self, data: dict[str, Any]) -> None:
        super()._deliver(data)
        response = data.get("response") or {}
        if data.get("type") == "response.done" and response.get("status") == "completed":
            audio = b"".join(self.audio.get(response.get("id", ""), []))
            if audio:
                self.answered.add(pitch_of(audio))


class HeldResume(RecordingClient):
    """A client whose reconnections wait for `resume_allowed`: its connection can be
    dropped before the primary is killed and its resume sent only after."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_allowed = asyncio.Event()
        self.resume_dials = 0  # tries to resume (a try refused while Redis fails over: more)

    async def _dial(self, resume: bool) -> Any:
        if resume:
            await self.resume_allowed.wait()
            self.resume_dials += 1
        return await super()._dial(resume)


async def talk_natively(talker: Talker, stop: asyncio.Event) -> None:
    """Utterances of the next pitch, each once the last was answered, refused (an error
    since it began: the pod could not write it) or left unanswered, until `stop`. A native
    client sends nothing but appends, so no commit ends a failing run of them: the pod tells
    it again every 2 s while they fail (an utterance may still go unanswered when its
    appends failed between two tellings)."""
    client = talker.client
    for turn in itertools.count():
        if stop.is_set():
            return
        pitch = PITCHES[turn % len(PITCHES)]
        client.answered.discard(pitch)  # an answer to an earlier turn of this pitch
        errors, spoken = errors_of(client), time.monotonic()
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await send_pcm(client, utterance(pitch))
            outcome = await wait_turn(client, pitch, errors)
        except ENDINGS as exc:
            talker.conversation.ended_by = ended_by(exc, client)
            return
        if outcome == "answered":
            talker.conversation.turns += 1
            talker.answered.append((spoken, time.monotonic()))
        else:
            talker.conversation.respoken += 1
            talker.refused += outcome == "refused"
            talker.unanswered += outcome == "unanswered"
            if outcome == "refused":
                await asyncio.sleep(0.2)  # pacing the retries, as `talk` does


async def after_long_turn(
    talker: Talker, ms: int, stop: asyncio.Event, answered: list[float]
) -> None:
    """Wait for the long turn's answer (the drain lets the response finish before the
    session moves; `answered` gets when it came) or its loss (the response failed, input
    lost), then take turns as the others do."""
    client = talker.client
    lost = disruptions_of(client)
    await until(
        lambda: ms in client.answered or client.ended is not None or disruptions_of(client) > lost,
        60,
    )
    if ms in client.answered:
        answered.append(time.monotonic())
    await talk(talker, stop)


def exit_code(process: Process, timeout_s: float) -> int | None:
    """The process's exit code once it exits; None if it is still running after `timeout_s`."""
    try:
        return process.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


class Fleet:
    """The processes: two API pods, echo workers `w-a` and `w-b`, the frame worker."""

    def __init__(self, url: str) -> None:
        self.prefix = f"failover-kinds-{uuid.uuid4().hex[:6]}"
        self.keys = KeySchema(self.prefix)
        self.echo = {name: start_worker(url, self.prefix, name) for name in ("w-a", "w-b")}
        self.native = start_worker(url, self.prefix, "w-native", PLUGIN, PYTHONPATH=CHECKOUT)
        self.apis = [start_api(url, self.prefix, f"api-{i}") for i in range(2)]
        self.handle = connect(url)

    @property
    def processes(self) -> list[Process]:
        return [*self.apis, *self.echo.values(), self.native]

    async def ready(self) -> None:
        for api in self.apis:
            await asyncio.to_thread(api.wait_ready)
        await waits.until(lambda: self.handle.client.zcard(self.keys.workers()), lambda n: n >= 3)

    async def owner(self, session_id: str) -> str:
        return (await self.handle.client.hget(self.keys.session(session_id), "worker")).decode()

    async def field(self, key: str, name: str) -> bytes | None:
        return await self.handle.client.hget(key, name)

    def log_counts(self) -> str:
        counts = []
        for process in self.processes:
            logs = process.logs()
            counts.append(
                f"{process.name} {count_lines(logs, ' WARNING ')}/{count_lines(logs, ' ERROR ')}"
                f"/{count_lines(logs, 'Traceback')}"
            )
        return ", ".join(counts)

    async def stop(self) -> None:
        for process in self.processes:
            process.stop()
        await close(self.handle)


async def opened(client: RecordingClient, session: dict[str, Any], index: int) -> Talker:
    await client.connect(session)
    # a native session's audio is the model's own: only its events are checked
    return Talker(Conversation(client, index, audio_checked=not isinstance(client, NativeClient)))


def recording(bases: list[str], client_class: type[RecordingClient] = RecordingClient) -> Any:
    return client_class(bases, heartbeat_s=1.0, ack_every=16)


async def test_sentinel_primary_killed_under_every_kind_of_session():
    sentinels = await asyncio.to_thread(RedisSentinelSet)
    fleet = Fleet(sentinels.url)
    bases = [api.base for api in fleet.apis]
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    talkers: list[Talker] = []
    try:
        await fleet.ready()
        cascade = await opened(recording(bases), CASCADE, 0)
        native = await opened(recording(bases[::-1], NativeClient), NATIVE, 1)
        # the resume goes to the other pod (a client tries its next URL first)
        resumed_client: HeldResume = recording(bases, HeldResume)
        resumed = await opened(resumed_client, CASCADE_REAL_TIME, 2)
        drained = await opened(recording(bases[::-1]), CASCADE_REAL_TIME, 3)
        talkers = [cascade, native, resumed, drained]
        tasks += [asyncio.create_task(receive(t)) for t in talkers]
        talking = [
            asyncio.create_task(talk(cascade, stop)),
            asyncio.create_task(talk_natively(native, stop)),
        ]
        tasks += talking
        await answered_turn(resumed.conversation, 310)
        await answered_turn(drained.conversation, 330)
        assert await until(lambda: all(len(t.answered) >= 2 for t in talkers[:2]), 60), [
            (t.conversation.turns, t.conversation.ended_by) for t in talkers
        ]

        # a resume in progress: a response plays, the connection drops, the pod detaches the
        # session (in Redis: before the kill); the resume is held until the primary is dead
        sid = resumed_client.session_id
        await response_playing(resumed.conversation, RESUMED_TURN_MS)
        seq_at_drop = resumed_client.last_seq
        await resumed_client.drop_connection()
        await waits.until(
            lambda: fleet.field(fleet.keys.session(sid), "state"), lambda s: s == b"detached"
        )
        # a drain in progress: the owner of a session playing a long response is told to
        # drain, and says so in its registration (the drain waits for the response)
        drained_sid = drained.client.session_id
        await response_playing(drained.conversation, DRAINED_TURN_MS)
        drained_owner = await fleet.owner(drained_sid)
        other = next(name for name in fleet.echo if name != drained_owner)
        fleet.echo[drained_owner].process.send_signal(signal.SIGTERM)
        await waits.until(
            lambda: fleet.field(fleet.keys.worker(drained_owner), "draining"),
            lambda flag: flag == b"1",
        )
        owner_at_kill = await fleet.owner(drained_sid)

        old = await asyncio.to_thread(sentinels.kill_primary)
        killed = time.monotonic()
        resumed_client.resume_allowed.set()
        for t in (cascade, native, drained):  # an ack in the outage, as the model test does
            await t.client.send(
                {"type": "session.event_ack", "server_event_seq": t.client.last_seq}
            )
        long_answered: list[float] = []
        later = [
            talk(resumed, stop),
            after_long_turn(drained, DRAINED_TURN_MS, stop, long_answered),
        ]
        talking += [asyncio.create_task(work) for work in later]
        tasks += talking[2:]
        new, named_at = await promotion(sentinels, old)

        resume_seen: list[float] = []

        def everyone_talks() -> bool:
            if not resume_seen and resumed_client.resumes:
                resume_seen.append(time.monotonic())
            return all(
                t.talked_since(killed) is not None or t.conversation.ended_by or t.client.ended
                for t in talkers
            )

        recovered = await until(everyone_talks, RECOVERY_TIMEOUT_S)
        moved_to = await fleet.owner(drained_sid)
        drained_exit = await asyncio.to_thread(exit_code, fleet.echo[drained_owner], 30)
        stop.set()
        for t, task in zip(talkers, talking, strict=True):
            if t.client.ended:
                task.cancel()  # its sends wait for a connection that will not come
        await asyncio.gather(*talking, return_exceptions=True)

        figures = {t.conversation.index: check(t.conversation) for t in talkers}
        resync = resumed.failure is not None and "resync_required" in resumed.failure
        print(
            f"\nsentinel failover under every kind of session (2 API pods, echo workers w-a"
            f" and w-b, a native frame-model worker):"
            f"\n  kill -> every sentinel names the promoted primary: {named_at - killed:.2f} s"
        )
        kinds = ["cascade", "native", "resumed (cascade)", f"drained from {drained_owner}"]
        for kind, t in zip(kinds, talkers, strict=True):
            again = t.talked_since(killed)
            # any answer (to a turn spoken before the kill too): what the user heard first
            first = next((at for at in t.client.completed_at if at > killed), None)
            print(
                f"  {kind}: kill -> talks again"
                f" {'never' if again is None else f'{again - killed:.2f} s'}"
                f" (first answer {'never' if first is None else f'{first - killed:.2f} s'}),"
                f" turns {t.conversation.turns}, refused {t.refused},"
                f" unanswered {t.unanswered}, resumes {t.client.resumes},"
                f" close codes {t.client.close_codes},"
                f" ended {t.conversation.ended_by or t.client.ended} ({t.failure}),"
                f" check {figures[t.conversation.index]}"
            )
        print(
            f"  resume: dropped at seq {seq_at_drop}, resumed"
            f" {'never' if not resume_seen else f'{resume_seen[0] - killed:.2f} s after the kill'}"
            f" ({'session.resync_required' if resync else resumed.failure or 'resumed'},"
            f" {resumed_client.resume_dials} tries);"
            f" drain: {drained_owner} owned the session at the kill: {owner_at_kill},"
            f" now {moved_to}, its long turn answered"
            f" {f'{long_answered[0] - killed:.2f} s after the kill' if long_answered else 'never'},"
            f" {drained_owner} exited {drained_exit}"
        )
        print(f"  WARNING/ERROR/Traceback lines: {fleet.log_counts()}")
        record(
            "kinds",
            {
                "promoted_s": seconds_after(named_at, killed),
                "sessions": [
                    session_figures(
                        kind.split(" from ")[0],
                        t,
                        killed,
                        first_answer_s=seconds_after(
                            next((at for at in t.client.completed_at if at > killed), None),
                            killed,
                        ),
                    )
                    for kind, t in zip(kinds, talkers, strict=True)
                ],
                "resume": {
                    "outcome": "resync" if resync else resumed.failure or "resumed",
                    "after_s": seconds_after(resume_seen[0] if resume_seen else None, killed),
                    "tries": resumed_client.resume_dials,
                },
                "drain": {
                    "moved": owner_at_kill == drained_owner and moved_to == other,
                    "long_turn_answered_s": seconds_after(
                        long_answered[0] if long_answered else None, killed
                    ),
                    "exit_code": drained_exit,
                },
                "logs": log_figures(fleet.processes),
            },
        )

        closed = {t.conversation.index: t.conversation.ended_by or t.client.ended for t in talkers}
        if resync:  # told, not silent: the session must start over, which is allowed
            closed.pop(resumed.conversation.index)
        assert all(reason is None for reason in closed.values()), closed
        assert recovered and new != old
        for t in talkers:
            seqs = t.client.wire_seqs
            assert strictly_increasing(seqs), (t.conversation.index, seqs)
        # no silent gap and nothing twice, for every client; the resumed one got all it
        # had missed (or was told to resync, and so is not held to it)
        for index, seen in figures.items():
            if not (resync and index == resumed.conversation.index):
                assert (seen["lost"], seen["duplicated"]) == (0, 0), (index, seen)
        assert resync or resumed_client.resumes >= 1
        assert owner_at_kill == drained_owner and moved_to == other
    finally:
        await stop_talking(stop, tasks, talkers)
        await fleet.stop()
        sentinels.stop()
