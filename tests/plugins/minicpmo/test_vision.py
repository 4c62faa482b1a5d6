"""MiniCPM-o's camera path (plugins/minicpmo/vision.py): frame bytes refused or decoded,
resized and laid out as the reference's duplex processor does, and the NaViT SigLIP +
resampler loading the checkpoint's names and embedding frames alike alone or batched.

The expected sizes and position buckets are the reference's (MiniCPM-o 4.5's
`processing_minicpmo.py` / `modeling_navit_siglip.py`, run under transformers 4.51.3)."""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from plugins.minicpmo.vision import (
    INVALID_VIDEO_FRAMES,
    FrameBounds,
    ImageRejected,
    PreparedFrame,
    Resampler,
    VisionConfig,
    VisionEncoder,
    best_resize,
    decode_frame,
    load_frame,
    navit_position_ids,
    prepare_frame,
)

#: a tiny config of the real architecture: SigLIP 64 wide, 3 layers (2 once the last is
#: dropped), 4 heads; LLM hidden 128 (one resampler head)
TINY_JSON = {
    "hidden_size": 128,
    "query_num": 64,
    "vision_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "image_size": 980,
        "patch_size": 14,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    },
}


def tiny_config(**changes) -> VisionConfig:
    config = VisionConfig.from_json(TINY_JSON)
    return VisionConfig(**{**config.__dict__, **changes})


