"""The bare floor (bench/bare_floor.py) answers a turn as the real echo path does, frame for
frame in type, JSON shape and size, so bench.capacity's API/floor and worker/floor ratios
compare like with like; and it answers what bench.latency and the ramps send it."""

import asyncio
import collections

import orjson
import websockets

from bench.bare_floor import BareFloorProcess
from bench.capacity import SESSION, append_frames
from bench.common import Stack


async def open_session(ws_base: str) -> websockets.ClientConnection:
    ws = await websockets.connect(f"{ws_base}/v1/realtime?duplex=1", max_size=None)
    await ws.send(orjson.dumps({"type": "session.update", "session": SESSION}).decode())
    assert orjson.loads(await ws.recv())["type"] == "session.created"
    assert orjson.loads(await ws.recv())["type"] == "session.updated"
    return ws


async def one_turn(ws_base: str) -> list[str]:
    """2 s of speech, a commit, and every frame up to and with response.done."""
    ws = await open_session(ws_base)
    speech, _ = append_frames()
    for frame in speech:
        await ws.send(frame)
    await ws.send('{"type":"input.commit"}')
    frames: list[str] = []
    async with asyncio.timeout(30):
        while not frames or orjson.loads(frames[-1])["type"] != "response.done":
            frames.append(await ws.recv())
    await ws.close()
    return frames


def shape(value):
    """The JSON's structure: keys and value types, not the values."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def of_type(frames: list[str], wire_type: str) -> list[str]:
    return [raw for raw in frames if orjson.loads(raw)["type"] == wire_type]


def test_the_floor_sends_what_the_echo_worker_sends():
    async def run() -> tuple[list[str], list[str], list[str]]:
        with Stack() as stack:
            real = await one_turn(stack.ws_bases()[0])
        with BareFloorProcess() as floor:
            deltas_only = await one_turn(floor.ws_base)
        with BareFloorProcess(frames="wire") as floor:
            wire = await one_turn(floor.ws_base)
        return real, deltas_only, wire

    real, deltas_only, wire = asyncio.run(run())
    real_deltas = of_type(real, "response.output_audio.delta")
    assert len(real_deltas) == 20  # the scenario the floor copies: 2 s answered in 100 ms
    for floor in (deltas_only, wire):
        deltas = of_type(floor, "response.output_audio.delta")
        assert len(deltas) == len(real_deltas)
        for ours, theirs in zip(deltas, real_deltas, strict=True):
            assert shape(orjson.loads(ours)) == shape(orjson.loads(theirs))
            assert abs(len(ours) - len(theirs)) <= 8  # the seq's digits may differ
        (done,) = of_type(floor, "response.done")
        (real_done,) = of_type(real, "response.done")
        assert shape(orjson.loads(done)) == shape(orjson.loads(real_done))
        assert abs(len(done) - len(real_done)) <= 8
    assert [orjson.loads(raw)["type"] for raw in deltas_only] == [
        *["response.output_audio.delta"] * 20,
        "response.done",
    ]
    # --frames wire: every event of the real turn, as many of each type
    count = collections.Counter
    assert count(orjson.loads(raw)["type"] for raw in wire) == count(
        orjson.loads(raw)["type"] for raw in real
    )


def test_the_floor_answers_heartbeats_and_closes():
    async def run() -> list[str]:
        with BareFloorProcess() as floor:
            ws = await open_session(floor.ws_base)
            await ws.send('{"type":"session.heartbeat"}')
            ack = orjson.loads(await ws.recv())
            await ws.send('{"type":"session.close"}')
            closed = orjson.loads(await ws.recv())
            async with asyncio.timeout(10):
                await ws.wait_closed()
            return [ack["type"], closed["type"], ws.close_code]

    assert asyncio.run(run()) == ["session.heartbeat_ack", "session.closed", 1000]
