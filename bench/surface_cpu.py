"""The API pod's CPU per session-second and its event loop's lag on the native surfaces:
Moshi's Ogg Opus (`/api/chat`, the model speaking and the model listening) and GPT-Live's
JSON (`/v1/live/sessions`), against the duplex surface's JSON appends (`/v1/duplex`) as the
floor, and the codec alone in-process.

    .venv/bin/python -m bench.surface_cpu [--levels 8,32] [--seconds 12] [--warmup 2]
                                          [--idle-seconds 4] [--codec-repeats 7]
                                          [--section surface_cpu] [--label TEXT] [--docs DIR]

One real redis-server, one `duplex worker --plugin harness.frame_models:EchoFramePlugin`
(the echo frame model: it says each 80 ms frame back two frames later, and "." while it
speaks) and one `duplex api`. At each level N, N clients at once stream the same audio in
real time through each surface in turn, for `--warmup` then a measured window of
`--seconds`; the audio is a loud tone (440 Hz, 24 kHz mono), so the model speaks
throughout, except on `moshi_quiet`:
  moshi        `/api/chat`: after the handshake byte, one `0x01` + Ogg Opus message per
               80 ms frame (sphn's `OpusStreamWriter`, the whole stream encoded once up
               front and sent by every client); the pod decodes it to pcm16, and
               Opus-encodes the model's audio back (`0x01` + pages), words as `0x02` + UTF-8
  moshi_quiet  the same client on `/api/chat` streaming silence (zeros through the same
               writer): the model listens, and what comes back is whatever the server sends
               for a quiet model (a server on its client's clock: a silent frame per frame)
  live         `/v1/live/sessions`: `session.start`, then a base64 pcm16 append every
               100 ms; back `session.output_audio.delta` and `session.output_transcript.delta`
  duplex       the floor: `/v1/duplex`, `session.update` with pcm16 24 kHz in and out, then
               a base64 pcm16 append every 80 ms: the same audio as JSON, no codec at the pod
Over each window: the API pod's CPU seconds (/proc/<pid>/stat) over session-seconds (ms
of pod CPU per session-second; the worker's, Redis's and this load generator's beside
it), the pod's event-loop lag (its `duplex_event_loop_lag_seconds` histogram on its own
/metrics, read before and after the window: the p99 is the upper bound of the bucket where
the window's cumulative count reaches 99%), payload bytes on the wire per session-second
each way, the audio that came back per second streamed (the Opus pages decoded after the
run), and the worker's tick clock (ticks: every batched step it timed, so a client-clocked
session's catch-up steps too; deadline misses; silence frames: a session whose input had not
arrived) from its /metrics. Before the first window, the idle pod's CPU (no session) is
measured for `--idle-seconds`. The headline is each surface's pod CPU over the
floor's at the same level; sessions per pod core take the idle pod's share out. Then, in
this process, the codec alone on the same 80 ms frames: services/api/ogg_opus.py's
`OpusDecoder` and the pod's encoder (`new_encoder()`: libopus at complexity 5 where it is
installed) beside sphn's writer (`SphnEncoder`, `moshi.server`'s), on the tone, on zeros and
on low-level noise (a listening Moshi's output), against base64 + orjson (an
append parsed, a delta built), the floor of the codec's share. Writes the `surface_cpu`
section of docs/benchmarks.md (or `--section`, into `--docs`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
import orjson
import sphn
import websockets

from bench.common import (
    DOCS,
    ROOT,
    Stack,
    add_output_arguments,
    commit,
    cpu_seconds,
    machine,
    now_utc,
    write_section,
)
from harness.frame_models import FRAME_SAMPLES, RATE, tone
from harness.redis_server import free_port
from services.api.ogg_opus import OpusDecoder, SphnEncoder, new_encoder
from shared.loop_lag import DEFAULT_INTERVAL_S, LAG_BUCKETS, LAG_METRIC
from shared.protocol.duplex import float_to_pcm16

PLUGIN = "harness.frame_models:EchoFramePlugin"
MODEL = "frame_echo"
FRAME_S = FRAME_SAMPLES / RATE  # 80 ms
LIVE_APPEND_S = 0.1
SURFACES = ("moshi", "moshi_quiet", "live", "duplex")
#: the surfaces whose client speaks Moshi's protocol (binary messages, Ogg Opus audio)
MOSHI = ("moshi", "moshi_quiet")
SURFACE_NAMES = {
    "moshi": "Moshi, Ogg Opus (`/api/chat`)",
    "moshi_quiet": "Moshi listening, Ogg Opus (`/api/chat`)",
    "live": "GPT-Live, JSON (`/v1/live/sessions`)",
    "duplex": "duplex, JSON (`/v1/duplex`): floor",
}
PCM24 = {"type": "audio/pcm", "rate": RATE}
DUPLEX_SESSION = {"audio": {"input": {"format": PCM24}, "output": {"format": PCM24}}}
OPEN_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
#: audio kept after the window: the sender never runs out of pre-encoded messages
TAIL_S = 5.0


# ------------------------------------------------------------------ the audio, encoded once


@dataclass
class Streams:
    """The same tone as each surface's client messages (and silence as Moshi's), encoded
    before any clock runs."""

    pcm: bytes  # pcm16 24 kHz, the whole stream
    moshi: list[bytes]  # 0x01 + Ogg Opus, one per 80 ms frame (the first holds the headers)
    moshi_quiet: list[bytes]  # the same for zeros: a client whose user says nothing
    live: list[str]  # session.input_audio.append, 100 ms each
    duplex: list[str]  # input_audio_buffer.append, 80 ms each


def make_streams(seconds: float) -> Streams:
    frames = int(seconds / FRAME_S) + 1
    samples = tone(frames)
    pcm = float_to_pcm16(samples)
    return Streams(
        pcm=pcm,
        moshi=moshi_messages(samples, frames),
        moshi_quiet=moshi_messages(np.zeros_like(samples), frames),
        live=[
            live_append(pcm[i : i + 2 * int(RATE * LIVE_APPEND_S)])
            for i in range(0, len(pcm), 2 * int(RATE * LIVE_APPEND_S))
        ],
        duplex=[
            duplex_append(pcm[i : i + 2 * FRAME_SAMPLES])
            for i in range(0, len(pcm), 2 * FRAME_SAMPLES)
        ],
    )


def moshi_messages(samples: np.ndarray, frames: int) -> list[bytes]:
    """`0x01` + the Ogg Opus bytes of each 80 ms frame, as a client's writer makes them."""
    writer = sphn.OpusStreamWriter(RATE)
    return [
        b"\x01" + writer.append_pcm(samples[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES])
        for i in range(frames)
    ]


