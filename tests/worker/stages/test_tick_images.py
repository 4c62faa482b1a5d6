"""Camera frames through the tick-batched stage: an append's images reach the model in the
step of the frame that holds the append's last sample, never with a frame stepped on
silence; more than the model takes in one frame keep the newest; what the model cannot
take is dropped and counted, never passed on (services/worker/stages/slots.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from prometheus_client import generate_latest

from harness.frame_models import FRAME_SAMPLES, EchoFrameModel, tone
from shared.contracts import FrameOutput, ImageInput
from tests.worker.stages.test_tick_batched import Rig

HALF = FRAME_SAMPLES // 2


class SeeingEchoModel(EchoFrameModel):
    """The echo model, taking one image a frame: `seen[k]` is what step k gave each slot."""

    image_input = ImageInput(max_per_frame=1, max_bytes=64)

    def __init__(self, slots: int, image_input: ImageInput | None = image_input) -> None:
        super().__init__(slots, delay_frames=2)
        self.image_input = image_input
        self.seen: list[list[tuple[bytes, ...]] | None] = []

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        self.checked_active(frames, active, images)
        self.seen.append(None if images is None else list(images))
        return super().step(frames, active, images)


def seen_by(model: SeeingEchoModel, slot: int) -> list[tuple[bytes, ...]]:
    """What each step gave `slot` (() where the step had no image at all)."""
    return [() if step is None else step[slot] for step in model.seen]


@pytest.fixture
async def rig():
    made = Rig(model=SeeingEchoModel(2))
    yield made
    await made.port.shutdown()


async def test_an_image_goes_with_the_frame_that_holds_its_append_s_last_sample(rig):
    await rig.open("a")
    await rig.open("b")
    audio, f = tone(4), FRAME_SAMPLES
    rig.port.feed("a", audio[:HALF], images=(b"A",))  # ends inside frame 1
    rig.port.feed("a", audio[HALF : f + HALF])
    rig.port.feed("a", audio[f + HALF : 2 * f], images=(b"B",))  # ends at frame 2's end
    rig.port.feed("a", audio[2 * f : 3 * f])
    rig.port.feed("a", audio[3 * f : 3 * f + 1], images=(b"C",))  # one sample into frame 4
    for index in range(4):
        rig.port.feed("b", audio[index * f : (index + 1) * f])
    await rig.tick(4)  # the 4th: frame 4 has not arrived whole, stepped on silence
    assert seen_by(rig.model, 0) == [(b"A",), (b"B",), (), ()]
    assert seen_by(rig.model, 1) == [()] * 4  # the other slot's frames carry none
    rig.port.feed("a", audio[3 * f + 1 :])
    await rig.tick()
    assert seen_by(rig.model, 0)[4] == (b"C",)
    assert rig.port.stats()["silence_frames_by_session"]["a"] == 1
    assert rig.port.stats()["stepped_images"] == 3
    assert rig.port.stats()["dropped_images"] == 0


async def test_an_image_waits_for_its_audio_past_a_frame_stepped_on_silence(rig):
    await rig.open("a")
    rig.port.feed("a", tone(1)[:HALF], images=(b"A",))
    await rig.tick()  # half a frame: stepped on silence, without the image
    assert rig.port.stats()["silence_frames"] == 1 and rig.model.seen == [None]
    rig.port.feed("a", tone(1)[HALF:])
    await rig.tick()
    assert rig.model.seen[1] == [(b"A",), ()]


async def test_more_images_than_a_frame_takes_keep_the_newest(rig):
    await rig.open("a")
    for index, image in enumerate((b"1", b"2", b"3")):  # three appends in one frame
        rig.port.feed("a", tone(1)[index * 600 : (index + 1) * 600], images=(image,))
    rig.port.feed("a", tone(1)[1800:])
    await rig.tick()
    assert seen_by(rig.model, 0) == [(b"3",)]
    assert rig.port.stats()["dropped_images"] == 2
    text = generate_latest(rig.registry).decode()
    assert 'duplex_tick_dropped_images_total{model="frame_echo"} 2.0' in text


async def test_what_the_model_cannot_take_is_dropped_and_never_passed_on():
    rig = Rig(model=SeeingEchoModel(1, image_input=None))
    sized = Rig(model=SeeingEchoModel(1))
    try:
        for made in (rig, sized):
            await made.open("a")
        rig.port.feed("a", tone(1), images=(b"x",))  # a model that takes none
        sized.port.feed("a", tone(1), images=(bytes(65),))  # past its 64 bytes
        for made in (rig, sized):
            await made.tick()
            assert made.model.seen == [None]  # no image reached the model
            assert made.port.stats()["dropped_images"] == 1
    finally:
        await rig.port.shutdown()
        await sized.port.shutdown()


async def test_an_image_of_input_cut_goes_with_the_next_frame_taken():
    rig = Rig(model=SeeingEchoModel(1), max_buffered_frames=2)
    try:
        await rig.open("a")
        rig.port.feed("a", tone(1), images=(b"old",))
        rig.port.feed("a", tone(2))  # far ahead: the first frame, old's audio, is cut
        assert rig.port.stats()["dropped_input_frames"] == 1
        await rig.tick()
        rig.port.feed("a", tone(1)[:HALF], images=(b"new",))  # ends in the 4th frame
        await rig.tick()
        assert seen_by(rig.model, 0) == [(b"old",), ()]
        assert rig.port.stats()["dropped_images"] == 0
    finally:
        await rig.port.shutdown()


def test_a_plugin_and_its_model_must_declare_the_same_images():
    from harness.frame_models import EchoFramePlugin
    from services.worker.stages.tick_batched import TickBatchedStagePort

    with pytest.raises(ValueError, match="image input"):
        TickBatchedStagePort.for_plugin(EchoFramePlugin(), SeeingEchoModel(1))
