"""An append's camera frames in a model-native session: checked at the append's dispatch
against what the model takes (video_frames.py), refused whole with `invalid_video_frames`
while the session goes on, and otherwise handed to the model with the frame of audio the
append's last sample lands in."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from harness.frame_models import FRAME_SAMPLES, RATE, EchoFramePlugin, tone
from harness.sessions import appends
from services.worker.engine.video_frames import camera_frames
from shared.contracts import DuplexSessionError, ImageInput
from shared.protocol.duplex import AppendAudio, float_to_pcm16
from tests.worker.engine.test_native_stream import Rig
from tests.worker.stages.test_tick_images import SeeingEchoModel, seen_by

SPEC = ImageInput(max_per_frame=1, max_bytes=64)
JPEG = b"\xff\xd8\xff\xe0" + b"j" * 20
PNG = b"\x89PNG\r\n\x1a\n" + b"p" * 20


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_good_frames_come_back_as_their_bytes():
    assert camera_frames([b64(JPEG)], SPEC) == (JPEG,)
    assert camera_frames([b64(JPEG), b64(PNG)], ImageInput(2, 64)) == (JPEG, PNG)
    assert camera_frames([], None) == ()


@pytest.mark.parametrize(
    ("frames", "spec", "param", "says"),
    [
        ([b64(JPEG)], None, "video_frames", "takes no video"),
        ([b64(JPEG), b64(PNG)], SPEC, "video_frames", "at most 1"),
        (["not*base64"], SPEC, "video_frames[0]", "not valid base64"),
        ([b64(b"\xff\xd8\xff" + bytes(62))], SPEC, "video_frames[0]", "larger than"),
        ([b64(b"\xff\xd8\xff" + bytes(600))], SPEC, "video_frames[0]", "larger than"),
        ([b64(b"GIF89a" + bytes(8))], SPEC, "video_frames[0]", "not a JPEG or PNG"),
    ],
)
def test_bad_frames_are_refused_with_the_frame_at_fault(frames, spec, param, says):
    with pytest.raises(DuplexSessionError) as refused:
        camera_frames(frames, spec)
    assert refused.value.code == "invalid_video_frames"
    assert refused.value.param == param and says in refused.value.message


class SeeingEchoPlugin(EchoFramePlugin):
    """The echo frame plugin whose model takes one image a frame (`SeeingEchoModel`)."""

    image_input = SeeingEchoModel.image_input

    def frame_model(self, max_sessions: int) -> SeeingEchoModel:
        model = SeeingEchoModel(min(max_sessions, self.slots or max_sessions))
        self.models.append(model)
        return model


def append(samples: np.ndarray, *frames: str, event_id: str = "") -> AppendAudio:
    pcm = float_to_pcm16(samples)
    return AppendAudio(
        event_id=event_id or None,
        audio=pcm,
        format="pcm16",
        sample_rate_hz=RATE,
        video_frames=tuple(frames),
    )


@pytest.fixture
async def rig():
    made = Rig(plugin=SeeingEchoPlugin(slots=2), max_sessions=2)
    yield made
    await made.manager.shutdown()


async def test_an_append_s_frames_reach_the_model_with_its_audio(rig):
    session = await rig.open()
    assert session.session["capabilities"]["optional_input_modalities"] == ["video"]
    half = FRAME_SAMPLES // 2
    await session.send(append(tone(2)[:half]))
    await session.send(append(tone(2)[half : FRAME_SAMPLES + half], b64(JPEG)))  # ends in frame 2
    await session.send(append(tone(2)[FRAME_SAMPLES + half :]))
    await rig.settle(session)
    await rig.tick(2)
    slot = rig.port.slot_of(session.session_id)
    assert seen_by(rig.model, slot) == [(), (JPEG,)]


async def test_a_bad_append_is_refused_whole_and_the_session_goes_on(rig):
    session = await rig.open()
    await session.send(append(tone(1), b64(b"GIF89a" + bytes(8)), event_id="bad"))
    error = (await session.until("error"))[-1]
    assert error.code == "invalid_video_frames" and error.param == "video_frames[0]"
    assert error.related_event_id == "bad"
    await session.send(append(tone(1), b64(PNG)))  # the next one is taken
    await rig.settle(session)
    await rig.tick()
    slot = rig.port.slot_of(session.session_id)
    assert seen_by(rig.model, slot) == [(PNG,)]  # the refused append's audio never came
    assert rig.manager.table.runner(session.session_id).session.pending_input_bytes == 0


async def test_video_to_a_model_that_takes_none_is_refused():
    rig = Rig()
    try:
        session = await rig.open()
        assert session.session["capabilities"]["optional_input_modalities"] == []
        await session.send(append(tone(1), b64(JPEG), event_id="v"))
        error = (await session.until("error"))[-1]
        assert (error.code, error.related_event_id) == ("invalid_video_frames", "v")
        for command in appends(tone(1), RATE, chunk_ms=80):  # audio alone is taken
            await session.send(command)
        await rig.settle(session)
        assert rig.manager.table.runner(session.session_id).session.input.samples > 0
    finally:
        await rig.manager.shutdown()
