"""MiniCPM-o 4.5's camera path in duplex mode: a client's frame bytes -> 64 LLM embeddings.

A unit may carry camera frames; each is fed to the LLM as `<image>`, 64 resampler
embeddings, `</image>`. This module turns the frame's bytes into those 64 embeddings, as the
reference's `MiniCPMODuplex.streaming_prefill` does with its default `max_slice_nums=1`
(`modeling_minicpmo.py:2751-2782`), in four steps:

1. **decode** (`decode_frame`): untrusted bytes -> an RGB `PIL.Image`, within `FrameBounds`
   (bytes, pixels read from the header before anything is decoded, sides, aspect ratio,
   formats, pixel modes). Anything else is refused with `ImageRejected`, a coded error
   (`invalid_video_frames`), never an exception of PIL's. Like the reference's worker
   (`Image.open` then `.convert("RGB")`), EXIF orientation is not applied.
2. **prepare** (`prepare_frame`): never sliced in duplex mode, the frame is resized to about
   448² (`best_resize`: sides multiples of 14, upscaling allowed), PIL BICUBIC, then
   `float32 / 255`, `(x - mean) / std` (0.5, 0.5) in numpy float32 as the reference's
   processor does (bit for bit on the same Pillow), and laid out patch after patch as
   [3, 14, 14 * patches] (the reference's `reshape_by_patch`). Its patch grid (rows, cols)
   is the reference's `tgt_sizes` row.
3. **encode** (`NavitSiglipEncoder`): SigLIP with NaViT position ids: the 70x70 position
   table is sampled by bucketizing each frame's fractional patch coordinates, so any
   grid maps onto it; frames of different sizes share a batch, padded and masked.
4. **resample** (`Resampler`): 64 learned queries cross-attend to the patches (plus a 2-D
   sin-cos position of each patch) -> [64, D] for the LLM (hidden size D).

`VisionEncoder.embed_frames` runs 3-4 for a batch of frames (several sessions' frames in
one unit), equal to embedding each alone. Its state dict holds exactly the checkpoint's
`vpm.*` and `resampler.*` tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn
from transformers import SiglipVisionConfig
from transformers.activations import ACT2FN
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

from shared.errors import CodedError
from shared.protocol.duplex.errors import INVALID_VIDEO_FRAMES

#: the contract code of every refused camera frame
#: the only patch size the published weights and the processor use
PATCH_SIZE = 14
#: the resampler's attention has one head per 128 channels of the LLM's hidden size
RESAMPLER_HEAD_DIM = 128
#: the reference's Resampler builds its sin-cos table for 70x70 patches and grows it on demand
_SINCOS_INITIAL_POSITIONS = 70


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The sizes of the vision path, read from the checkpoint's config.json (`from_json`)."""

    #: SigLIP's width, MLP width, heads
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    #: config.json's layer count; the model runs (and the checkpoint holds) one fewer when
    #: `drop_last_layer` (the reference's `drop_vision_last_layer`, modeling_minicpmo.py:205)
    num_hidden_layers: int
    #: the NaViT position table covers image_size / patch_size patches a side (980/14 = 70)
    image_size: int
    patch_size: int
    #: the LLM's hidden size D: the resampler's output width
    llm_hidden_size: int
    drop_last_layer: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    #: embeddings per frame
    query_num: int = 64
    #: a frame is resized to about scale_resolution² pixels
    scale_resolution: int = 448
    norm_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    norm_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    #: frames per encoder forward (the reference's `vision_batch_size`)
    vision_batch_size: int = 16

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "image_size",
            "patch_size",
            "llm_hidden_size",
            "query_num",
            "scale_resolution",
            "vision_batch_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"vision config: {name} must be a positive integer, got {value!r}")
        if self.patch_size != PATCH_SIZE:
            raise ValueError(
                f"vision config: patch_size must be {PATCH_SIZE} (the NaViT SigLIP weights and the "
                f"image processor's patch layout), got {self.patch_size}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision config: image_size {self.image_size} is not a multiple of the patch "
                f"size {self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision config: hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.encoder_layers < 1:
            raise ValueError(
                "vision config: num_hidden_layers must be at least 2 when the last layer is "
                f"dropped, got {self.num_hidden_layers}"
            )
        if self.llm_hidden_size % RESAMPLER_HEAD_DIM:
            raise ValueError(
                f"the LLM's hidden_size {self.llm_hidden_size} must be a multiple of "
                f"{RESAMPLER_HEAD_DIM}: the resampler has hidden_size // {RESAMPLER_HEAD_DIM} "
                "attention heads"
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"vision config: unknown hidden_act {self.hidden_act!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(
                f"vision config: layer_norm_eps must be > 0, got {self.layer_norm_eps}"
            )
        if self.scale_resolution < self.patch_size:
            raise ValueError(
                f"vision config: scale_resolution {self.scale_resolution} is smaller than a patch"
            )
        for name in ("norm_mean", "norm_std"):
            value = getattr(self, name)
            if len(value) != 3:
                raise ValueError(f"vision config: {name} needs one value per RGB channel")
        if any(s == 0 for s in self.norm_std):
            raise ValueError("vision config: norm_std must not be 0")

    @property
    def encoder_layers(self) -> int:
        """The SigLIP layers the model runs and the checkpoint holds."""
        return self.num_hidden_layers - int(self.drop_last_layer)

    @property
    def patches_per_side(self) -> int:
        """The side of the NaViT position table (70 for image_size 980)."""
        return self.image_size // self.patch_size

    @property
    def resampler_heads(self) -> int:
        return self.llm_hidden_size // RESAMPLER_HEAD_DIM

    @classmethod
    def from_json(
        cls,
        config_json: Mapping[str, Any],
        preprocessor_json: Mapping[str, Any] | None = None,
    ) -> VisionConfig:
        """Read config.json (`vision_config`, `query_num`, `slice_config`, the LLM's
        `hidden_size`, `drop_vision_last_layer`, `vision_batch_size`).

        The reference's image processor is built from preprocessor_config.json; when given,
        its `scale_resolution`, `patch_size`, `norm_mean` and `norm_std` are the ones used
        (config.json's `slice_config` otherwise, and 0.5/0.5).
        """
        vision = config_json.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ValueError("config.json has no vision_config object")
        required = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "image_size",
            "patch_size",
        )
        missing = [key for key in required if key not in vision]
        if missing:
            raise ValueError(f"config.json vision_config lacks {', '.join(missing)}")
        if "hidden_size" not in config_json:
            raise ValueError("config.json lacks the LLM's hidden_size")
        if vision.get("num_channels", 3) != 3:
            raise ValueError(
                f"config.json vision_config.num_channels must be 3 (RGB), got "
                f"{vision['num_channels']!r}"
            )
        slice_config = config_json.get("slice_config") or {}
        if not isinstance(slice_config, Mapping):
            raise ValueError("config.json slice_config must be an object")
        processor = preprocessor_json if preprocessor_json is not None else slice_config
        processor_patch = processor.get("patch_size", vision["patch_size"])
        if processor_patch != vision["patch_size"]:
            raise ValueError(
                f"the image processor's patch_size {processor_patch} differs from the vision "
                f"encoder's {vision['patch_size']}"
            )
        drop = config_json.get("drop_vision_last_layer", True)
        if not isinstance(drop, bool):
            raise ValueError(f"config.json drop_vision_last_layer must be a boolean, got {drop!r}")
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_attention_heads=vision["num_attention_heads"],
            num_hidden_layers=vision["num_hidden_layers"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            llm_hidden_size=config_json["hidden_size"],
            drop_last_layer=drop,
            hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            query_num=config_json.get("query_num", 64),
            scale_resolution=processor.get("scale_resolution", 448),
            norm_mean=_three_floats(processor.get("norm_mean", (0.5, 0.5, 0.5)), "norm_mean"),
            norm_std=_three_floats(processor.get("norm_std", (0.5, 0.5, 0.5)), "norm_std"),
            vision_batch_size=config_json.get("vision_batch_size", 16),
        )