def image_bytes(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png_with_header(width: int, height: int, idat: bytes, bit_depth: int = 8) -> bytes:
    """A PNG whose IHDR says width x height (RGB), with the given IDAT payload."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, bit_depth, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


# ---------------------------------------------------------------- configuration


def test_config_reads_the_published_layout():
    config = VisionConfig.from_json(
        {
            "hidden_size": 4096,
            "vision_config": {
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_attention_heads": 16,
                "num_hidden_layers": 27,
                "image_size": 980,
                "patch_size": 14,
            },
            "slice_config": {"patch_size": 14, "max_slice_nums": 9, "scale_resolution": 448},
        }
    )
    assert (config.encoder_layers, config.resampler_heads, config.patches_per_side) == (26, 32, 70)
    assert (config.query_num, config.scale_resolution, config.vision_batch_size) == (64, 448, 16)
    assert config.norm_mean == config.norm_std == (0.5, 0.5, 0.5)
    kept = VisionConfig.from_json({**TINY_JSON, "drop_vision_last_layer": False})
    assert kept.encoder_layers == 3


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"hidden_size": 100}, "multiple of 128"),
        ({"vision_config": {**TINY_JSON["vision_config"], "patch_size": 16}}, "patch_size"),
        ({"vision_config": {**TINY_JSON["vision_config"], "num_hidden_layers": 1}}, "at least 2"),
        ({"vision_config": {**TINY_JSON["vision_config"], "num_attention_heads": 5}}, "heads"),
        ({"vision_config": {**TINY_JSON["vision_config"], "image_size": 1000}}, "image_size"),
        ({"vision_config": {**TINY_JSON["vision_config"], "hidden_act": "nope"}}, "hidden_act"),
        ({"vision_config": {**TINY_JSON["vision_config"], "num_channels": 4}}, "num_channels"),
        ({"vision_config": {"hidden_size": 64}}, "lacks"),
        ({"vision_config": None}, "no vision_config"),
        ({"slice_config": {"patch_size": 16}}, "processor's patch_size"),
        ({"query_num": 0}, "query_num"),
    ],
)
def test_config_says_what_the_architecture_requires(change, words):
    with pytest.raises(ValueError, match=words):
        VisionConfig.from_json({**TINY_JSON, **change})


def test_preprocessor_config_sets_the_processor_values():
    config = VisionConfig.from_json(
        TINY_JSON,
        {"scale_resolution": 224, "patch_size": 14, "norm_mean": [0.25] * 3, "norm_std": [2, 2, 2]},
    )
    assert (config.scale_resolution, config.norm_mean, config.norm_std) == (
        224,
        (0.25, 0.25, 0.25),
        (2.0, 2.0, 2.0),
    )


# ---------------------------------------------------------------- decoding


def test_jpeg_and_png_frames_decode_to_rgb():
    frames = {
        "jpeg": image_bytes(noise_image(64, 48), "JPEG", quality=90),
        "gray jpeg": image_bytes(noise_image(64, 48).convert("L"), "JPEG"),
        "cmyk jpeg": image_bytes(noise_image(64, 48).convert("CMYK"), "JPEG"),
        "rgba png": image_bytes(noise_image(64, 48).convert("RGBA"), "PNG"),
        "palette png": image_bytes(noise_image(64, 48).convert("P"), "PNG"),
    }
    for name, data in frames.items():
        image = decode_frame(data)
        assert (image.mode, image.size) == ("RGB", (64, 48)), name
    lossless = noise_image(30, 20, seed=3)
    assert np.array_equal(np.asarray(decode_frame(image_bytes(lossless, "PNG"))), lossless)


def rejected(data: bytes, bounds: FrameBounds | None = None) -> ImageRejected:
    with pytest.raises(ImageRejected) as caught:
        decode_frame(data, bounds or FrameBounds())
    assert caught.value.code == INVALID_VIDEO_FRAMES
    return caught.value


def test_bad_bytes_are_refused_with_a_code_and_a_reason():
    jpeg = image_bytes(noise_image(64, 48), "JPEG")
    assert "truncated or corrupt" in rejected(jpeg[: len(jpeg) // 2]).message
    assert "not a JPEG or PNG image" in rejected(b"hello, this is not an image").message
    assert "empty" in rejected(b"").message
    assert "not a JPEG or PNG image" in rejected(image_bytes(noise_image(20, 20), "GIF")).message
    corrupt_png = png_with_header(20, 20, idat=b"not zlib data")
    assert "truncated or corrupt" in rejected(corrupt_png).message


def test_a_zero_pixel_image_is_refused():
    error = rejected(png_with_header(0, 10, idat=zlib.compress(b"")))
    assert "not a JPEG or PNG image" in error.message


def test_a_png_bomb_is_refused_from_its_header_before_decoding(monkeypatch):
    # 6000 x 6000 RGB of zeros: 108 MB decoded from ~100 KB
    width = height = 6000
    rows = b"".join([b"\0" * (1 + 3 * width)] * 64)
    idat = zlib.compress(rows * (height // 64), 9)
    bomb = png_with_header(width, height, idat)
    assert len(bomb) < 200_000

    def no_decoding(self):
        raise AssertionError("the pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    error = rejected(bomb)
    assert "6000x6000 = 36000000 pixels" in error.message
    # a header past PIL's own limit is refused while opening
    assert "too many pixels" in rejected(png_with_header(100_000, 100_000, idat=b"")).message


def test_frame_bounds_are_enforced():
    jpeg = image_bytes(noise_image(64, 48), "JPEG")
    assert "bytes, more than 100" in rejected(jpeg, FrameBounds(max_bytes=100)).message
    assert "more than 3000" in rejected(jpeg, FrameBounds(max_pixels=3000)).message
    assert "under 14 pixels" in rejected(image_bytes(noise_image(97, 3), "JPEG")).message
    assert "ratio is over 20" in rejected(image_bytes(noise_image(630, 30), "JPEG")).message
    png = image_bytes(noise_image(20, 20), "PNG")
    assert "not a JPEG image" in rejected(png, FrameBounds(formats=("JPEG",))).message
    sixteen_bit = Image.fromarray(np.full((20, 20), 40000, dtype=np.uint16))
    assert "pixel mode I;16" in rejected(image_bytes(sixteen_bit, "PNG")).message
    assert decode_frame(image_bytes(noise_image(600, 30), "JPEG")).size == (600, 30)


# ---------------------------------------------------------------- preprocessing


@pytest.mark.parametrize(
    ("size", "resized"),
    [
        ((640, 480), (518, 392)),
        ((320, 240), (518, 392)),
        ((4000, 3000), (518, 392)),
        ((97, 61), (560, 350)),
        ((360, 640), (336, 602)),
        ((1920, 1080), (602, 336)),
        ((1400, 100), (1666, 112)),
        ((448, 448), (448, 448)),
        ((14, 14), (448, 448)),
        # the unrounded sides land on half a patch: Python's round, half to even
        ((300, 308), (448, 448)),  # 441 = 31.5 patches -> 32
        ((300, 329), (420, 476)),  # 427 = 30.5 patches -> 30
    ],
)
def test_best_resize_matches_the_reference(size, resized):
    assert best_resize(*size) == resized


def test_frames_are_normalised_and_laid_out_patch_after_patch():
    config = tiny_config()
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
    source[0, 0] = (0, 255, 51)
    frame = prepare_frame(Image.fromarray(source, "RGB"), config)  # 448² is not resized
    assert frame.grid == (32, 32) and frame.num_patches == 1024
    assert frame.pixels.dtype == torch.float32
    assert tuple(frame.pixels.shape) == (3, 14, 14 * 1024)
    pixels = frame.pixels.numpy()
    assert pixels[:, 0, 0].tolist() == [-1.0, 1.0, pytest.approx(-0.6, abs=1e-6)]
    expected = (source.astype(np.float32) / 255 - np.float32(0.5)) / np.float32(0.5)
    for row, col, i, j in [(0, 0, 0, 0), (0, 1, 3, 5), (5, 7, 13, 13), (31, 31, 6, 2)]:
        patch = row * 32 + col
        assert np.array_equal(pixels[:, i, patch * 14 + j], expected[row * 14 + i, col * 14 + j])
    # the whole layout at once: back from [3, 14, (patch, 14)] to [448, 448, 3]
    back = pixels.reshape(3, 14, 32, 32, 14).transpose(2, 1, 3, 4, 0).reshape(448, 448, 3)
    assert np.array_equal(back, expected)


def test_a_frame_is_resized_bicubic_to_its_grid():
    config = tiny_config()
    image = noise_image(640, 480, seed=5)
    frame = load_frame(image_bytes(image, "PNG"), config)
    assert frame.grid == (28, 37)
    resized = np.asarray(image.resize((518, 392), Image.Resampling.BICUBIC), dtype=np.float32)
    first_patch = frame.pixels[:, :, :14].permute(1, 2, 0).numpy()
    assert np.array_equal(first_patch, (resized[:14, :14] / 255 - 0.5) / 0.5)


# ---------------------------------------------------------------- weights


def checkpoint_tensors(config: VisionConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's vision tensors, named and shaped as published (random values)."""
    generator = torch.Generator().manual_seed(0)
    hidden, inner, width = config.hidden_size, config.intermediate_size, config.llm_hidden_size
    shapes = {
        "vpm.embeddings.patch_embedding.weight": (hidden, 3, 14, 14),
        "vpm.embeddings.patch_embedding.bias": (hidden,),
        "vpm.embeddings.position_embedding.weight": (70 * 70, hidden),
        "vpm.post_layernorm.weight": (hidden,),
        "vpm.post_layernorm.bias": (hidden,),
        "resampler.query": (config.query_num, width),
        "resampler.attn.in_proj_weight": (3 * width, width),
        "resampler.attn.in_proj_bias": (3 * width,),
        "resampler.attn.out_proj.weight": (width, width),
        "resampler.attn.out_proj.bias": (width,),
        "resampler.proj": (width, width),
    }
    if hidden != width:
        shapes["resampler.kv_proj.weight"] = (width, hidden)
    for norm in ("ln_q", "ln_kv", "ln_post"):
        shapes[f"resampler.{norm}.weight"] = shapes[f"resampler.{norm}.bias"] = (width,)
    for layer in range(config.encoder_layers):
        prefix = f"vpm.encoder.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{prefix}self_attn.{proj}.weight"] = (hidden, hidden)
            shapes[f"{prefix}self_attn.{proj}.bias"] = (hidden,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{prefix}{norm}.weight"] = shapes[f"{prefix}{norm}.bias"] = (hidden,)
        shapes[f"{prefix}mlp.fc1.weight"] = (inner, hidden)
        shapes[f"{prefix}mlp.fc1.bias"] = (inner,)
        shapes[f"{prefix}mlp.fc2.weight"] = (hidden, inner)
        shapes[f"{prefix}mlp.fc2.bias"] = (hidden,)
    tensors = {}
    for name, shape in shapes.items():
        fan_in = shape[-1] if len(shape) > 1 else 1
        if name.endswith("bias"):
            scale = 0.02
        elif "norm" in name or ".ln_" in name:
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=generator)
            continue
        else:
            scale = fan_in**-0.5 if len(shape) > 1 else 0.5
        tensors[name] = scale * torch.randn(shape, generator=generator)
    return tensors


