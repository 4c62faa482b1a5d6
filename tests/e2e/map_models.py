"""A frame model that sees, for the MAP Realtime tests (tests/e2e/test_map_realtime.py and the
SDK's, tests/map_client): the echo frame model (harness.frame_models) that also takes one
camera frame with a frame of audio and says what it got, so that a client sees its JPEG
reach the model byte for byte.

`duplex serve --plugin tests.e2e.map_models:SeeingEchoFramePlugin` (with the checkout on
PYTHONPATH): the model `frame_echo_seeing`. Each image a slot gets is remembered, and the
slot's next speaking frame says `<jpeg N sha256:XXXXXXXX>` (the image's format by its first
bytes, its size and the start of its SHA-256) in place of the echo's ".".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from harness.frame_models import EchoFrameModel, EchoFramePlugin
from shared.contracts import FrameOutput, ImageInput
from shared.contracts.images import image_format

#: one camera frame with each frame of audio, up to 256 KiB (a webcam JPEG)
SEEING = ImageInput(max_per_frame=1, max_bytes=256 * 1024)


def seen(image: bytes) -> str:
    """What the model says of an image (the client computes the same to compare)."""
    digest = hashlib.sha256(image).hexdigest()[:8]
    return f"<{image_format(image) or 'image'} {len(image)} sha256:{digest}>"


class SeeingEchoFrameModel(EchoFrameModel):
    image_input = SEEING

    def __init__(self, slots: int, **options: int) -> None:
        super().__init__(slots, **options)
        self.pending: list[list[str]] = [[] for _ in range(slots)]

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        outputs = super().step(frames, active, images)
        for slot, output in enumerate(outputs):
            if output is None:
                continue
            if images is not None:
                self.pending[slot].extend(seen(image) for image in images[slot])
            if output.speaking and self.pending[slot]:
                output.text = "".join(self.pending[slot])
                self.pending[slot].clear()
        return outputs

    def open_slot(self, slot: int, options) -> None:  # type: ignore[no-untyped-def]
        super().open_slot(slot, options)
        self.pending[slot] = []


class SeeingEchoFramePlugin(EchoFramePlugin):
    plugin_id = "frame_echo_seeing"
    image_input: ClassVar[ImageInput | None] = SEEING

    def frame_model(self, max_sessions: int) -> SeeingEchoFrameModel:
        slots = min(max_sessions, self.slots) if self.slots else max_sessions
        model = SeeingEchoFrameModel(
            slots, delay_frames=self.delay_frames, replay_chunk_frames=self.replay_chunk_frames
        )
        self.models.append(model)
        return model