def live_append(pcm: bytes) -> str:
    audio = base64.b64encode(pcm).decode()
    return f'{{"type":"session.input_audio.append","audio":"{audio}"}}'


def duplex_append(pcm: bytes) -> str:
    return f'{{"type":"input_audio_buffer.append","audio":"{base64.b64encode(pcm).decode()}"}}'


def b64_bytes(text: str) -> int:
    """Bytes a base64 string decodes to, without decoding it."""
    return len(text) * 3 // 4 - (len(text) - len(text.rstrip("=")))


# ------------------------------------------------------------------ the clients


@dataclass
class Client:
    """One session on one surface: a paced sender, a reader counting what comes back."""

    surface: str
    ws: websockets.ClientConnection | None = None
    sent_bytes: int = 0
    received_bytes: int = 0
    audio_bytes: int = 0  # pcm16 bytes back (JSON surfaces; Opus is decoded after the run)
    words: int = 0  # 0x02 messages / transcript deltas
    pages: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival, Ogg bytes)
    kinds: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task | None = None
    closed_reason: str = ""

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.sent_bytes, self.received_bytes, self.audio_bytes, self.words

    # --- opening

    async def open(self, base: str) -> None:
        if self.surface in MOSHI:
            self.ws = await websockets.connect(f"{base}/api/chat", max_size=None)
        elif self.surface == "live":
            self.ws = await websockets.connect(f"{base}/v1/live/sessions", max_size=None)
            start = {"type": "session.start", "session": {"model": MODEL}}
            await self.ws.send(orjson.dumps(start).decode())
        else:
            self.ws = await websockets.connect(f"{base}/v1/duplex", max_size=None)
            update = {"type": "session.update", "session": DUPLEX_SESSION}
            await self.ws.send(orjson.dumps(update).decode())
        self.reader = asyncio.create_task(self._read())
        async with asyncio.timeout(OPEN_TIMEOUT_S):
            await self.ready.wait()
        if self.errors:
            raise RuntimeError(f"{self.surface}: the open failed: {self.errors[0]}")

    # --- reading

    def _count(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for message in self.ws:
                self.received_bytes += len(message)
                if self.surface in MOSHI:
                    self._moshi(message)
                else:
                    self._json(message)
        except websockets.ConnectionClosed:
            pass
        finally:
            code, reason = self.ws.close_code, self.ws.close_reason
            self.closed_reason = f"{code} {reason}".strip() if code is not None else "no close"
            self.ready.set()

    def _moshi(self, message: bytes) -> None:
        kind = message[0]
        if kind == 0x00:
            self._count("handshake")
            self.ready.set()
        elif kind == 0x01:
            self._count("audio")
            self.pages.append((time.monotonic(), message[1:]))
        elif kind == 0x02:
            self._count("text")
            self.words += 1
        else:
            self._count(f"0x{kind:02x}")

    def _json(self, message: str) -> None:
        event = orjson.loads(message)
        kind = event["type"]
        self._count(kind)
        if kind in ("session.output_audio.delta", "response.output_audio.delta"):
            self.audio_bytes += b64_bytes(event["delta"])
        elif kind in ("session.output_transcript.delta", "response.output_audio_transcript.delta"):
            self.words += 1
        elif kind in ("session.started", "session.updated"):
            self.ready.set()
        elif kind == "error":
            self.errors.append(message[:300])
            if not self.ready.is_set():
                self.ready.set()

    # --- streaming

    async def stream(self, messages: list, period_s: float, stop: asyncio.Event) -> None:
        """Send `messages` paced by the clock, one per `period_s`, until `stop`."""
        assert self.ws is not None
        next_at = time.monotonic() + random.uniform(0, period_s)  # not all in step
        try:
            for message in messages:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                if stop.is_set():
                    return
                await self.ws.send(message)
                self.sent_bytes += len(message)
                next_at += period_s
        except websockets.ConnectionClosed:
            self.errors.append(f"the socket closed while streaming: {self.closed_reason}")
            return
        raise RuntimeError("the stream ran out of pre-encoded audio: raise TAIL_S")

    # --- closing

    async def close(self) -> None:
        assert self.ws is not None and self.reader is not None
        try:
            if self.surface in MOSHI:
                await self.ws.close()  # the session ends with its socket
            else:
                await self.ws.send('{"type":"session.close"}')
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.reader
        except (TimeoutError, websockets.ConnectionClosed) as exc:
            self.errors.append(f"close: {type(exc).__name__}")
            self.reader.cancel()
        await self.ws.close()

    def opus_audio_bytes(self, since: float, until: float) -> int:
        """pcm16 bytes of the Opus pages that arrived in [since, until), decoded in order
        (the stream's state needs every page before them)."""
        reader = sphn.OpusStreamReader(RATE)
        total = 0
        for at, page in self.pages:
            samples = reader.append_bytes(page)
            if since <= at < until:
                total += 2 * samples.size
        return total


# ------------------------------------------------------------------ the worker's tick clock


TICK_METRICS = {
    "ticks": "duplex_tick_duration_seconds_count",
    "misses": "duplex_tick_deadline_misses_total",
    "silence": "duplex_tick_silence_frames_total",
    "active": "duplex_tick_slots_active",
}


async def tick_metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(url, timeout=5)).text
    values = dict.fromkeys(TICK_METRICS, 0.0)
    for key, name in TICK_METRICS.items():
        match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        if match:
            values[key] = float(match.group(1))
    return values