def loaded_encoder(config: VisionConfig) -> VisionEncoder:
    encoder = VisionEncoder(config, dtype=torch.float32)
    encoder.load_state_dict(checkpoint_tensors(config), strict=True)
    return encoder


def test_the_state_dict_is_the_checkpoints_vision_tensors():
    config = tiny_config()
    tensors = checkpoint_tensors(config)
    encoder = loaded_encoder(config)
    state = encoder.state_dict()
    assert sorted(state) == sorted(tensors)
    assert all(torch.equal(state[name], tensors[name]) for name in tensors)
    # the dropped layer (config.json says 3) is not a module of ours
    assert sum(".layers.2." in name for name in state) == 0
    extra = {**tensors, "vpm.encoder.layers.2.mlp.fc1.bias": torch.zeros(128)}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        encoder.load_state_dict(extra, strict=True)
    # kv_proj exists only where the vision and LLM widths differ (nn.Identity otherwise)
    same_width = tiny_config(hidden_size=128)
    VisionEncoder(same_width).load_state_dict(checkpoint_tensors(same_width), strict=True)
    assert "resampler.kv_proj.weight" not in VisionEncoder(same_width).state_dict()


# ---------------------------------------------------------------- positions


def test_navit_positions_follow_the_reference_buckets():
    assert torch.equal(navit_position_ids((70, 70), 70), torch.arange(4900))
    # 25 patches a side: float rounding puts patch 5 (exactly 14/70) in bucket 13, as the
    # reference does; an integer floor(5 * 70 / 25) would say 14
    expected = [0, 2, 5, 8, 11, 13, 16, 19, 22, 25, 27, 30, 33, 36, 39, 41, 44, 47, 50]
    assert navit_position_ids((1, 25), 70)[:19].tolist() == expected
    # two rows: the second starts halfway down the table (row 35 of 70)
    ids = navit_position_ids((2, 35), 70)
    assert ids[:3].tolist() == [0, 2, 4] and ids[35:38].tolist() == [2450, 2452, 2454]


