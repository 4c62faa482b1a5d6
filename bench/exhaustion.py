"""Resource exhaustion: one hostile client against real processes, each attack measured.

    .venv/bin/python -m bench.exhaustion [--scale 1.0]
    (also run by `python -m bench.fuzz`, after the frames)

One redis-server, one echo worker, two API pods, and a control session running echo turns
on the same worker throughout. Each case is what an outside attacker tried in issue 14:

  inbox_flood   one session sends 20 appends of 8 MiB audio: Redis must not keep them
  wav_bomb      WAV appends whose header says 1 Hz (6 KB and 26 KB): no 16 000x resample
  chat_stream   streamed chat completions with 2.9 MiB and 10 MiB bodies, and the largest
                allowed body: 413 past the limit, and the pod's event loop stays free
  stall         an API pod frozen (SIGSTOP) past its heartbeat TTL, then resumed: its
                attached sessions must not expire
  idle_sockets  300 sockets that send nothing or half a request: closed by the server,
                and GET /health still answered meanwhile
  bad_key       a non-ASCII API key on HTTP and on the WebSocket: 401 / 401, never 500

Each case reports the memory the attack cost (Redis, worker or API RSS, before -> peak ->
after) and the worst event-loop lag the process under attack saw during the case, from
its own `duplex_event_loop_lag_seconds` histogram (the upper bound of the highest bucket
that gained a sample: "<= 5 ms" means every stall was under 5 ms). A case passes when
the attack is refused as the contract says, memory comes back, and the control session's
turns are all answered with their own echo. Writes docs/reliability.md (section
exhaustion). `run_exhaustion()` is what the suite's small run calls
(tests/e2e/test_exhaustion.py).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import math
import os
import signal
import struct
import time

import httpx
import orjson
import redis.asyncio as redis_async
import websockets

from bench.chaos_sessions import SESSION, converse
from bench.common import Stack, machine, now_utc, rss_bytes, watchdog, write_section
from harness.recording_client import Conversation, RecordingClient, check, drain
from harness.redis_server import free_port
from harness.sockets import closed_by_server
from shared.client.duplex_client import realtime_url
from shared.loop_lag import LAG_METRIC
from shared.redis.keys import KeySchema

MIB = 1024 * 1024
KEY = "sk-exhaustion"
FAST = {
    "DUPLEX_HEARTBEAT_INTERVAL_S": "0.2",
    "DUPLEX_HEARTBEAT_TTL_S": "2.0",
    "DUPLEX_DISCONNECT_GRACE_S": "3.0",
    "DUPLEX_API_KEYS": KEY,
}
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 2.0
CHAT_LIMIT = 1 * MIB


@dataclasses.dataclass
class Case:
    name: str
    attack: str
    outcome: str = ""
    memory: str = ""
    lag_ms: float = 0.0
    ok: bool = False


class LagMeter:
    """The worst event-loop lag a process saw during a block, from its own
    `duplex_event_loop_lag_seconds` histogram (shared/loop_lag.py): the upper bound of the
    highest bucket that gained a sample. Read from the process itself, not timed from
    here: this program's own loop is busy sending the attack (a 10 MiB frame is tens of
    ms of JSON and masking on this side too)."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base = base
        self.headers = headers or {}
        self.worst_s = 0.0
        self._before: dict[float, float] = {}

    async def buckets(self) -> dict[float, float]:
        async with httpx.AsyncClient(timeout=30) as http:
            text = (await http.get(f"{self.base}/metrics", headers=self.headers)).text
        counts = {}
        for line in text.splitlines():
            if line.startswith(f"{LAG_METRIC}_bucket"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                counts[float(bound)] = float(line.rsplit(" ", 1)[1])
        return counts

    async def __aenter__(self) -> LagMeter:
        self._before = await self.buckets()
        return self

    async def __aexit__(self, *exc: object) -> None:
        after = await self.buckets()
        grown = {bound: n - self._before.get(bound, 0.0) for bound, n in after.items()}
        samples = grown.get(math.inf, 0.0)
        # cumulative buckets: the smallest bound holding every new sample holds the worst
        self.worst_s = min(b for b, n in grown.items() if n >= samples) if samples else 0.0


def wav_header(rate: int, data: bytes) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(data))
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )


async def events_until(ws, wanted: str, timeout: float = 120) -> list[dict]:
    events: list[dict] = []
    async with asyncio.timeout(timeout):
        while not events or events[-1]["type"] != wanted:
            events.append(orjson.loads(await ws.recv()))
    return events


async def barrier(ws) -> list[dict]:
    """What the server answered to everything sent before: a heartbeat is handled in order."""
    await ws.send(orjson.dumps({"type": "session.heartbeat", "event_id": "barrier"}).decode())
    return await events_until(ws, "session.heartbeat_ack")


def codes(events: list[dict]) -> list[str]:
    return [e["error"]["code"] for e in events if e["type"] == "error"]


class Attack:
    def __init__(self, stack: Stack, scale: float, worker_health: int) -> None:
        self.stack = stack
        self.scale = scale
        self.keys = KeySchema(stack.prefix)
        self.worker_health = f"http://127.0.0.1:{worker_health}"
        self.redis = redis_async.Redis.from_url(stack.url)

    def ws_url(self, api: int = 0, key: str = KEY) -> str:
        return realtime_url(self.stack.apis[api].base) + f"&api_key={key}"

    async def stored(self) -> int:
        total = 0
        async for key in self.redis.scan_iter(match=f"{self.stack.prefix}:*", count=1000):
            total += await self.redis.memory_usage(key, samples=0) or 0
        return total

    async def inbox_flood(self) -> Case:
        count = max(2, round(20 * self.scale))
        case = Case("inbox_flood", f"{count} appends of 8 MiB audio from one session")
        before = await self.stored()
        chunk = base64.b64encode(b"\x00\x01" * (4 * MIB)).decode()
        peak = before
        probe = LagMeter(self.stack.apis[0].base, AUTH)
        async with probe, websockets.connect(self.ws_url(), max_size=None) as ws:
            await ws.send(orjson.dumps({"type": "session.update", "session": {}}).decode())
            await events_until(ws, "session.created")
            for n in range(count):
                frame = {"type": "input_audio_buffer.append", "audio": chunk}
                await ws.send(orjson.dumps({**frame, "event_id": f"a{n}"}).decode())
                peak = max(peak, await self.stored())
            answered = codes(await barrier(ws))
            await ws.send(orjson.dumps({"type": "session.close"}).decode())
            await events_until(ws, "session.closed")
        inbox = self.keys.inbox("worker-0")
        async with asyncio.timeout(60):
            while await self.redis.xlen(inbox):
                await asyncio.sleep(0.05)
        after = await self.stored()
        refused = answered.count("input_backpressure")
        case.outcome = f"{refused} of {count} refused (`input_backpressure`)"
        case.memory = (
            f"Redis keys {before / MIB:.1f} -> peak {peak / MIB:.1f} -> "
            f"{after / MIB:.1f} MiB after close ({count * 8} MiB sent)"
        )
        case.lag_ms = probe.worst_s * 1000
        case.ok = refused > 0 and after - before < MIB
        return case

    async def wav_bomb(self) -> Case:
        case = Case("wav_bomb", "WAV appends of 6 KB and 26 KB whose header says 1 Hz")
        worker = self.stack.workers[0].process.pid
        before = peak = rss_bytes(worker)
        answered: list[str] = []
        probe = LagMeter(self.worker_health)
        async with probe, websockets.connect(self.ws_url()) as ws:
            await ws.send(orjson.dumps({"type": "session.update", "session": {}}).decode())
            await events_until(ws, "session.created")
            for size in (6 * 1024, 26 * 1024):
                audio = base64.b64encode(wav_header(1, b"\x00\x10" * (size // 2))).decode()
                frame = {"type": "input_audio_buffer.append", "audio": audio}
                await ws.send(orjson.dumps(frame).decode())
                answered += codes(await barrier(ws))
                peak = max(peak, rss_bytes(worker))
            await ws.send(orjson.dumps({"type": "session.close"}).decode())
            await events_until(ws, "session.closed")
        case.outcome = ", ".join(f"`{c}`" for c in answered)
        case.memory = f"worker RSS {before / MIB:.0f} -> peak {peak / MIB:.0f} MiB"
        case.lag_ms = probe.worst_s * 1000
        case.ok = answered == ["unsupported_audio_format"] * 2 and peak - before < 50 * MIB
        return case

    async def chat_stream(self) -> Case:
        case = Case("chat_stream", "streamed chat, bodies of 2.9 MiB, 10 MiB and the limit")
        api = self.stack.apis[0]
        pid = api.process.pid
        before = peak = rss_bytes(pid)
        statuses: list[int] = []
        headers = AUTH
        probe = LagMeter(api.base, AUTH)
        async with probe, httpx.AsyncClient(timeout=120) as http:
            for size in (int(2.9 * MIB), 10 * MIB, CHAT_LIMIT - 200):
                words = ("word " * (size // 5))[: size - 100]
                body = {"stream": True, "messages": [{"role": "user", "content": words}]}
                url = f"{api.base}/v1/chat/completions"
                async with http.stream("POST", url, json=body, headers=headers) as reply:
                    async for _ in reply.aiter_bytes():
                        peak = max(peak, rss_bytes(pid))
                    statuses.append(reply.status_code)
        case.outcome = "HTTP " + ", ".join(str(s) for s in statuses)
        case.memory = f"API RSS {before / MIB:.0f} -> peak {peak / MIB:.0f} MiB"
        case.lag_ms = probe.worst_s * 1000
        case.ok = statuses == [413, 413, 200] and case.lag_ms < 1000
        return case

    async def stall(self) -> Case:
        sessions = max(2, round(5 * self.scale))
        case = Case("stall", f"API pod frozen past its heartbeat TTL with {sessions} sessions")
        pod = self.stack.apis[1]
        sockets = [await websockets.connect(self.ws_url(1)) for _ in range(sessions)]
        try:
            sids = []
            for ws in sockets:
                await ws.send(orjson.dumps({"type": "session.update", "session": {}}).decode())
                sids.append((await events_until(ws, "session.created"))[-1]["session"]["id"])
            os.kill(pod.process.pid, signal.SIGSTOP)
            try:
                async with asyncio.timeout(30):  # until the other pod's sweep detached them
                    while (
                        await self.redis.hget(self.keys.session(sids[-1]), "state") != b"detached"
                    ):
                        await asyncio.sleep(0.05)
                deadline = int(await self.redis.hget(self.keys.session(sids[-1]), "lease_deadline"))
            finally:
                os.kill(pod.process.pid, signal.SIGCONT)
            # time itself: the grace the sweep started runs out, the janitor ticks every second
            await asyncio.sleep(max(0.0, deadline / 1000 - time.time()) + 2.5)
            expired = 0
            for ws in sockets:
                kinds = [e["type"] for e in await barrier(ws)]
                expired += "session.expired" in kinds
        except websockets.ConnectionClosed:
            expired = sessions
        finally:
            for ws in sockets:
                await ws.close()
        case.outcome = f"{expired} of {sessions} sessions expired after the pod came back"
        case.ok = expired == 0
        return case

    async def idle_sockets(self) -> Case:
        count = max(30, round(300 * self.scale))
        case = Case("idle_sockets", f"{count} sockets: silent, half a request line, half headers")
        api = self.stack.apis[0]
        partial = [b"", b"GET /health HT", b"GET /health HTTP/1.1\r\nHost: x\r\n"]
        streams = []
        for n in range(count):
            reader, writer = await asyncio.open_connection("127.0.0.1", api.port)
            writer.write(partial[n % 3])
            await writer.drain()
            streams.append((reader, writer))
        async with httpx.AsyncClient(timeout=30) as http:
            health = (await http.get(f"{api.base}/health")).status_code
        started = time.monotonic()

        async def closed(reader: asyncio.StreamReader) -> bool:
            try:
                await closed_by_server(reader, HEADER_TIMEOUT_S * 5)
                return True
            except (TimeoutError, ConnectionError):
                return False

        results = await asyncio.gather(*(closed(r) for r, _ in streams))
        took = time.monotonic() - started
        for _, writer in streams:
            writer.close()
        case.outcome = (
            f"{sum(results)} of {count} closed by the server within {took:.1f} s "
            f"(header timeout {HEADER_TIMEOUT_S:.0f} s); GET /health meanwhile: {health}"
        )
        case.ok = all(results) and health == 200
        return case

    async def bad_key(self) -> Case:
        case = Case("bad_key", "a non-ASCII API key on HTTP and WebSocket routes")
        api = self.stack.apis[0]
        key = "ключ-é".encode()
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.get(
                f"{api.base}/v1/models", headers={b"authorization": b"Bearer " + key}
            )
        close = None
        try:
            url = realtime_url(api.base) + "&api_key=%D0%BA%D0%BB%D1%8E%D1%87"
            async with websockets.connect(url) as ws:
                await ws.recv()
        except websockets.ConnectionClosed as exc:
            close = exc.rcvd.code if exc.rcvd else None
        except websockets.InvalidStatus as exc:
            close = exc.response.status_code
        tracebacks = api.logs().count("Traceback")
        case.outcome = f"HTTP {reply.status_code}, WebSocket {close}, tracebacks {tracebacks}"
        case.ok = reply.status_code == 401 and close == 401 and tracebacks == 0
        return case


async def run_exhaustion(scale: float = 1.0) -> tuple[list[Case], dict[str, int]]:
    async with watchdog(600, "exhaustion"):
        return await _run_exhaustion(scale)


async def _run_exhaustion(scale: float) -> tuple[list[Case], dict[str, int]]:
    health = free_port()
    api_env = {**FAST, "DUPLEX_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    api_env["DUPLEX_CHAT_MAX_BODY_BYTES"] = str(CHAT_LIMIT)
    worker_env = {**FAST, "DUPLEX_WORKER_HEALTH_PORT": str(health)}
    with Stack(apis=2, api_env=api_env, worker_env=worker_env) as stack:
        attack = Attack(stack, scale, health)
        control = RecordingClient([stack.apis[0].base], api_key=KEY, heartbeat_s=1.0)
        await control.connect(SESSION)
        conversation = Conversation(control, 0)
        drainer = asyncio.create_task(drain(control))
        talking = asyncio.create_task(converse(conversation, float("inf"), 30.0))
        cases = []
        for run in (
            attack.inbox_flood,
            attack.wav_bomb,
            attack.chat_stream,
            attack.stall,
            attack.idle_sockets,
            attack.bad_key,
        ):
            cases.append(await run())
        talking.cancel()
        await asyncio.gather(talking, return_exceptions=True)
        await control.close()
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        figures = check(conversation)
        control_figures = {"turns": conversation.turns, **figures}
        if figures["lost"]:  # say which, and what came around them: a lost event is a bug
            seqs = {f["server_event_seq"] for f in control.delivered if "server_event_seq" in f}
            missing = sorted(set(range(1, max(seqs) + 1)) - seqs)
            near = [
                (f.get("server_event_seq"), f.get("type"))
                for f in control.frames
                if abs((f.get("server_event_seq") or -99) - missing[0]) <= 3
            ]
            print(f"control session lost seqs {missing[:10]}; frames near: {near}")
        if conversation.ended_by is not None:
            control_figures["ended"] = 1
        await attack.redis.aclose()
    return cases, control_figures


def control_ok(control: dict[str, int]) -> bool:
    problems = control["lost"] + control["duplicated"] + control["mismatched"]
    return control["turns"] > 0 and not problems and not control.get("ended")


def render(cases: list[Case], control: dict[str, int], scale: float, seconds: float) -> str:
    rows = [
        f"Measured {now_utc()} on {machine()}: `python -m bench.exhaustion --scale {scale:g}` "
        f"({seconds:.0f} s).",
        "",
        "| case | attack | answered | memory | worst event-loop lag | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        lag = f"<= {case.lag_ms:g} ms" if case.lag_ms else "-"
        verdict = "pass" if case.ok else "FAIL"
        rows.append(
            f"| {case.name} | {case.attack} | {case.outcome} | {case.memory or '-'} | {lag} "
            f"| {verdict} |"
        )
    rows += [
        "",
        f"Control session on the same worker: {control['turns']} turns answered, "
        f"{control['lost']} lost, {control['duplicated']} duplicated, "
        f"{control['mismatched']} wrong audio"
        + (", ended early" if control.get("ended") else "")
        + ".",
    ]
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    cases, control = await run_exhaustion(args.scale)
    table = render(cases, control, args.scale, time.monotonic() - started)
    print(table)
    write_section("reliability.md", "exhaustion", table, "Exhaustion (`bench/exhaustion.py`)")
    return 0 if all(c.ok for c in cases) and control_ok(control) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="attack sizes (1 = issue 14)")
    raise SystemExit(asyncio.run(main(parser.parse_args())))
