"""MAP Realtime V1's socket on its own (services/api/map_realtime.py): the route a subprotocol
names on a shared path, `session.init` mapped to the session object (and what is refused),
the queue's view of the workers, and what the socket sends for the session's events and
its client's messages, with a socket and a session the test plays (the real processes:
tests/e2e/test_map_realtime.py, the protocol suite, and OpenBMB's SDK in tests/map_client).
"""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocket

from services.api.attachment import AttachFailed
from services.api.command_sender import failure_event
from services.api.delivery import SessionParts
from services.api.inbox_writer import InboxFull
from services.api.map_realtime import (
    FINAL_ERROR,
    MAX_REF_AUDIO_S,
    PARSE_INLINE_MAX_CHARS,
    InitRefused,
    MapConnection,
    mode_from_query,
    session_from_init,
)
from services.api.metrics import ApiMetrics
from services.api.output_queue import OutItem
from services.api.socket_driver import SocketEndpoint
from shared.protocol.duplex import AppendAudio, BargeIn, CloseSession, DuplexErrorEvent
from shared.redis.boundary import WorkerRegistration
from tests.api.test_native_connections import Session, Socket
from tests.api.test_ws_protocol import door_app

F32_16K = {"type": "audio/pcm_f32le", "rate": 16_000}
F32_24K = {"type": "audio/pcm_f32le", "rate": 24_000}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------- the route


class MapLike(SocketEndpoint):
    """An endpoint named by a subprotocol on `/v1/realtime`, as MAP Realtime's is."""

    subprotocol = "map.realtime"

    def match(self, path: str):
        return () if path == "/v1/realtime" else None

    async def __call__(self, websocket: WebSocket) -> None:  # type: ignore[override]
        await websocket.accept(subprotocol="map.realtime")
        await websocket.send_json({"protocol": "map"})
        await websocket.close()


def test_the_subprotocol_names_the_protocol_on_a_shared_path():
    app, routed = door_app()
    app.socket_endpoints = (MapLike(), *app.socket_endpoints)
    client = TestClient(app)
    with client.websocket_connect("/v1/realtime", subprotocols=["map.realtime"]) as ws:
        assert ws.receive_json() == {"protocol": "map"}
        assert ws.accepted_subprotocol == "map.realtime"
    headers = {"authorization": "Bearer k1"}
    with client.websocket_connect("/v1/realtime", headers=headers) as ws:
        assert ws.receive_json()["surface"] == "openai"  # no subprotocol: OpenAI's
    with client.websocket_connect("/v1/realtime", headers=headers, subprotocols=["realtime"]) as ws:
        assert ws.receive_json()["surface"] == "openai"
    duplex = client.websocket_connect("/v1/duplex", headers=headers, subprotocols=["map.realtime"])
    with duplex as ws:  # the subprotocol names the protocol on its own path only
        assert ws.receive_json()["surface"] == "duplex"
    assert routed == []


# ---------------------------------------------------------------- session.init


def ref_audio_samples(data_url: str) -> np.ndarray:
    prefix = "data:audio/wav;base64,"
    assert data_url.startswith(prefix)
    with wave.open(io.BytesIO(base64.b64decode(data_url[len(prefix) :]))) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (16_000, 1, 2)
        return np.frombuffer(wav.readframes(wav.getnframes()), "<i2") / 32767


def test_session_init_is_mapped_to_the_session_object():
    voice = np.linspace(-0.5, 0.5, 1600, dtype=np.float32)  # 100 ms
    other = np.full(800, 0.25, np.float32)
    init = {
        "type": "session.init",
        "payload": {
            "system_prompt": "Be brief.",
            "config": {
                "temperature": 0.6,
                "max_tokens": 15,
                "length_penalty": 1.2,
                "max_kv_tokens": 8000,
                "tts_enabled": True,
                "vision_hd": True,
            },
            "voice": {
                "ref_audio_base64": b64(voice.tobytes()),
                "tts_ref_audio_base64": b64(other.tobytes()),
            },
            "max_slice_nums": 4,
        },
    }
    session = session_from_init(init, "minicpmo")
    ref, tts_ref = session.pop("ref_audio"), session["extra_body"].pop("tts_ref_audio")
    assert session == {
        "duplex_surface": "map",
        "model": "minicpmo",
        "audio": {"input": {"format": F32_16K}, "output": {"format": F32_24K}},
        "instructions": "Be brief.",
        "temperature": 0.6,
        "extra_body": {
            "max_new_speak_tokens_per_chunk": 15,
            "length_penalty": 1.2,
            "max_kv_tokens": 8000,
            "vision_hd": True,
            "max_slice_nums": 4,
        },
    }
    # the voices as WAV data URLs (the duplex surface's ref_audio form), same samples
    assert np.allclose(ref_audio_samples(ref), voice, atol=1e-4)
    assert np.allclose(ref_audio_samples(tts_ref), other, atol=1e-4)