async def wait_idle(http: httpx.AsyncClient, url: str, timeout_s: float = 15.0) -> None:
    """Until the worker holds no slot (the last surface's sessions are all closed)."""
    deadline = time.monotonic() + timeout_s
    while (await tick_metrics(http, url))["active"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the worker still holds slots after the sessions closed")
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ the pod's event loop


@dataclass
class LagHistogram:
    """The pod's loop-lag histogram at one moment: cumulative counts by upper bound."""

    buckets: dict[float, float]  # le (s) -> cumulative count; inf for +Inf
    total_s: float  # the _sum

    def minus(self, earlier: LagHistogram) -> LagHistogram:
        return LagHistogram(
            {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.total_s - earlier.total_s,
        )

    @property
    def count(self) -> float:
        return self.buckets.get(float("inf"), 0.0)

    def quantile_bound(self, q: float) -> float:
        """The upper bound (s) of the first bucket whose cumulative count reaches `q` of
        the samples: the quantile is at most this (nan without samples)."""
        if not self.count:
            return float("nan")
        return next(le for le, n in sorted(self.buckets.items()) if n >= q * self.count)

    def max_bound(self) -> float:
        """The upper bound (s) of the highest bucket a sample fell in (nan without any)."""
        if not self.count:
            return float("nan")
        return next(le for le, n in sorted(self.buckets.items()) if n >= self.count)


async def loop_lag(http: httpx.AsyncClient, url: str) -> LagHistogram:
    """The API pod's `duplex_event_loop_lag_seconds` (shared/loop_lag.py) from its /metrics."""
    text = (await http.get(url, timeout=5)).text
    buckets = {}
    for le, value in re.findall(
        rf'^{LAG_METRIC}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} (\S+)$', text, re.M
    ):
        buckets[float(le)] = float(value)  # float("+Inf") is inf
    total = re.search(rf"^{LAG_METRIC}_sum(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    if not buckets or total is None:
        raise RuntimeError(f"the pod's /metrics has no {LAG_METRIC}")
    return LagHistogram(buckets, float(total.group(1)))


def lag_ms(bound_s: float) -> str:
    """A bucket bound in ms, as the table and the printed line show it."""
    if bound_s != bound_s:  # nan: no sample
        return "n/a"
    return "> 10 s" if bound_s == float("inf") else f"{bound_s * 1000:g}"


# ------------------------------------------------------------------ one window


async def run_surface(
    stack: Stack,
    metrics_url: str,
    api_metrics_url: str,
    http: httpx.AsyncClient,
    streams: Streams,
    surface: str,
    sessions: int,
    seconds: float,
    warmup: float,
) -> dict:
    base = stack.ws_bases()[0]
    clients = [Client(surface) for _ in range(sessions)]
    await asyncio.gather(*(c.open(base) for c in clients))
    messages, period = {
        "moshi": (streams.moshi, FRAME_S),
        "moshi_quiet": (streams.moshi_quiet, FRAME_S),
        "live": (streams.live, LIVE_APPEND_S),
        "duplex": (streams.duplex, FRAME_S),
    }[surface]
    stop = asyncio.Event()
    senders = [asyncio.create_task(c.stream(messages, period, stop)) for c in clients]
    pids = {
        "api": stack.apis[0].process.pid,
        "worker": stack.workers[0].process.pid,
        "redis": stack.redis_pid(),
        "load generator": os.getpid(),
    }
    try:
        await asyncio.sleep(warmup)
        ticks_before = await tick_metrics(http, metrics_url)
        lag_before = await loop_lag(http, api_metrics_url)
        before = [c.snapshot() for c in clients]
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        since = time.monotonic()
        await asyncio.sleep(seconds)
        until = time.monotonic()
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        after = [c.snapshot() for c in clients]
        ticks_after = await tick_metrics(http, metrics_url)
        lag = (await loop_lag(http, api_metrics_url)).minus(lag_before)
    finally:
        stop.set()
        await asyncio.gather(*senders, return_exceptions=True)
    await asyncio.sleep(0.3)  # the last frames' answers
    await asyncio.gather(*(c.close() for c in clients))
    await wait_idle(http, metrics_url)

    window = until - since
    session_s = sessions * window
    delta = [
        tuple(a - b for a, b in zip(x, y, strict=True)) for x, y in zip(after, before, strict=True)
    ]
    sent, received, audio, words = (sum(d[i] for d in delta) for i in range(4))
    if surface in MOSHI:
        audio = sum(c.opus_audio_bytes(since, until) for c in clients)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in pids}
    errors = [e for c in clients for e in c.errors]
    row = {
        "surface": surface,
        "sessions": sessions,
        "window_s": window,
        "cpu_ms_per_session_s": {name: 1000 * v / session_s for name, v in cpu.items()},
        "cores": {name: v / window for name, v in cpu.items()},
        "up_bytes_per_session_s": sent / session_s,
        "down_bytes_per_session_s": received / session_s,
        "audio_back": audio / 2 / RATE / session_s,
        "words_per_session_s": words / session_s,
        "ticks": ticks_after["ticks"] - ticks_before["ticks"],
        "ticks_due": window / FRAME_S,
        "misses": ticks_after["misses"] - ticks_before["misses"],
        "silence": ticks_after["silence"] - ticks_before["silence"],
        "lag_p99_s": lag.quantile_bound(0.99),
        "lag_max_s": lag.max_bound(),
        "lag_mean_s": lag.total_s / lag.count if lag.count else float("nan"),
        "lag_samples": lag.count,
        "errors": errors,
        "closes": sorted({c.closed_reason for c in clients}),
        "kinds": merged_kinds(clients),
    }
    print(
        f"{sessions:3d} x {surface:11s}: pod {row['cpu_ms_per_session_s']['api']:.2f} "
        f"ms/session-s, loop lag p99 <= {lag_ms(row['lag_p99_s'])} ms (max <= "
        f"{lag_ms(row['lag_max_s'])} ms, mean {1000 * row['lag_mean_s']:.2f} ms, "
        f"{row['lag_samples']:.0f} samples) (worker "
        f"{row['cpu_ms_per_session_s']['worker']:.2f}, redis "
        f"{row['cpu_ms_per_session_s']['redis']:.2f}, load gen. "
        f"{row['cores']['load generator']:.2f} cores), "
        f"up {row['up_bytes_per_session_s']:.0f} B/s, down "
        f"{row['down_bytes_per_session_s']:.0f} B/s, audio back {row['audio_back']:.2f}, ticks "
        f"{row['ticks']:.0f}/{row['ticks_due']:.0f}, misses {row['misses']:.0f}, silence frames "
        f"{row['silence']:.0f}, {len(errors)} errors, closes {row['closes']}",
        flush=True,
    )
    for error in errors[:3]:
        print(f"    error: {error}", flush=True)
    return row


def merged_kinds(clients: list[Client]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for client in clients:
        for kind, count in client.kinds.items():
            kinds[kind] = kinds.get(kind, 0) + count
    return kinds


async def idle_pod(stack: Stack, seconds: float) -> float:
    """The API pod's own CPU-ms per second with no session (its periodic work)."""
    pid = stack.apis[0].process.pid
    before, since = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return 1000 * (cpu_seconds(pid) - before) / (time.monotonic() - since)


# ------------------------------------------------------------------ the codec alone


def codec_costs(repeats: int, frames: int = 250) -> dict[str, float]:
    """Microseconds per 80 ms frame, the median of `repeats` passes over `frames` frames:
    the pod's Opus work (decode a client page; encode the model's pcm16 frame), on the tone
    and on silence, against the JSON floor (parse an append and decode its base64; build a
    delta)."""
    streams = make_streams(frames * FRAME_S)
    pages = [m[1:] for m in streams.moshi[:frames]]
    quiet_pages = [m[1:] for m in streams.moshi_quiet[:frames]]
    step = 2 * FRAME_SAMPLES
    pcms = [streams.pcm[i * step : (i + 1) * step] for i in range(frames)]
    quiet = bytes(step)  # a listening model's frame: zeros
    appends = streams.duplex[:frames]

    def opus_decode() -> None:
        decoder = OpusDecoder()
        for page in pages:
            decoder.decode(page)

    def opus_decode_quiet() -> None:
        decoder = OpusDecoder()
        for page in quiet_pages:
            decoder.decode(page)

    # a listening Moshi's frame is low-level noise (its Mimi decoder's idle output), not zeros
    noise = (np.random.default_rng(0).standard_normal(FRAME_SAMPLES) * 30).astype("<i2")
    noisy = noise.tobytes()

    def encoding(make, frame_pcms) -> Callable[[], None]:
        def work() -> None:
            encoder = make()
            for pcm in frame_pcms:  # the pod's writer gets the model's frame as pcm16 bytes
                encoder.encode(pcm)

        return work

    def json_in() -> None:
        for append in appends:
            base64.b64decode(orjson.loads(append)["audio"], validate=True)

    def json_out() -> None:
        for pcm in pcms:
            orjson.dumps(
                {"type": "response.output_audio.delta", "delta": base64.b64encode(pcm).decode()}
            )

    def timed(work) -> float:
        passes = []
        for _ in range(repeats):
            started = time.perf_counter()
            work()
            passes.append((time.perf_counter() - started) / frames * 1e6)
        return statistics.median(passes)

    return {
        "opus_decode_us": timed(opus_decode),
        "opus_encode_us": timed(encoding(new_encoder, pcms)),
        "opus_decode_quiet_us": timed(opus_decode_quiet),
        "opus_encode_quiet_us": timed(encoding(new_encoder, [quiet] * frames)),
        "opus_encode_noise_us": timed(encoding(new_encoder, [noisy] * frames)),
        "sphn_encode_us": timed(encoding(SphnEncoder, pcms)),
        "sphn_encode_quiet_us": timed(encoding(SphnEncoder, [quiet] * frames)),
        "sphn_encode_noise_us": timed(encoding(SphnEncoder, [noisy] * frames)),
        "json_in_us": timed(json_in),
        "json_out_us": timed(json_out),
    }


# ------------------------------------------------------------------ the section


def render(
    results: list[dict], codec: dict[str, float], idle_ms_per_s: float, log: dict, args
) -> str:
    frames_per_s = 1 / FRAME_S
    floors = {r["sessions"]: r for r in results if r["surface"] == "duplex"}
    top = max(floors)
    headline = []
    for surface in ("moshi", "moshi_quiet", "live"):
        parts = []
        for r in results:
            if r["surface"] == surface and r["sessions"] in floors:
                mine = r["cpu_ms_per_session_s"]["api"]
                floor = floors[r["sessions"]]["cpu_ms_per_session_s"]["api"]
                parts.append(f"{mine / floor:.2f}x at {r['sessions']}")
        headline.append(f"{SURFACE_NAMES[surface].split(' (')[0]} {', '.join(parts)}")

    def marginal(row: dict) -> float:
        """Pod CPU-ms per session-second less the idle pod's share."""
        return row["cpu_ms_per_session_s"]["api"] - idle_ms_per_s / row["sessions"]

    def per_core(row: dict) -> float:
        """Sessions one core carries: what the idle pod leaves, over a session's cost."""
        return (1000 - idle_ms_per_s) / marginal(row)

    rows = [
        "| surface | sessions | pod CPU ms / session-s | / floor | less the idle pod "
        "| sessions per pod core "
        "| worker ms / session-s | Redis ms / session-s | load gen. cores | up B / session-s "
        "| down B / session-s | audio back | words / session-s | ticks / due, misses, silence "
        "| pod loop lag p99 ≤ ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ms = r["cpu_ms_per_session_s"]
        floor = floors.get(r["sessions"], r)["cpu_ms_per_session_s"]["api"]
        rows.append(
            f"| {SURFACE_NAMES[r['surface']]} | {r['sessions']} | {ms['api']:.2f} "
            f"| {ms['api'] / floor:.2f}x | {marginal(r):.2f} | {per_core(r):.0f} "
            f"| {ms['worker']:.2f} "
            f"| {ms['redis']:.2f} | {r['cores']['load generator']:.2f} "
            f"| {r['up_bytes_per_session_s']:,.0f} | {r['down_bytes_per_session_s']:,.0f} "
            f"| {r['audio_back']:.2f} | {r['words_per_session_s']:.1f} "
            f"| {r['ticks']:.0f} / {r['ticks_due']:.0f}, {r['misses']:.0f}, {r['silence']:.0f} "
            f"| {lag_ms(r['lag_p99_s'])} | {len(r['errors'])} |"
        )
    encoder_name = type(new_encoder()).__name__
    opus = codec["opus_decode_us"] + codec["opus_encode_us"]
    opus_quiet = codec["opus_decode_quiet_us"] + codec["opus_encode_quiet_us"]
    json_floor = codec["json_in_us"] + codec["json_out_us"]
    codec_rows = [
        "| work per 80 ms frame | µs per frame | ms per session-s (12.5 frames each way) |",
        "|---|---|---|",
        f"| Opus: decode a client page (`OpusDecoder`) | {codec['opus_decode_us']:.1f} "
        f"| {codec['opus_decode_us'] * frames_per_s / 1000:.2f} |",
        f"| Opus: decode a silent client page (`OpusDecoder`) "
        f"| {codec['opus_decode_quiet_us']:.1f} "
        f"| {codec['opus_decode_quiet_us'] * frames_per_s / 1000:.2f} |",
        *(
            f"| Opus: encode {what} (`{cls}`{note}) | {codec[key]:.1f} "
            f"| {codec[key] * frames_per_s / 1000:.2f} |"
            for cls, note, prefix in (
                (encoder_name, ", the pod's", "opus"),
                ("SphnEncoder", ", moshi.server's writer", "sphn"),
            )
            for what, key in (
                ("the model's pcm16 frame, the tone", f"{prefix}_encode_us"),
                ("a listening model's frame, zeros", f"{prefix}_encode_quiet_us"),
                ("a listening model's frame, low-level noise", f"{prefix}_encode_noise_us"),
            )
        ),
        f"| JSON: parse an append (orjson + base64) | {codec['json_in_us']:.1f} "
        f"| {codec['json_in_us'] * frames_per_s / 1000:.2f} |",
        f"| JSON: build a delta (base64 + orjson) | {codec['json_out_us']:.1f} "
        f"| {codec['json_out_us'] * frames_per_s / 1000:.2f} |",
        f"| **Opus both ways (the tone) / JSON both ways** | {opus:.1f} / {json_floor:.1f} "
        f"| {opus * frames_per_s / 1000:.2f} / {json_floor * frames_per_s / 1000:.2f} "
        f"({opus / json_floor:.0f}x) |",
        f"| **Opus both ways, silence** | {opus_quiet:.1f} "
        f"| {opus_quiet * frames_per_s / 1000:.2f} |",
    ]
    moshi_top = next(r for r in results if r["surface"] == "moshi" and r["sessions"] == top)
    extra = moshi_top["cpu_ms_per_session_s"]["api"] - floors[top]["cpu_ms_per_session_s"]["api"]
    codec_extra = (opus - json_floor) * frames_per_s / 1000
    cores = {r["surface"]: per_core(r) for r in results if r["sessions"] == top}
    lag_by_level = "; ".join(
        f"{level} sessions: "
        + ", ".join(
            f"{SURFACE_NAMES[r['surface']].split(' (')[0]} ≤ {lag_ms(r['lag_p99_s'])} ms"
            for r in results
            if r["sessions"] == level
        )
        for level in sorted({r["sessions"] for r in results})
    )
    command = (
        f"python -m bench.surface_cpu --levels {args.levels} --seconds {args.seconds:g} "
        f"--warmup {args.warmup:g} --idle-seconds {args.idle_seconds:g}"
    )
    if args.section != "surface_cpu":
        command += f" --section {args.section}"
    if args.label:
        command += f' --label "{args.label}"'
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}, code at commit {commit()}"
            + (f" ({args.label})" if args.label else "")
            + f": `{command}`. Load average (1 min) {args.load_at_start:.2f} at the start, "
            f"{os.getloadavg()[0]:.2f} at the end (other work on the machine shares its "
            "cores: the CPU time is the pod's own, its loop lag moves with the rest).",
            "",
            "One redis-server, one `duplex worker --plugin harness.frame_models:EchoFramePlugin`"
            ' (the echo frame model: each 80 ms frame said back 2 frames later, "." while it '
            "speaks), one `duplex api`; the load generator is another Python process on the "
            "same cores. N clients stream the same 440 Hz tone (24 kHz mono) in real time on "
            f"each surface in turn: {args.warmup:g} s of warm-up, then a {args.seconds:g} s "
            "window. Which rows are which: *Moshi, Ogg Opus* streams the tone on `/api/chat`, "
            "so the model speaks throughout (its audio and a word back every frame); *Moshi "
            "listening, Ogg Opus* is the same client streaming silence (zeros through the "
            "same Opus writer), so the model listens: what comes back is what the server "
            "sends for a quiet model (audio back near 1.00 and no words where it sends a "
            "silent frame for each frame, near 0 where it sends nothing); *GPT-Live, JSON* "
            "and *duplex, JSON* stream the tone as base64 pcm16, the duplex surface being "
            "the floor (no codec at the pod). *Pod CPU* is the API process's CPU time over "
            "the window (/proc) divided by session-seconds; bytes are WebSocket payloads; "
            "*audio back* is the model's audio received per second streamed (Opus pages "
            "decoded after the run); the tick columns are the worker's own (/metrics). "
            "*Pod loop lag p99* is read from the pod's own `duplex_event_loop_lag_seconds` "
            f"histogram (/metrics, a timer every {DEFAULT_INTERVAL_S * 1000:g} ms, so about "
            f"{1 / DEFAULT_INTERVAL_S:g} samples a second) before and after the window: it is "
            "the upper bound of the bucket where the window's cumulative count reaches 99% "
            f"(buckets {', '.join(lag_ms(b) for b in LAG_BUCKETS[:7])} ms and up: a p99 "
            "shown as 25 ms is somewhere between 10 and 25 ms).",
            "",
            f"**Pod CPU per session-second over the duplex JSON floor's, same run: "
            f"{'; '.join(headline)}.**",
            "",
            *rows,
            "",
            "The codec alone, in-process, on the same frames (services/api/ogg_opus.py "
            f"against base64 + orjson; median of {args.codec_repeats} passes over 250 frames):",
            "",
            *codec_rows,
            "",
            f"The idle pod (no session, {args.idle_seconds:g} s before the first window) used "
            f"{idle_ms_per_s:.2f} CPU-ms per second; it is in every row's pod CPU, and taken "
            "out in *less the idle pod*. *Sessions per pod core* is what one core of this "
            "machine carries at full load, no headroom: (1000 - idle) / (less the idle pod). "
            f"At {top} sessions: about {cores['moshi']:.0f} Moshi/Opus sessions with the "
            f"model speaking, {cores['moshi_quiet']:.0f} with the model listening, "
            f"{cores['live']:.0f} GPT-Live sessions and {cores['duplex']:.0f} duplex sessions "
            f"per core. The Opus surface (the model speaking) costs the pod {extra:.2f} ms per "
            f"session-second more than the floor; the codec alone accounts for "
            f"{codec_extra:.2f} ms of it.",
            "",
            f"The pod's loop lag p99 (bucket bound) by level: {lag_by_level}.",
            "",
            f"Server logs over the run: API pod {log['api']}; worker {log['worker']}.",
        ]
    )


def log_summary(text: str) -> str:
    lines = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    tracebacks = text.count("Traceback")
    if not lines and not tracebacks:
        return "no warnings or errors"
    return f"{len(lines)} warning/error lines, {tracebacks} tracebacks"


def log_lines(text: str, limit: int = 10) -> list[str]:
    lines = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    return lines[:limit]


async def main(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.levels.split(",")]
    args.load_at_start = os.getloadavg()[0]
    health = free_port()
    worker_env = {
        "DUPLEX_MAX_SESSIONS": str(max(levels) + 8),
        "DUPLEX_WORKER_HEALTH_PORT": str(health),
        # `harness` is not installed with the package: the worker finds the model here
        "PYTHONPATH": str(ROOT),
    }
    metrics_url = f"http://127.0.0.1:{health}/metrics"
    streams = make_streams(args.warmup + args.seconds + TAIL_S)
    results = []
    with Stack(plugin=PLUGIN, worker_env=worker_env) as stack:
        async with httpx.AsyncClient() as http:
            deadline = time.monotonic() + 30
            while True:  # the worker's health port answers once it serves
                try:
                    await tick_metrics(http, metrics_url)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            idle_ms_per_s = await idle_pod(stack, args.idle_seconds)
            print(f"idle pod: {idle_ms_per_s:.2f} CPU-ms per second", flush=True)
            for level in levels:
                for surface in SURFACES:
                    results.append(
                        await run_surface(
                            stack,
                            metrics_url,
                            f"http://127.0.0.1:{stack.apis[0].port}/metrics",
                            http,
                            streams,
                            surface,
                            level,
                            args.seconds,
                            args.warmup,
                        )
                    )
                    await asyncio.sleep(0.5)
        api_log, worker_log = stack.apis[0].logs(), stack.workers[0].logs()
    for name, text in (("api", api_log), ("worker", worker_log)):
        for line in log_lines(text):
            print(f"[{name} log] {line}")
    codec = codec_costs(args.codec_repeats)
    print(
        "codec, µs per 80 ms frame: "
        + ", ".join(f"{k.removesuffix('_us')} {v:.1f}" for k, v in codec.items()),
        flush=True,
    )
    log = {"api": log_summary(api_log), "worker": log_summary(worker_log)}
    table = render(results, codec, idle_ms_per_s, log, args)
    print(table)
    heading = "Native surfaces: the API pod's CPU per session, Opus against JSON"
    heading += " (`bench/surface_cpu.py`)"
    if args.label:
        heading += f", {args.label}"
    write_section("benchmarks.md", args.section, table, heading, args.docs or DOCS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="8,32", help="concurrent sessions per window")
    parser.add_argument("--seconds", type=float, default=12.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="streamed before the window")
    parser.add_argument(
        "--idle-seconds", type=float, default=4.0, help="the idle pod's window, before any"
    )
    parser.add_argument("--codec-repeats", type=int, default=7)
    add_output_arguments(parser, "surface_cpu")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
