"""`ImageInput`: the camera frames a frame-clocked model takes with its audio.

A model that sees (MiniCPM-o 4.5) gets the client's camera frames as the encoded images
they came as (JPEG or PNG; the duplex surface's `input_audio_buffer.append.video_frames`),
with the frame of audio they were sent with (`FrameModel.step`). The worker checks what it
can without decoding a pixel (base64, the count, the size, the format by its first bytes:
`image_format`) and refuses the rest with `invalid_video_frames`; the model decodes them,
and an image it cannot decode is its frame's non-fatal error.
"""

from __future__ import annotations

import dataclasses

#: the encodings a model's images come in, by the bytes each starts with
IMAGE_SIGNATURES = {
    "jpeg": b"\xff\xd8\xff",
    "png": b"\x89PNG\r\n\x1a\n",
}


def image_format(data: bytes) -> str | None:
    """ "jpeg" or "png" by the image's first bytes; None for anything else (its pixels are
    not looked at: a file that starts right and is broken after is the model's to refuse)."""
    for name, signature in IMAGE_SIGNATURES.items():
        if data.startswith(signature):
            return name
    return None


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """What camera frames a model takes (`FrameModel.image_input`; the plugin declares the
    same before its model is loaded, `FrameClockedPlugin.image_input`)."""

    #: the most images one slot's frame may carry: the worker refuses an append with more,
    #: and of the frames more appends attach to one step the newest this many are kept
    max_per_frame: int
    #: the most bytes one encoded image may have
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_per_frame < 1 or self.max_bytes < 1:
            raise ValueError(f"an image input takes at least one image of one byte: {self}")


__all__ = ["IMAGE_SIGNATURES", "ImageInput", "image_format"]