def test_an_empty_init_opens_the_defaults_and_tts_off_is_a_text_session():
    assert session_from_init({"type": "session.init"}, None) == {
        "duplex_surface": "map",
        "audio": {"input": {"format": F32_16K}, "output": {"format": F32_24K}},
    }
    text_only = session_from_init({"payload": {"config": {"tts_enabled": False}}}, "m")
    assert text_only["modalities"] == ["text"]


TOO_LONG = np.zeros(MAX_REF_AUDIO_S * 16_000 + 1, np.float32).tobytes()


@pytest.mark.parametrize(
    "payload, code, param",
    [
        ([], "invalid_session_config", "payload"),
        ({"instructions": "x"}, "invalid_session_config", "payload.instructions"),
        ({"system_prompt": 3}, "invalid_session_config", "payload.system_prompt"),
        ({"config": []}, "invalid_session_config", "payload.config"),
        (
            {"config": {"temperature": "hot"}},
            "invalid_session_config",
            "payload.config.temperature",
        ),
        ({"config": {"temperature": 2.5}}, "invalid_session_config", "payload.config.temperature"),
        ({"config": {"max_tokens": 0}}, "invalid_session_config", "payload.config.max_tokens"),
        ({"config": {"max_tokens": True}}, "invalid_session_config", "payload.config.max_tokens"),
        (
            {"config": {"length_penalty": 9}},
            "invalid_session_config",
            "payload.config.length_penalty",
        ),
        ({"config": {"tts_enabled": 1}}, "invalid_session_config", "payload.config.tts_enabled"),
        ({"config": {"top_k": 5}}, "invalid_session_config", "payload.config.top_k"),
        ({"max_slice_nums": 0}, "invalid_session_config", "payload.max_slice_nums"),
        ({"voice": {"ref_audio_base64": "!"}}, "bad_audio", "payload.voice.ref_audio_base64"),
        (
            {"voice": {"ref_audio_base64": b64(b"12345")}},
            "bad_audio",
            "payload.voice.ref_audio_base64",
        ),
        (
            {"voice": {"ref_audio_base64": b64(TOO_LONG)}},
            "bad_audio",
            "payload.voice.ref_audio_base64",
        ),
        (
            {"voice": {"ref_audio_url": "x"}},
            "invalid_session_config",
            "payload.voice.ref_audio_url",
        ),
    ],
)
def test_an_init_the_session_cannot_take_is_refused_naming_the_field(payload, code, param):
    with pytest.raises(InitRefused) as refused:
        session_from_init({"payload": payload}, "m")
    assert (refused.value.code, refused.value.param) == (code, param)
    assert refused.value.message


def test_the_mode_is_audio_or_video():
    assert mode_from_query(QueryParams("model=m")) == "audio"
    assert mode_from_query(QueryParams("mode=video")) == "video"
    with pytest.raises(InitRefused) as refused:
        mode_from_query(QueryParams("mode=omni"))
    assert refused.value.param == "mode"


# ---------------------------------------------------------------- the queue's view


class Directory:
    def __init__(self, *workers: WorkerRegistration) -> None:
        self.workers = list(workers)

    async def live_workers(self) -> list[WorkerRegistration]:
        return self.workers


def worker(model: str, active: int, *, native: bool = True, sees: bool = False, **kw):
    capabilities = {"supports_model_native_turn_policy": native, "supports_image_input": sees}
    return WorkerRegistration(
        worker_id=f"w-{model}-{active}",
        model=model,
        max_sessions=2,
        active=active,
        capabilities=capabilities,
        **kw,
    )