def test_resampler_positions_put_the_column_code_first():
    config = tiny_config()
    resampler = Resampler(config)
    positions = resampler._positions((2, 3))
    quarter = config.llm_hidden_size // 4
    omega = 1.0 / 10000 ** (np.arange(quarter) / quarter)

    def codes(p):
        return np.concatenate([np.sin(p * omega), np.cos(p * omega)])

    patch = positions[1 * 3 + 2].numpy()  # row 1, column 2
    assert np.allclose(patch, np.concatenate([codes(2), codes(1)]), atol=1e-6)
    # past the initial 70x70 table
    wide = resampler._positions((1, 90))
    assert np.allclose(wide[89].numpy(), np.concatenate([codes(89), codes(0)]), atol=1e-4)


# ---------------------------------------------------------------- embedding


def test_embeddings_of_a_batch_equal_each_frame_alone():
    config = tiny_config(vision_batch_size=2)
    torch.manual_seed(0)
    encoder = loaded_encoder(config)
    sizes = [(640, 480), (97, 61), (360, 640), (448, 448), (1400, 100)]
    frames = [
        load_frame(image_bytes(noise_image(w, h, seed=i), "JPEG"), config)
        for i, (w, h) in enumerate(sizes)
    ]
    assert [f.grid for f in frames] == [(28, 37), (25, 40), (43, 24), (32, 32), (8, 119)]
    batched = encoder.embed_frames(frames)
    assert len(batched) == len(frames)
    for frame, embedding in zip(frames, batched, strict=True):
        assert tuple(embedding.shape) == (64, 128) and embedding.dtype == torch.float32
        alone = encoder.embed_frames([frame])[0]
        assert (embedding - alone).abs().max().item() < 1e-5
    # frames of one unit from different sessions do differ
    assert (batched[0] - batched[1]).abs().max().item() > 1e-2
    assert encoder.embed_frames([]) == []


def test_embedding_runs_in_the_models_dtype():
    config = tiny_config()
    encoder = loaded_encoder(config).to(torch.bfloat16)
    frame = PreparedFrame(pixels=torch.zeros(3, 14, 14 * 12), grid=(3, 4))
    (embedding,) = encoder.embed_frames([frame])
    assert embedding.dtype == torch.bfloat16 and tuple(embedding.shape) == (64, 128)
    assert torch.isfinite(embedding.float()).all()
