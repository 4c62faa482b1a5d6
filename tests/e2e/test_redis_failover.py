"""Redis failing over under talking sessions, with real processes: two `duplex api` pods and a
`duplex worker` (echo) on a `redis+sentinel://` URL (harness/redis_sentinel.py: a primary,
its replica, three sentinels), and duplex-surface sessions taking echo turns while the
primary is SIGKILLed and the sentinels promote its replica.

No session may close; every session must talk again (a turn spoken after the kill is
answered) before a deadline; no client may see an event seq twice or going backwards. A
turn the pods refused while Redis was gone (internal_error, or no answer) is spoken again,
as a user would. The figures (kill to promotion, kill to each session talking again) and
the pods' ERROR and WARNING lines are printed (`pytest -s` shows them), never asserted."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.chaos_sessions import ENDINGS, SESSION, ended_by
from harness.processes import HttpProcess, Process, start_api, start_worker
from harness.recording_client import Conversation, RecordingClient, check, speak, turn_audio
from harness.redis_sentinel import RedisSentinelSet
from shared.client.duplex_client import DuplexClientError
from shared.redis.connection import RedisHandle, connect
from shared.redis.keys import KeySchema
from tests.e2e.failover_figures import (
    count_lines,
    log_figures,
    record,
    seconds_after,
    session_figures,
    strictly_increasing,
)
from tests.redis.test_sentinel import promotion

SESSIONS = 4
#: an answer at 4x real time takes well under a second; more is a refused turn
TURN_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 30.0
#: kill to every session talking again, at most (a 2-core machine under load included)
RECOVERY_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Talker:
    conversation: Conversation
    #: (spoken at, answered at), monotonic, of each answered turn
    answered: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    refused: int = 0  # turns answered by an error (their input did not reach the worker)
    unanswered: int = 0  # turns without an answer in TURN_TIMEOUT_S
    failure: str | None = None  # why the client gave the session up, in its own words

    @property
    def client(self) -> RecordingClient:
        return self.conversation.client

    def talked_since(self, moment: float) -> float | None:
        """When the first turn spoken after `moment` was answered (None: none yet)."""
        return next((answered for spoken, answered in self.answered if spoken > moment), None)


def errors_of(client: RecordingClient) -> int:
    return sum(1 for frame in client.delivered if frame.get("type") == "error")


async def wait_turn(client: RecordingClient, duration: int, errors_before: int) -> str:
    """The turn's outcome: "answered", "refused" (an error came since it began) or
    "unanswered" (nothing in TURN_TIMEOUT_S)."""
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while duration not in client.answered:
        if client.ended is not None:
            raise DuplexClientError(client.ended, "session ended")
        if errors_of(client) > errors_before:
            return "refused"
        client.progress.clear()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "unanswered"
        try:
            async with asyncio.timeout(remaining):
                await client.progress.wait()
        except TimeoutError:
            return "unanswered"
    return "answered"


async def talk(talker: Talker, stop: asyncio.Event) -> None:
    """Echo turns of growing length (each answer names its turn) until `stop`; a turn
    refused or unanswered is followed by the next one."""
    conversation, client = talker.conversation, talker.client
    next_ms = 200 + 20 * conversation.index
    try:
        while not stop.is_set():
            duration, next_ms = next_ms, next_ms + 20
            pcm = turn_audio(duration)
            conversation.spoken[duration] = pcm
            errors, spoken = errors_of(client), time.monotonic()
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await speak(client, pcm)
            outcome = await wait_turn(client, duration, errors)
            if outcome == "answered":
                conversation.turns += 1
                talker.answered.append((spoken, time.monotonic()))
                continue
            conversation.respoken += 1
            if outcome == "refused":
                talker.refused += 1
                # the pod said its Redis failed: give it a moment before the next turn
                # (pacing the retries, not ordering anything)
                await asyncio.sleep(0.2)
            else:
                talker.unanswered += 1
    except ENDINGS as exc:
        conversation.ended_by = ended_by(exc, client)


async def receive(talker: Talker) -> None:
    """Keep the client's event queue empty (the checks read the recorded frames), as
    harness/recording_client.py's `drain` does, keeping the client's words when it gives
    the session up (a resume refused or never answered)."""
    client = talker.client
    try:
        while True:
            await client.recv(timeout=None)
    except DuplexClientError as exc:
        talker.failure = f"{exc.code}: {exc}"
        client.ended = client.ended or f"resume refused: {exc.code}"
        client.progress.set()


async def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `condition` (something the clients observed) until it holds or the time is up."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@dataclasses.dataclass
class SentinelFleet:
    """A Sentinel set (a primary, its replica, three sentinels) and on it two API pods
    and one echo worker, `w-1`, under a key prefix of their own."""

    sentinels: RedisSentinelSet
    keys: KeySchema
    worker: Process
    apis: list[HttpProcess]
    handle: RedisHandle

    @classmethod
    async def start(cls, name: str) -> SentinelFleet:
        sentinels = await asyncio.to_thread(RedisSentinelSet)
        prefix = f"{name}-{uuid.uuid4().hex[:6]}"
        worker = start_worker(sentinels.url, prefix, "w-1", DUPLEX_MAX_SESSIONS=str(SESSIONS))
        apis = [start_api(sentinels.url, prefix, f"api-{i}") for i in range(2)]
        return cls(sentinels, KeySchema(prefix), worker, apis, connect(sentinels.url))

    async def ready(self) -> None:
        await fleet_ready(self.handle.client, self.keys, self.apis, [self.worker])

    async def stop(self) -> None:
        for process in [*self.apis, self.worker]:
            process.stop()
        await self.handle.close()
        await asyncio.to_thread(self.sentinels.stop)


async def fleet_ready(
    client: Any, keys: KeySchema, apis: list[HttpProcess], workers: list[Process]
) -> None:
    """Every API pod answers ready and every worker is in the registry (their logs say
    why not, after a minute)."""
    for api in apis:
        await asyncio.to_thread(api.wait_ready)
    deadline = time.monotonic() + 60
    while await client.zcard(keys.workers()) < len(workers):
        logs = "\n".join(worker.logs() for worker in workers)
        assert time.monotonic() < deadline, f"the workers never registered:\n{logs}"
        await asyncio.sleep(0.05)


async def sessions_talking(
    bases: list[str], count: int, stop: asyncio.Event, tasks: list[asyncio.Task[None]]
) -> tuple[list[Talker], list[asyncio.Task[None]]]:
    """`count` duplex-surface sessions, half starting on each pod, taking turns until `stop`;
    returned once each had two turns answered, with their talking tasks (all their tasks
    are added to `tasks`, for `stop_talking`)."""
    talkers: list[Talker] = []
    for index in range(count):
        urls = bases[index % 2 :] + bases[: index % 2]
        client = RecordingClient(urls, heartbeat_s=1.0, ack_every=16)
        await client.connect(SESSION)
        talkers.append(Talker(Conversation(client, index)))
    tasks += [asyncio.create_task(receive(t)) for t in talkers]
    talking = [asyncio.create_task(talk(t, stop)) for t in talkers]
    tasks += talking
    assert await until(lambda: all(len(t.answered) >= 2 for t in talkers), 60), [
        (t.conversation.turns, t.conversation.ended_by) for t in talkers
    ]
    return talkers, talking


async def stop_talking(
    stop: asyncio.Event, tasks: list[asyncio.Task[None]], talkers: list[Talker]
) -> None:
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in talkers:
        await t.client.close(end_session=False)


async def test_sentinel_primary_killed_while_sessions_talk():
    fleet = await SentinelFleet.start("failover")
    sentinels, worker, apis = fleet.sentinels, fleet.worker, fleet.apis
    talkers: list[Talker] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        await fleet.ready()
        talkers, talking = await sessions_talking([api.base for api in apis], SESSIONS, stop, tasks)

        old = await asyncio.to_thread(sentinels.kill_primary)
        killed = time.monotonic()
        # every client acks what it has while the primary is gone (a client acks on its own
        # schedule, `ack_every` events here: this makes every run meet an ack in the outage,
        # which the pod writes to Redis at once)
        for t in talkers:
            await t.client.send(
                {"type": "session.event_ack", "server_event_seq": t.client.last_seq}
            )
        new, named_at = await promotion(sentinels, old)
        recovered = await until(
            lambda: all(
                t.talked_since(killed) is not None or t.conversation.ended_by or t.client.ended
                for t in talkers
            ),
            RECOVERY_TIMEOUT_S,
        )
        stop.set()
        for t, task in zip(talkers, talking, strict=True):
            if t.client.ended:
                task.cancel()  # its sends wait for a connection that will not come
        await asyncio.gather(*talking, return_exceptions=True)

        api_logs = "\n".join(api.logs() for api in apis)
        print(f"\nsentinel failover under {SESSIONS} talking sessions (2 API pods, 1 worker):")
        print(f"  kill -> every sentinel names the promoted primary: {named_at - killed:.2f} s")
        for t in talkers:
            again = t.talked_since(killed)
            print(
                f"  session {t.conversation.index}:"
                f" kill -> talks again {'never' if again is None else f'{again - killed:.2f} s'},"
                f" turns {t.conversation.turns}, refused {t.refused},"
                f" unanswered {t.unanswered}, resumes {t.client.resumes},"
                f" close codes {t.client.close_codes},"
                f" ended {t.conversation.ended_by or t.client.ended} ({t.failure}),"
                f" check {check(t.conversation)}"
            )
        print(
            f"  ERROR lines: API pods {count_lines(api_logs, ' ERROR ')};"
            f" WARNING lines: API pods {count_lines(api_logs, ' WARNING ')},"
            f" worker {count_lines(worker.logs(), ' WARNING ')};"
            f" 'is dead' lines {count_lines(api_logs, ' is dead')};"
            f" Traceback lines {count_lines(api_logs + worker.logs(), 'Traceback')}"
        )

        record(
            "sentinel",
            {
                "promoted_s": seconds_after(named_at, killed),
                "sessions": [
                    session_figures(f"session {t.conversation.index}", t, killed) for t in talkers
                ],
                "logs": log_figures([*apis, worker]),
            },
        )

        closed = {t.conversation.index: t.conversation.ended_by or t.client.ended for t in talkers}
        assert all(reason is None for reason in closed.values()), closed
        assert recovered and new != old
        for t in talkers:
            seqs = t.client.wire_seqs
            assert strictly_increasing(seqs), (t.conversation.index, seqs)
    finally:
        await stop_talking(stop, tasks, talkers)
        await fleet.stop()