def connection(query: str, directory: Directory | None = None, session: Session | None = None):
    session = session or Session()
    parts = SessionParts(session, session, None)  # type: ignore[arg-type]
    made = MapConnection(
        Socket(),  # type: ignore[arg-type]
        parts,
        ApiMetrics(),
        directory or Directory(),  # type: ignore[arg-type]
        QueryParams(query),
        admission_wait_s=1,
        config_timeout_s=1,
        ready_timeout_s=1,
        max_input_bytes=1 << 20,
    )
    made.mode = mode_from_query(made.query)
    return made, session


async def room(query: str, *workers: WorkerRegistration) -> bool | str:
    made, _ = connection(query, Directory(*workers))
    try:
        return await made._room()
    except InitRefused as refused:
        return f"{refused.code}: {refused.message}"


async def test_the_queue_waits_for_a_free_slot_of_a_native_model_and_refuses_the_rest():
    assert await room("model=m", worker("m", 1)) is True
    assert await room("model=m", worker("m", 2)) is False  # full: wait
    assert await room("model=m", worker("m", 0, draining=True)) is False
    assert await room("model=m") is False  # no worker live yet: wait
    assert await room("model=m", worker("other", 0)) == (
        "invalid_session_config: model 'm' is not served; try ['other']"
    )
    assert "not a native" in str(await room("model=m", worker("m", 0, native=False)))
    # a camera needs a model that takes its frames: said before any wait
    refused = await room("mode=video&model=m", worker("m", 0))
    assert refused == (
        "invalid_session_config: model 'm' takes no camera frames: connect with mode=audio"
    )
    assert await room("mode=video&model=m", worker("m", 0, sees=True)) is True


# ---------------------------------------------------------------- the session's events


def sent(socket: Socket) -> list[dict]:
    return [orjson.loads(m) for m in socket.sent]


async def test_the_models_readiness_is_maps_session_created():
    made, _ = connection("model=m")
    ready = {"type": "session.started", "event_id": "event_1", "session_id": "duplex-1"}
    assert await made.send_item(OutItem(orjson.dumps(ready), "session.started"))
    assert sent(made.ws) == [  # type: ignore[arg-type]
        {"type": "session.created", "event_id": "event_1", "session_id": "duplex-1"}
    ]
    assert made.created.is_set()


@pytest.mark.parametrize(
    "code, kind", [("output_overflow", "error"), ("input_backpressure", "warning")]
)
async def test_the_pods_own_errors_are_errors_only_when_the_session_ends_on_them(code, kind):
    made, _ = connection("model=m")
    duplex_shaped = DuplexErrorEvent.for_code(code, "why", related_event_id="e1")
    await made.send_item(OutItem(duplex_shaped.to_json(), "error"))
    (said,) = sent(made.ws)  # type: ignore[arg-type]
    assert said["type"] == kind and said[kind]["code"] == code
    assert "event_id" not in said[kind]  # MAP's client events carry no id to echo


async def test_an_error_said_before_the_socket_closes_is_an_error_whatever_its_code():
    made, session = connection("model=m")
    made._end("resource_exhausted", "no slot came free")
    item = await session.get()
    assert item.wire_type == FINAL_ERROR
    await made.send_item(item)
    (said,) = sent(made.ws)  # type: ignore[arg-type]
    assert said["type"] == "error" and said["error"]["code"] == "resource_exhausted"


@pytest.mark.parametrize(
    "event, reason",
    [
        (
            {"type": "session.closed", "event_id": "event_2", "reason": "client_close"},
            "client_close",
        ),
        ({"type": "session.closed", "reason": "worker_lost", "session_id": "s"}, "worker_lost"),
        ({"type": "session.expired", "reason": "idle_ttl_expired"}, "expired"),
        ({"type": "session.resync_required", "reason": "journal_gap"}, "resync_required"),
    ],
)
async def test_every_end_is_maps_session_closed_and_the_socket_closes(event, reason):
    made, _ = connection("model=m")
    assert not await made.send_item(OutItem(orjson.dumps(event), event["type"]))
    (closed,) = sent(made.ws)  # type: ignore[arg-type]
    assert {k: v for k, v in closed.items() if k != "event_id"} == {
        "type": "session.closed",
        "reason": reason,
    }
    assert made.ws.closed == (1000, "")  # type: ignore[attr-defined]


