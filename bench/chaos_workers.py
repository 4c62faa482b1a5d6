"""The worker modes of bench/chaos.py: workers SIGKILLed, or rolled, under live sessions.

kill     the worker holding the most sessions is SIGKILLed and restarted under the same id
         (what a StatefulSet does with a crashed pod). Its sessions must go on on a live
         worker from their checkpoints: measured is the time from the kill to each of its
         sessions' next completed response (the client hears `worker_lost` for the response
         in flight and speaks that turn again).
rolling  every worker in turn gets SIGTERM, drains (its sessions move to the others), exits
         0 and is restarted under the same id: a `helm upgrade` of the worker StatefulSet.
         Measured is the pause each move caused: from the old worker stopping the session
         (`paused_at` in the session hash) to the new one serving it (`restored_at`).

Both read what they measure from Redis as an operator would (docs/redis-keys.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import redis.asyncio as redis_async

from bench.common import Stack
from harness.processes import Process
from shared.redis.keys import KeySchema

#: a restarted worker must be registered again within this
REGISTER_TIMEOUT_S = 60.0
#: a SIGTERMed worker drains (responses finish, sessions move) and exits within this
STOP_TIMEOUT_S = 90.0


class WorkerChaos:
    def __init__(self, stack: Stack, conversations: list[Any], report: Any) -> None:
        """`conversations`: bench.chaos's Conversations; `report`: its ChaosReport (this
        module is imported by bench.chaos, so it names neither)."""
        self.stack = stack
        self.conversations = conversations
        self.report = report
        self.keys = KeySchema(stack.prefix)
        self.retired: list[Process] = []  # stopped or killed worker processes
        self.killed: list[Process] = []  # of those, the SIGKILLed ones (their logs end abruptly)
        self.kills: list[tuple[float, set[str]]] = []  # (when, the sessions it held)
        self._seen_moves: set[tuple[str, str]] = set()

    def _redis(self) -> redis_async.Redis:
        return redis_async.Redis.from_url(self.stack.url)

    async def _started_at(self, redis: redis_async.Redis, worker_id: str) -> bytes | None:
        return await redis.hget(self.keys.worker(worker_id), "started_at")

    async def _wait_registered(
        self, redis: redis_async.Redis, worker_id: str, before: bytes | None
    ) -> None:
        """Until the restarted worker has registered (a new start time, not draining)."""
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while True:
            fields = await redis.hgetall(self.keys.worker(worker_id))
            started = fields.get(b"started_at")
            if started and started != before and fields.get(b"draining", b"0") == b"0":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{worker_id} did not register again")
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------ kill

    async def kill_workers(self, deadline: float, every: float, killed: list[str]) -> None:
        redis = self._redis()
        try:
            while time.monotonic() + every < deadline:
                await asyncio.sleep(every * random.uniform(0.7, 1.3))
                holdings = []
                for index, worker in enumerate(self.stack.workers):
                    members = await redis.smembers(self.keys.worker_sessions(worker.name))
                    holdings.append(({m.decode() for m in members}, index))
                held, index = max(holdings, key=lambda pair: len(pair[0]))
                victim = self.stack.workers[index]
                before = await self._started_at(redis, victim.name)
                self.kills.append((time.monotonic(), held))
                victim.kill()
                self.killed.append(victim)
                self.retired.append(victim)
                self.report.kills += 1
                self.stack.workers[index] = self.stack.start_worker(victim.name)
                await self._wait_registered(redis, victim.name, before)
        finally:
            await redis.aclose()

    # ------------------------------------------------------------ rolling

    async def roll_workers(self, deadline: float, rolled: asyncio.Event) -> None:
        """Every worker SIGTERMed and restarted in turn: each once whatever the time (then
        `rolled` is set), and over and over until the deadline."""
        redis = self._redis()
        try:
            while not rolled.is_set() or time.monotonic() < deadline:
                for index in range(len(self.stack.workers)):
                    if rolled.is_set() and time.monotonic() >= deadline:
                        break
                    old = self.stack.workers[index]
                    before = await self._started_at(redis, old.name)
                    code = await asyncio.to_thread(old.stop, STOP_TIMEOUT_S)
                    if code != 0:
                        self.report.failures.append(f"{old.name} exited {code} on SIGTERM")
                    self.retired.append(old)
                    self.report.kills += 1
                    self.stack.workers[index] = self.stack.start_worker(old.name)
                    await self._wait_registered(redis, old.name, before)
                    await self._read_moves(redis)
                rolled.set()
        finally:
            rolled.set()  # a roll that failed ends the talks too
            await redis.aclose()

    # ------------------------------------------------------------ figures

    async def _read_moves(self, redis: redis_async.Redis) -> None:
        """The drain pauses visible now in the session hashes (each move once)."""
        for conversation in self.conversations:
            sid = conversation.client.session_id
            meta = await redis.hgetall(self.keys.session(sid))
            moves = meta.get(b"moves")
            if moves is None or (sid, moves.decode()) in self._seen_moves:
                continue
            paused, restored = meta.get(b"paused_at"), meta.get(b"restored_at")
            if paused and restored:
                self._seen_moves.add((sid, moves.decode()))
                self.report.pause_ms.append(float(int(restored) - int(paused)))

    async def collect_moves(self) -> None:
        """At the end of the run: moves, the last pauses, checkpoint sizes and writes."""
        redis = self._redis()
        try:
            await self._read_moves(redis)
            for conversation in self.conversations:
                sid = conversation.client.session_id
                meta = await redis.hgetall(self.keys.session(sid))
                self.report.moves += int(meta.get(b"moves", b"0"))
                size = await redis.strlen(self.keys.checkpoint(sid))
                if size:
                    self.report.checkpoint_bytes.append(size)
        finally:
            await redis.aclose()

    def account_failures(self) -> None:
        """Failed responses: only a killed worker's sessions may have them. Recovery: from
        each kill to each of its sessions' next completed response."""
        victims = set().union(*(held for _, held in self.kills)) if self.kills else set()
        for conversation in self.conversations:
            client = conversation.client
            failed = len(client.worker_lost)
            if client.session_id in victims:
                self.report.failed_victims += failed
            elif failed:
                self.report.failed_others += failed
                self.report.failures.append(
                    f"session {conversation.index}: {failed} responses failed, no kill held it"
                )
        for killed_at, held in self.kills:
            for conversation in self.conversations:
                if conversation.client.session_id not in held:
                    continue
                # none after a kill right at the end: the run stopped speaking (a session
                # that could not go on fails its turn's wait instead)
                after = [t for t in conversation.client.completed_at if t > killed_at]
                if after:
                    self.report.recovery_s.append(min(after) - killed_at)