def _three_floats(value: Any, name: str) -> tuple[float, float, float]:
    if not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"{name} must be a list of three numbers, got {value!r}")
    a, b, c = (float(v) for v in value)
    return a, b, c


# ---------------------------------------------------------------- decoding a client's frame


class ImageRejected(CodedError):
    """A camera frame we refuse: its code (`invalid_video_frames`) and why, for the client."""


@dataclasses.dataclass(frozen=True)
class FrameBounds:
    """What a client's camera frame may be. Every frame ends up at about 448² pixels, so
    these bound the work and memory of one frame, not what the model can see."""

    #: encoded size: a 1080p webcam JPEG is 0.1-0.5 MB, a 4K one 1-3 MB
    max_bytes: int = 4 * 1024 * 1024
    #: width x height as the header states it, checked before decoding (a PNG of a few KB
    #: can claim gigapixels); 2^23 admits 4K UHD (3840x2160) at 24 MB of RGB
    max_pixels: int = 1 << 23
    #: a frame smaller than one patch on a side says nothing to the model (the reference
    #: processor also fails on frames 1 or 3 pixels tall: it takes them for channels-first)
    min_side: int = PATCH_SIZE
    #: longest over shortest side. The resized frame has ~32*sqrt(ratio) patches along its
    #: long side once its short side rounds down to one patch: 20 keeps a frame at <= 1088
    #: patches (a 4:3 frame has 1036); without it a 14x599186 PNG, under the pixel cap,
    #: would be 6114 patches, and the encoder's attention grows with their square
    max_aspect_ratio: float = 20.0
    #: what PIL may parse the bytes as (a JPEG with an MPO index counts as JPEG)
    formats: tuple[str, ...] = ("JPEG", "PNG")

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1 or self.min_side < 1:
            raise ValueError("frame bounds must be positive")
        if self.max_aspect_ratio < 1:
            raise ValueError("max_aspect_ratio must be at least 1")
        if not self.formats or not set(self.formats) <= {"JPEG", "PNG"}:
            raise ValueError(f"formats must be among JPEG and PNG, got {self.formats!r}")