async def test_a_commands_failure_is_a_warning():
    _, session = connection("model=m")  # the connection points the report at its refusal
    session.commands.report(failure_event(InboxFull("full"), None))
    said = orjson.loads((await session.get()).data)
    assert said["type"] == "warning" and said["warning"]["code"] == "input_backpressure"


# ---------------------------------------------------------------- the client's messages


def append(**fields) -> dict:
    audio = np.full(1600, 0.1, np.float32).tobytes()
    text = orjson.dumps({"type": "input.append", "input": {"audio": b64(audio), **fields}})
    return {"type": "websocket.receive", "text": text.decode()}


async def test_an_append_is_the_duplex_surfaces_and_force_listen_cuts_the_speech():
    made, session = connection("mode=video&model=m")
    frame = b64(b"\xff\xd8\xff\xe0jpeg")
    await made.on_message(append(video_frames=[frame]))
    (first,) = session.sent
    assert isinstance(first, AppendAudio)
    assert (first.format, first.sample_rate_hz, first.video_frames) == (
        "pcm_f32le",
        16000,
        (frame,),
    )
    assert len(first.audio) == 1600 * 4 and "force_listen" not in first.hints
    # the model listening: a forced listen is the append's hint alone
    await made.on_message(append(force_listen=True))
    assert isinstance(session.sent[1], AppendAudio) and session.sent[1].hints["force_listen"]
    # the model speaking: its speech is cut first (BargeIn), then the append
    delta = {"type": "response.output_audio.delta", "audio": b64(b"\0" * 8)}
    await made.send_item(OutItem(orjson.dumps(delta), "response.output_audio.delta"))
    await made.on_message(append(force_listen=True))
    assert [type(c) for c in session.sent[2:]] == [BargeIn, AppendAudio]
    assert session.sent[3].hints == {"force_listen": True}
    await made.on_message({"type": "websocket.receive", "text": '{"type":"session.close"}'})
    assert isinstance(session.sent[-1], CloseSession)
    assert session.sent[-1].reason == "client_close"


async def test_a_large_append_is_taken_whole():
    """Parsed off the loop (over PARSE_INLINE_MAX_CHARS), the same append."""
    made, session = connection("model=m")
    five_seconds = np.full(5 * 16_000, 0.2, np.float32).tobytes()
    text = orjson.dumps({"type": "input.append", "input": {"audio": b64(five_seconds)}}).decode()
    assert len(text) > PARSE_INLINE_MAX_CHARS
    await made.on_message({"type": "websocket.receive", "text": text})
    (taken,) = session.sent
    assert isinstance(taken, AppendAudio) and taken.audio == five_seconds


class Racing(Session):
    """An attachment whose first open finds the slot taken by another client."""

    def __init__(self) -> None:
        super().__init__()
        self.opens = 0

    async def open(self, session: dict, default_model) -> dict:
        self.opens += 1
        if self.opens == 1:
            full = DuplexErrorEvent.for_code("resource_exhausted", "every worker is full")
            raise AttachFailed(full)
        return {"type": "session.created", "session": {"id": self.session_id, **session}}

    def created(self, reply: dict) -> None:
        self.queue.put(OutItem(orjson.dumps(reply), "session.created"))


async def test_a_slot_taken_between_the_queue_and_the_open_sends_the_client_back_to_it():
    session = Racing()
    made, _ = connection("model=m", Directory(worker("m", 0)), session)
    made.admission_wait_s = 30
    await made.ws.incoming.put(  # type: ignore[attr-defined]
        {"type": "websocket.receive", "text": '{"type":"session.init","payload":{}}'}
    )
    assert await made.open(None)  # type: ignore[arg-type]
    said = []
    while len(session.queue):
        said.append((await session.get()).wire_type)
    # the SDK sends session.init once: the second queue_done only says the wait is over
    assert said == [
        "session.queue_done",
        "session.queued",
        "session.queue_done",
        "session.created",  # ours, the open's reply: MAP's comes with the model's readiness
    ]
    assert session.opens == 2
