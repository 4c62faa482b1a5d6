"""An append's camera frames (`video_frames`), checked for a model-native session's model.

The duplex surface's `input_audio_buffer.append` may carry camera frames (base64 JPEG or
PNG, the API pod has checked the base64). A frame-clocked model that sees takes them with
the frame of audio they came with (`FrameModel.image_input`); here, at the append's
dispatch and before anything of it is applied, the worker checks them against what the
model takes without decoding a pixel: the base64 again (a door other than the duplex
surface's may build the append), at most `max_per_frame` of them (an append's frames all go
with the one frame of audio its last sample lands in), each at most `max_bytes`, each a
JPEG or a PNG by its first bytes. Any other append with video is refused whole (its audio
too) with `invalid_video_frames`, and the session goes on: a model that takes no images
(Moshi, Nemotron) is sent none rather than having them dropped without a word. Decoding
the images is the model's: one it cannot decode is its frame's non-fatal error.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from shared.contracts import DuplexSessionError, ImageInput, image_format
from shared.protocol.duplex.errors import INVALID_VIDEO_FRAMES


def camera_frames(frames: Sequence[str], spec: ImageInput | None) -> tuple[bytes, ...]:
    """The append's frames as the model takes them (encoded image bytes, in order), or
    `DuplexSessionError` `invalid_video_frames` naming the frame at fault (module head)."""
    if not frames:
        return ()
    if spec is None:
        raise DuplexSessionError(
            INVALID_VIDEO_FRAMES,
            "this model takes no video: send audio alone",
            param="video_frames",
        )
    if len(frames) > spec.max_per_frame:
        raise DuplexSessionError(
            INVALID_VIDEO_FRAMES,
            f"{len(frames)} video frames in one append: this model takes at most "
            f"{spec.max_per_frame} with each frame of its audio",
            param="video_frames",
        )
    images = []
    for index, frame in enumerate(frames):
        param = f"video_frames[{index}]"
        # the size first, from the base64's length: an image far past the cap is not decoded
        if len(frame) // 4 * 3 > spec.max_bytes + 2:
            raise _too_large(index, spec, param)
        try:
            image = base64.b64decode(frame, validate=True)
        except (binascii.Error, ValueError):
            raise DuplexSessionError(
                INVALID_VIDEO_FRAMES, f"video frame {index} is not valid base64", param=param
            ) from None
        if len(image) > spec.max_bytes:
            raise _too_large(index, spec, param)
        if image_format(image) is None:
            raise DuplexSessionError(
                INVALID_VIDEO_FRAMES,
                f"video frame {index} is not a JPEG or PNG image",
                param=param,
            )
        images.append(image)
    return tuple(images)


def _too_large(index: int, spec: ImageInput, param: str) -> DuplexSessionError:
    return DuplexSessionError(
        INVALID_VIDEO_FRAMES,
        f"video frame {index} is larger than this model's {spec.max_bytes} bytes an image",
        param=param,
    )