DEFAULT_FRAME_BOUNDS = FrameBounds()

#: pixel modes JPEG and PNG decode to whose RGB conversion is what the client meant; 16-bit
#: and float modes ("I;16", "I", "F") would be clipped to 8 bits by `convert("RGB")`
_CONVERTIBLE_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "CMYK"})


def _rejected(message: str) -> ImageRejected:
    return ImageRejected(INVALID_VIDEO_FRAMES, message)


def decode_frame(data: bytes, bounds: FrameBounds = DEFAULT_FRAME_BOUNDS) -> Image.Image:
    """A client's frame bytes -> its RGB image (decoded, detached from `data`).

    Raises `ImageRejected` for anything outside `bounds` or not a whole JPEG/PNG image.
    """
    size = len(data)
    if size == 0:
        raise _rejected("the video frame is empty")
    if size > bounds.max_bytes:
        raise _rejected(f"the video frame is {size} bytes, more than {bounds.max_bytes}")
    try:
        # lazy: reads the header only; the pixel data is decoded by convert() below
        image = Image.open(io.BytesIO(data), formats=list(bounds.formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # PIL's own limit (far above ours) fires while opening; its warning is an
        # exception where warnings are errors
        raise _rejected("the video frame's header claims far too many pixels") from None
    except Exception:
        # PIL's plugins raise many types on hostile bytes (OSError, SyntaxError, ValueError,
        # struct.error...): all of them mean the bytes are not an image of an allowed format
        # (PIL's message names the BytesIO object: not for a client)
        raise _rejected(f"the video frame is not a {' or '.join(bounds.formats)} image") from None
    with image:
        _check_header(image, bounds)
        try:
            return image.convert("RGB")
        except Exception as exc:
            raise _rejected(
                f"the video frame's {image.format} data is truncated or corrupt ({exc})"
            ) from None


def _check_header(image: Image.Image, bounds: FrameBounds) -> None:
    fmt = "JPEG" if image.format == "MPO" else image.format
    if fmt not in bounds.formats:
        raise _rejected(f"video frames must be {' or '.join(bounds.formats)}, not {fmt}")
    width, height = image.size
    if width < 1 or height < 1:
        raise _rejected(f"the video frame has no pixels ({width}x{height})")
    if width * height > bounds.max_pixels:
        raise _rejected(
            f"the video frame is {width}x{height} = {width * height} pixels, "
            f"more than {bounds.max_pixels}"
        )
    if min(width, height) < bounds.min_side:
        raise _rejected(
            f"the video frame is {width}x{height}: a side is under {bounds.min_side} pixels"
        )
    if max(width, height) > bounds.max_aspect_ratio * min(width, height):
        raise _rejected(
            f"the video frame is {width}x{height}: its sides' ratio is over "
            f"{bounds.max_aspect_ratio:g}"
        )
    if image.mode not in _CONVERTIBLE_MODES:
        raise _rejected(
            f"the video frame's pixel mode {image.mode} is not supported (8-bit gray, "
            "palette, RGB, RGBA or CMYK)"
        )


# ---------------------------------------------------------------- preprocessing


def best_resize(
    width: int, height: int, scale_resolution: int = 448, patch_size: int = PATCH_SIZE
) -> tuple[int, int]:
    """(width, height) a frame is resized to in duplex mode: about scale_resolution² pixels
    at the frame's aspect ratio, each side rounded to a whole number of patches (at least
    one). The reference's `find_best_resize(..., allow_upscale=True)`, same float steps
    (truncations, then Python's round: half to even), so the same sizes: 640x480 -> 518x392.
    """
    ratio = width / height
    scaled_height = int(scale_resolution / math.sqrt(ratio))
    scaled_width = int(scaled_height * ratio)
    return _whole_patches(scaled_width, patch_size), _whole_patches(scaled_height, patch_size)


def _whole_patches(length: int, patch_size: int) -> int:
    return max(round(length / patch_size) * patch_size, patch_size)


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedFrame:
    """A frame ready for the encoder: its normalised pixels, patch after patch (row-major
    over the patch grid), as [3, patch, patch * patches] float32."""

    pixels: Tensor
    #: (rows, cols) of patches: the reference's `tgt_sizes` row
    grid: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


def prepare_frame(image: Image.Image, config: VisionConfig) -> PreparedFrame:
    """An RGB image (`decode_frame`) -> its resized, normalised, patch-laid pixels."""
    if image.mode != "RGB":
        raise ValueError(f"prepare_frame takes an RGB image, got mode {image.mode}")
    patch = config.patch_size
    width, height = best_resize(*image.size, config.scale_resolution, patch)
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    # numpy float32 throughout, as the reference's processor: x / 255, then (x - mean) / std
    # with mean and std as float32 (transformers' normalize), so the same bits
    pixels = np.asarray(resized, dtype=np.float32) / 255
    pixels = (pixels - np.asarray(config.norm_mean, dtype=np.float32)) / np.asarray(
        config.norm_std, dtype=np.float32
    )
    rows, cols = height // patch, width // patch
    # [H, W, C] -> [C, patch row i, (grid row, grid col, patch col j)]: patch after patch
    laid = pixels.reshape(rows, patch, cols, patch, 3).transpose(4, 1, 0, 2, 3)
    laid = np.ascontiguousarray(laid.reshape(3, patch, rows * cols * patch))
    return PreparedFrame(pixels=torch.from_numpy(laid), grid=(rows, cols))


def load_frame(
    data: bytes, config: VisionConfig, bounds: FrameBounds = DEFAULT_FRAME_BOUNDS
) -> PreparedFrame:
    """`decode_frame` then `prepare_frame`."""
    return prepare_frame(decode_frame(data, bounds), config)


# ---------------------------------------------------------------- NaViT SigLIP


@functools.lru_cache(maxsize=1024)
def _bucket_coords(patches: int, per_side: int) -> Tensor:
    """For each of `patches` along a side, the row/column of the per_side x per_side
    position table it reads. The reference's exact float steps (fractional coordinates
    from a float32 step, bucketized against float32 boundaries): where a coordinate falls
    on a boundary (e.g. 35 patches: k/35 vs 2k/70) float rounding decides the bucket, so
    an integer formula would differ."""
    step = 1 / torch.tensor(patches, dtype=torch.int32)
    fractional = torch.arange(0, 1 - 1e-6, step)
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    return torch.bucketize(fractional, boundaries, right=True)


def navit_position_ids(grid: tuple[int, int], per_side: int) -> Tensor:
    """Position ids (into the per_side² table) of a rows x cols patch grid, row-major."""
    rows, cols = grid
    return (
        _bucket_coords(rows, per_side)[:, None] * per_side + _bucket_coords(cols, per_side)
    ).flatten()


class _NavitEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            3, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)


class NavitSiglipEncoder(nn.Module):
    """SigLIP with NaViT positions over frames of any grid. Its state dict is the
    checkpoint's `vpm.*` without the prefix: `embeddings.{patch_embedding,
    position_embedding}`, `encoder.layers.N.*` (transformers' SigLIP layer names),
    `post_layernorm`."""

    def __init__(self, config: VisionConfig, *, attn_implementation: str = "eager") -> None:
        super().__init__()
        self.config = config
        layer_config = SiglipVisionConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            hidden_act=config.hidden_act,
            layer_norm_eps=config.layer_norm_eps,
            attention_dropout=0.0,
        )
        # eager: the reference's own attention (scores + mask, softmax in float32), bit for
        # bit on CPU; "sdpa" is faster on a GPU, equal to rounding
        layer_config._attn_implementation = attn_implementation
        self.embeddings = _NavitEmbeddings(config)
        self.encoder = nn.ModuleDict(
            {
                "layers": nn.ModuleList(
                    SiglipEncoderLayer(layer_config) for _ in range(config.encoder_layers)
                )
            }
        )
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: Tensor, grids: Sequence[tuple[int, int]]) -> Tensor:
        """pixels [B, 3, patch, patch * L] (frame i's first rows*cols patches valid, the
        rest zeros) -> [B, L, hidden]; rows past a frame's patches are padding."""
        batch = pixels.shape[0]
        length = pixels.shape[-1] // self.config.patch_size
        hidden = self.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        counts = [rows * cols for rows, cols in grids]
        position_ids = torch.zeros(batch, length, dtype=torch.long)
        for index, grid in enumerate(grids):
            position_ids[index, : counts[index]] = navit_position_ids(
                grid, self.config.patches_per_side
            )
        hidden = hidden + self.embeddings.position_embedding(position_ids.to(hidden.device))
        mask = None
        if min(counts) < length:
            # padded patches are masked as keys (queries of padding compute garbage no one
            # reads); the additive mask of transformers: 0 or the dtype's minimum
            valid = (
                torch.arange(length, device=hidden.device)[None, :]
                < torch.tensor(counts, device=hidden.device)[:, None]
            )
            mask = torch.zeros(batch, 1, 1, length, dtype=hidden.dtype, device=hidden.device)
            mask = mask.masked_fill(~valid[:, None, None, :], torch.finfo(hidden.dtype).min)
            mask = mask.expand(batch, 1, length, length)
        for layer in self.encoder["layers"]:
            hidden = layer(hidden, mask)
        return self.post_layernorm(hidden)


# ---------------------------------------------------------------- resampler


def _sincos_table(positions: int, dim: int) -> np.ndarray:
    """[positions, dim]: sin(p * w_k) then cos(p * w_k), w_k = 10000^-(k / (dim/2)), in
    float32 numpy as the reference computes it (so the same bits)."""
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / np.float32(10000) ** omega
    angles = np.arange(positions, dtype=np.float32)[:, None] * omega[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


class Resampler(nn.Module):
    """64 learned queries attend once over a frame's patch features -> [64, D]. Its state
    dict is the checkpoint's `resampler.*`: query, kv_proj (absent when the vision and LLM
    widths agree), attn (nn.MultiheadAttention), ln_q, ln_kv, ln_post, proj."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        width = config.llm_hidden_size
        self.query = nn.Parameter(torch.zeros(config.query_num, width))
        self.kv_proj: nn.Module = (
            nn.Linear(config.hidden_size, width, bias=False)
            if config.hidden_size != width
            else nn.Identity()
        )
        self.attn = nn.MultiheadAttention(width, config.resampler_heads)
        self.ln_q = nn.LayerNorm(width, eps=1e-6)
        self.ln_kv = nn.LayerNorm(width, eps=1e-6)
        self.ln_post = nn.LayerNorm(width, eps=1e-6)
        self.proj = nn.Parameter(torch.empty(width, width))
        # one axis's sin-cos codes (positions x D/2); a patch at (row, col) gets
        # [codes(col), codes(row)] (the reference's grid puts the column first). Not in the
        # checkpoint; grows for grids past 70 patches as the reference's table does
        self.register_buffer("axis_codes", self._initial_codes(), persistent=False)

    def _initial_codes(self) -> Tensor:
        return torch.from_numpy(_sincos_table(_SINCOS_INITIAL_POSITIONS, self.query.shape[1] // 2))

    def rebuild_position_codes(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute the sin-cos table again, on `device`: for a resampler built on the meta
        device (its weights loaded later), where the table, not being a weight, was never
        computed."""
        self.axis_codes = self._initial_codes().to(device=device, dtype=dtype)

    def _positions(self, grid: tuple[int, int]) -> Tensor:
        rows, cols = grid
        if max(rows, cols) > self.axis_codes.shape[0]:
            grown = _sincos_table(max(rows, cols), self.query.shape[1] // 2)
            self.axis_codes = torch.from_numpy(grown).to(self.axis_codes)
        codes = self.axis_codes
        half = codes.shape[1]
        by_col = codes[:cols][None, :, :].expand(rows, cols, half)
        by_row = codes[:rows][:, None, :].expand(rows, cols, half)
        return torch.cat([by_col, by_row], dim=-1).reshape(rows * cols, 2 * half)

    def forward(self, features: Tensor, grids: Sequence[tuple[int, int]]) -> Tensor:
        """features [B, L, vision hidden] (frame i's first rows*cols valid) -> [B, Q, D]."""
        batch, length, _ = features.shape
        dtype, device = features.dtype, features.device
        counts = torch.tensor([rows * cols for rows, cols in grids], device=device)
        padding = torch.arange(length, device=device)[None, :] >= counts[:, None]
        positions = torch.zeros(length, batch, self.query.shape[1], dtype=dtype, device=device)
        for index, grid in enumerate(grids):
            positions[: grid[0] * grid[1], index] = self._positions(grid).to(dtype)
        keys = self.ln_kv(self.kv_proj(features)).permute(1, 0, 2)  # [L, B, D]
        queries = self.ln_q(self.query)[:, None, :].repeat(1, batch, 1)  # [Q, B, D]
        # need_weights=True (the module's default, as the reference calls it) keeps torch on
        # its explicit attention path: the reference's numbers, not SDPA's
        out = self.attn(
            queries, keys + positions, keys, key_padding_mask=padding, need_weights=True
        )[0]
        return self.ln_post(out.permute(1, 0, 2)) @ self.proj


# ---------------------------------------------------------------- the two together


class VisionEncoder(nn.Module):
    """`vpm` (NaViT SigLIP) and `resampler`: state dict keys as in the checkpoint."""

    def __init__(
        self,
        config: VisionConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attn_implementation: str = "eager",
    ) -> None:
        super().__init__()
        self.config = config
        self.vpm = NavitSiglipEncoder(config, attn_implementation=attn_implementation)
        self.resampler = Resampler(config)
        self.to(device=device, dtype=dtype)
        self.eval()

    @torch.inference_mode()
    def embed_frames(self, frames: Sequence[PreparedFrame]) -> list[Tensor]:
        """Each frame's [query_num, D] embeddings, in the model's dtype and device.

        Frames of any grids share forwards of at most `vision_batch_size` frames, sorted by
        size so a forward pads little; each result equals the frame embedded alone up to
        float rounding."""
        by_index: dict[int, Tensor] = {}
        order = sorted(range(len(frames)), key=lambda index: frames[index].num_patches)
        step = self.config.vision_batch_size
        for start in range(0, len(order), step):
            chunk = order[start : start + step]
            grids = [frames[index].grid for index in chunk]
            embeddings = self.resampler(self.vpm(self._batch(frames, chunk), grids), grids)
            by_index.update(zip(chunk, embeddings, strict=True))
        return [by_index[index] for index in range(len(frames))]

    def _batch(self, frames: Sequence[PreparedFrame], chunk: list[int]) -> Tensor:
        reference = self.resampler.proj
        patch = self.config.patch_size
        longest = max(frames[index].num_patches for index in chunk) * patch
        pixels = torch.zeros(
            len(chunk), 3, patch, longest, dtype=reference.dtype, device=reference.device
        )
        for row, index in enumerate(chunk):
            frame = frames[index].pixels
            pixels[row, :, :, : frame.shape[-1]] = frame.to(reference.device, reference.dtype)
        return pixels
