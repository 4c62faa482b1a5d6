"""MiniCPM-o 4.5's streaming audio path: one 1 s unit of 16 kHz audio in, 10 LLM embeddings out.

Three stages, each with its own per-session state:

1. **Log-mel** (`MelStream`, plain numpy): the unit's samples join a buffer of at most 30 s whose
   whole log-mel (Whisper's: n_fft 400, hop 160, 80 Slaney mels) is recomputed every unit, because
   the floor depends on the whole buffer: a fixed -10 (log10) while it holds less than 5 s, its
   maximum - 8 from then on. The first unit is 1035 ms long and a 1000 ms first input is
   left-padded with 560 zeros; the mel consumes hop-aligned amounts (16480 samples, then 16000),
   so the last 80 samples of every unit are carried into the next (a constant 5 ms lag). A unit
   emits its 100 frames plus 2 redundancy frames on each side (the first unit has none before):
   unit 0 frames [0, 102), unit k [100k - 2, 100k + 102). From 30 s on, the buffer drops its
   oldest 10 s (units 29, 39, 49, ...), so a unit's mel depends on at most 30 s of past audio.
2. **Whisper encoder** (`StreamingWhisperEncoder`, KV per session in `EncoderKV`): the two
   convolutions turn a unit's 104 (102) frames into 52 (51) positions; the one position on each
   side that came from redundancy frames is dropped, leaving 50 that take the position
   embeddings `[past, past + 50)` and attend, bidirectionally, to the cached positions of the
   earlier units and to each other. Before a unit, the KV is dropped when
   `cached + conv_positions >= max_source_positions` (1500): units 0..28 share one context,
   unit 29 starts a new one at position 0, and so every 29 units. The output is post-final
   LayerNorm.
3. **Projector and pooling** (`AudioProjector`): Linear(d_model -> D), ReLU, Linear(D -> D), then
   the mean of each 5 positions: 50 -> 10 embeddings (100 ms each).

`AudioTower` holds 2 and 3 under the checkpoint's names (`apm.*`, `audio_projection_layer.*`),
encodes the current unit of several sessions in one forward (`step`) and replays consecutive units
of one session in one forward (`replay`, a block mask: a unit sees the units before it in its
context). Everything after N units is a pure function of the N units' audio: a restored session
replays `MelStream.replay` and then `AudioTower.replay` from the start of its Whisper context
(`AudioConfig.context_start`).

Numbers follow OpenBMB's MiniCPM-o 4.5 duplex code (its `StreamingMelProcessorExact` and
`MiniCPMWhisperEncoder` with `cnn_redundancy_ms=20`); the code is ours.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

SAMPLE_RATE = 16_000
UNIT_SAMPLES = 16_000  # one unit = 1 s
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 80
MEL_FMAX = 8_000.0
#: the first unit spans 1035 ms: its 1000 ms of input follow 560 zeros
FIRST_UNIT_SAMPLES = 16_560
FIRST_UNIT_PADDING = FIRST_UNIT_SAMPLES - UNIT_SAMPLES
#: the mel takes whole hops: 16480 of the first unit's 16560 samples, 16000 of each later unit's
#: 16080 (carry + input), so 80 samples always wait for the next unit
FIRST_UNIT_CONSUMED = FIRST_UNIT_SAMPLES // HOP_LENGTH * HOP_LENGTH
CARRY_SAMPLES = FIRST_UNIT_SAMPLES - FIRST_UNIT_CONSUMED
UNIT_FRAMES = UNIT_SAMPLES // HOP_LENGTH
REDUNDANCY_FRAMES = 2  # 20 ms each side, so the convolutions see real neighbours at the edges
#: the floor switches from fixed to "max - 8" once the buffer holds 5 s
DYNAMIC_FLOOR_FROM_SAMPLES = 5 * SAMPLE_RATE
FIXED_LOG_FLOOR = -10.0
DYNAMIC_RANGE = 8.0
#: the buffer slides by 10 s when it reaches 30 s
MEL_WINDOW_SAMPLES = 30 * SAMPLE_RATE
MEL_SLIDE_SAMPLES = 10 * SAMPLE_RATE
POSITIONS_PER_UNIT = UNIT_FRAMES // 2  # conv2 has stride 2
#: conv positions of a unit with redundancy on both sides, the count the KV reset rule uses
CONV_POSITIONS = (UNIT_FRAMES + 2 * REDUNDANCY_FRAMES - 1) // 2 + 1
WHISPER_POSITIONS = 1500


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """The audio tower's sizes, from the checkpoint's `config.json` (`from_json`)."""

    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    llm_hidden_size: int
    num_mel_bins: int = N_MELS
    max_source_positions: int = WHISPER_POSITIONS
    pool_step: int = 5
    chunk_length: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "d_model",
            "encoder_layers",
            "encoder_attention_heads",
            "encoder_ffn_dim",
            "llm_hidden_size",
            "pool_step",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"audio config: {name} must be a positive integer, got {value!r}")
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(
                f"audio config: d_model {self.d_model} is not a multiple of "
                f"encoder_attention_heads {self.encoder_attention_heads}"
            )
        # the projector's input width is encoder_ffn_dim // 4 but it is fed d_model features
        if self.encoder_ffn_dim != 4 * self.d_model:
            raise ValueError(
                f"audio config: encoder_ffn_dim must be 4 * d_model = {4 * self.d_model} (the "
                f"audio projector takes encoder_ffn_dim // 4 features), got {self.encoder_ffn_dim}"
            )
        if self.num_mel_bins != N_MELS:
            raise ValueError(
                f"audio config: num_mel_bins must be {N_MELS} (the streaming log-mel's bank), "
                f"got {self.num_mel_bins}"
            )
        if self.max_source_positions != WHISPER_POSITIONS:
            raise ValueError(
                f"audio config: max_source_positions must be {WHISPER_POSITIONS} (Whisper's 30 s; "
                f"the streaming KV resets on it every 29 units), got {self.max_source_positions}"
            )
        if POSITIONS_PER_UNIT % self.pool_step:
            raise ValueError(
                f"audio_pool_step must divide the {POSITIONS_PER_UNIT} encoder positions of a "
                f"unit, got {self.pool_step}"
            )
        if self.chunk_length != 1.0:
            raise ValueError(
                f"audio_chunk_length must be 1.0 (1 s units), got {self.chunk_length!r}"
            )

    @classmethod
    def from_json(cls, config_json: Mapping[str, Any]) -> AudioConfig:
        """Reads `audio_config` (a Whisper config), `hidden_size` (the LLM's width, the
        projector's output), `audio_pool_step` and `audio_chunk_length` of `config.json`."""
        audio = config_json.get("audio_config")
        if not isinstance(audio, Mapping):
            raise ValueError("config.json has no audio_config object")
        required = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim")
        missing = [key for key in required if key not in audio]
        if missing:
            raise ValueError(f"config.json audio_config lacks {', '.join(missing)}")
        if "hidden_size" not in config_json:
            raise ValueError("config.json lacks hidden_size (the audio projector's output width)")
        # the encoder layer's activation comes from the config; the convolutions' is fixed GELU
        activation = audio.get("activation_function", "gelu")
        if activation != "gelu":
            raise ValueError(
                f"config.json audio_config.activation_function must be 'gelu', got {activation!r}"
            )
        return cls(
            d_model=audio["d_model"],
            encoder_layers=audio["encoder_layers"],
            encoder_attention_heads=audio["encoder_attention_heads"],
            encoder_ffn_dim=audio["encoder_ffn_dim"],
            llm_hidden_size=config_json["hidden_size"],
            num_mel_bins=audio.get("num_mel_bins", N_MELS),
            max_source_positions=audio.get("max_source_positions", WHISPER_POSITIONS),
            pool_step=config_json.get("audio_pool_step", 5),
            chunk_length=float(config_json.get("audio_chunk_length", 1.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def embeddings_per_unit(self) -> int:
        return POSITIONS_PER_UNIT // self.pool_step

    @property
    def units_per_context(self) -> int:
        """Units a Whisper context holds: the KV is dropped before the first unit that would
        bring `cached + CONV_POSITIONS` to `max_source_positions` (29 for 1500)."""
        return math.ceil((self.max_source_positions - CONV_POSITIONS) / POSITIONS_PER_UNIT)

    def context_start(self, unit: int) -> int:
        """The first unit of the Whisper context that `unit` is encoded in."""
        if unit < 0:
            raise ValueError(f"unit index must be >= 0, got {unit}")
        return unit - unit % self.units_per_context


# ---------------------------------------------------------------------------------------------
# log-mel


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney's scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic (27 mels per factor
    # 6.4) above
    mels = hz / (200.0 / 3.0)
    log_part = hz >= 1000.0
    mels[log_part] = 15.0 + np.log(hz[log_part] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _slaney_mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = mels * (200.0 / 3.0)
    log_part = mels >= 15.0
    hz[log_part] = 1000.0 * np.exp((mels[log_part] - 15.0) * (np.log(6.4) / 27.0))
    return hz


def slaney_mel_filters(
    n_fft: int = N_FFT,
    n_mels: int = N_MELS,
    sample_rate: int = SAMPLE_RATE,
    fmax: float = MEL_FMAX,
) -> np.ndarray:
    """Whisper's filter bank, [n_fft // 2 + 1, n_mels] float64: triangles between Slaney-mel
    spaced edges from 0 Hz to `fmax`, each scaled to unit area (Slaney norm)."""
    bins = n_fft // 2 + 1
    fft_hz = np.linspace(0.0, sample_rate // 2, bins)
    edges_hz = _slaney_mel_to_hz(
        np.linspace(0.0, _hz_to_slaney_mel(np.array([fmax]))[0], n_mels + 2)
    )
    widths = np.diff(edges_hz)
    offsets = edges_hz[None, :] - fft_hz[:, None]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


@functools.cache
def _mel_filters() -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filters()).to(torch.float32)


@functools.cache
def _hann_window() -> torch.Tensor:
    return torch.hann_window(N_FFT)


def log_mel_spectrogram(samples: np.ndarray, *, dynamic_floor: bool) -> np.ndarray:
    """The whole log-mel of `samples` (16 kHz), [80, len // 160] float32: a centred, reflect-padded
    STFT whose last frame is dropped (as Whisper does), power through the mel bank,
    log10 (clamped at 1e-10), the floor (`max - 8` if `dynamic_floor`, else -10), then
    `(x + 4) / 4`. Computed in float32 with torch on the CPU, as the reference computes it."""
    if samples.ndim != 1 or samples.shape[0] < N_FFT:
        raise ValueError(f"log-mel needs 1-D audio of >= {N_FFT} samples, got {samples.shape}")
    wave = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))[None]
    spectrum = torch.stft(
        wave,
        n_fft=N_FFT,
        hop_length=HOP_LENGTH,
        window=_hann_window(),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )
    power = spectrum[..., :-1].abs() ** 2
    log_spec = torch.clamp(_mel_filters().T @ power, min=1e-10).log10()
    if dynamic_floor:
        floor = log_spec.max() - DYNAMIC_RANGE
    else:
        floor = torch.tensor(FIXED_LOG_FLOOR, dtype=log_spec.dtype)
    log_spec = torch.maximum(log_spec, floor)
    return ((log_spec + 4.0) / 4.0)[0].numpy()


@dataclasses.dataclass(frozen=True, eq=False)
class MelUnit:
    """One unit's mel frames for the encoder: [80, prefix + 100 + 2] float32, where `prefix`
    is 0 for a session's first unit and 2 after it."""

    index: int
    frames: np.ndarray
    prefix_frames: int

    suffix_frames = REDUNDANCY_FRAMES

    def __post_init__(self) -> None:
        expected = (N_MELS, self.prefix_frames + UNIT_FRAMES + self.suffix_frames)
        if self.frames.shape != expected:
            raise ValueError(f"mel unit {self.index}: frames {self.frames.shape}, need {expected}")


def _check_unit(samples: np.ndarray) -> np.ndarray:
    if samples.shape != (UNIT_SAMPLES,):
        raise ValueError(
            f"an audio unit is {UNIT_SAMPLES} samples (1 s at 16 kHz), got shape {samples.shape}"
        )
    return samples.astype(np.float32, copy=False)


class MelStream:
    """One session's streaming log-mel: the <= 30 s buffer the mel is computed over, the 80
    samples carried to the next unit, and where the buffer starts in the session's frames."""

    def __init__(self) -> None:
        self._buffer = np.zeros(0, dtype=np.float32)
        self._carry = np.zeros(0, dtype=np.float32)
        self._buffer_start_frame = 0
        self._units = 0

    @property
    def units(self) -> int:
        """Units pushed so far (the next unit's index)."""
        return self._units

    @property
    def buffer_samples(self) -> int:
        return int(self._buffer.shape[0])

    @property
    def buffer_start_frame(self) -> int:
        """The session frame index of the buffer's first frame (1000 per slide)."""
        return self._buffer_start_frame

    @property
    def carried_samples(self) -> int:
        return int(self._carry.shape[0])

    def skip(self, samples: np.ndarray) -> None:
        """Takes a unit into the buffer without computing its mel (a replay's early units)."""
        samples = _check_unit(samples)
        if self._units == 0:
            audio = np.concatenate([np.zeros(FIRST_UNIT_PADDING, np.float32), samples])
            take = FIRST_UNIT_CONSUMED
        else:
            audio = np.concatenate([self._carry, samples])
            take = UNIT_SAMPLES
        self._buffer = np.concatenate([self._buffer, audio[:take]])
        self._carry = audio[take:].copy()
        if self._buffer.shape[0] >= MEL_WINDOW_SAMPLES:
            # the reference keeps >= 1 s and drops whole hops: with a >= 30 s buffer and a 10 s
            # stride, both always hold, so it drops exactly 10 s
            self._buffer = self._buffer[MEL_SLIDE_SAMPLES:].copy()
            self._buffer_start_frame += MEL_SLIDE_SAMPLES // HOP_LENGTH
        self._units += 1

    def push(self, samples: np.ndarray) -> MelUnit:
        """Takes one unit (16000 samples) and returns its mel frames."""
        index = self._units
        self.skip(samples)
        mel = log_mel_spectrogram(
            self._buffer, dynamic_floor=self._buffer.shape[0] >= DYNAMIC_FLOOR_FROM_SAMPLES
        )
        prefix = 0 if index == 0 else REDUNDANCY_FRAMES
        start = index * UNIT_FRAMES - prefix - self._buffer_start_frame
        end = (index + 1) * UNIT_FRAMES + REDUNDANCY_FRAMES - self._buffer_start_frame
        # every emitted frame's window lies inside the buffer (its centre + n_fft/2 <= length)
        assert start >= 0 and end <= mel.shape[1], (index, start, end, mel.shape)
        return MelUnit(
            index=index, frames=np.ascontiguousarray(mel[:, start:end]), prefix_frames=prefix
        )

    @classmethod
    def replay(
        cls, units: Sequence[np.ndarray], *, emit_from: int = 0
    ) -> tuple[MelStream, list[MelUnit]]:
        """The stream after `units`, and the mel of each unit from `emit_from` on (a restore
        needs only those since the start of the Whisper context)."""
        stream = cls()
        mels = []
        for index, samples in enumerate(units):
            if index < emit_from:
                stream.skip(samples)
            else:
                mels.append(stream.push(samples))
        return stream, mels


# ---------------------------------------------------------------------------------------------
# the Whisper encoder


class EncoderKV:
    """One session's Whisper streaming KV: keys and values, [layers, heads, capacity, head_dim],
    of the `length` positions cached since the last reset; `next_unit` is the unit it expects."""

    def __init__(
        self,
        config: AudioConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        next_unit: int = 0,
    ) -> None:
        if config.context_start(next_unit) != next_unit:
            raise ValueError(
                f"an empty Whisper KV can start only where a context starts (a multiple of "
                f"{config.units_per_context}), not at unit {next_unit}"
            )
        # a context never caches more than its units' positions (1450 of Whisper's 1500)
        capacity = config.units_per_context * POSITIONS_PER_UNIT
        shape = (config.encoder_layers, config.encoder_attention_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.next_unit = next_unit


class WhisperSelfAttention(nn.Module):
    """Whisper's attention projections (k_proj has no bias); the attention itself is done by the
    encoder over the streaming KV."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)


class WhisperEncoderLayer(nn.Module):
    """A pre-LN Whisper encoder layer, under Whisper's parameter names."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.heads = config.encoder_attention_heads
        self.self_attn = WhisperSelfAttention(config.d_model)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(
        self,
        hidden: torch.Tensor,
        past_keys: torch.Tensor | None,
        past_values: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [rows, n, d]; past_* [rows, heads, c, head_dim] or None; mask [rows, 1, n, c + n]
        (True = attend). Returns the new hidden and this call's keys and values."""
        rows, n, d = hidden.shape
        normed = self.self_attn_layer_norm(hidden)

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(rows, n, self.heads, d // self.heads).transpose(1, 2)

        query = heads(self.self_attn.q_proj(normed))
        keys = heads(self.self_attn.k_proj(normed))
        values = heads(self.self_attn.v_proj(normed))
        all_keys, all_values = keys, values
        if past_keys is not None:
            all_keys = torch.cat([past_keys, keys], dim=2)
            all_values = torch.cat([past_values, values], dim=2)
        attended = F.scaled_dot_product_attention(query, all_keys, all_values, attn_mask=mask)
        hidden = hidden + self.self_attn.out_proj(attended.transpose(1, 2).reshape(rows, n, d))
        hidden = hidden + self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden))))
        return hidden, keys, values


@dataclasses.dataclass
class _Row:
    """One forward row: consecutive units of one session inside one Whisper context."""

    run: int  # which of the call's runs (sessions) it belongs to
    mels: list[MelUnit]
    past: EncoderKV | None  # the KV whose cached positions the row attends to (None: fresh)
    past_length: int
    target: EncoderKV | None  # the KV that keeps the row's keys (None: a later reset drops them)

    @property
    def positions(self) -> int:
        return POSITIONS_PER_UNIT * len(self.mels)


class StreamingWhisperEncoder(nn.Module):
    """Whisper's encoder run unit by unit over a per-session KV (`EncoderKV`). Its state_dict
    keys are the checkpoint's `apm.*` keys without the prefix."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.conv1 = nn.Conv1d(config.num_mel_bins, config.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.d_model, config.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, config.d_model)
        self.layers = nn.ModuleList(
            [WhisperEncoderLayer(config) for _ in range(config.encoder_layers)]
        )
        self.layer_norm = nn.LayerNorm(config.d_model)

    def new_kv(self, next_unit: int = 0) -> EncoderKV:
        """An empty KV on this encoder's device and dtype, for a session whose next unit is
        `next_unit` (0, or the start of a context when restoring)."""
        weight = self.conv1.weight
        return EncoderKV(self.config, dtype=weight.dtype, device=weight.device, next_unit=next_unit)

    def _plan(self, runs: Sequence[tuple[EncoderKV, Sequence[MelUnit]]]) -> list[_Row]:
        """Splits each session's run at its KV resets: the rows of one forward."""
        rows: list[_Row] = []
        seen: set[int] = set()
        for run, (kv, mels) in enumerate(runs):
            if id(kv) in seen:
                raise ValueError("a session's KV appears twice in one encoder call")
            seen.add(id(kv))
            if not mels:
                raise ValueError("an encoder run needs at least one unit")
            length = kv.length
            row = _Row(run=run, mels=[], past=kv, past_length=length, target=None)
            for offset, mel in enumerate(mels):
                if mel.index != kv.next_unit + offset:
                    raise ValueError(
                        f"mel unit {mel.index} given where unit {kv.next_unit + offset} is next"
                    )
                conv_positions = (mel.frames.shape[1] - 1) // 2 + 1
                if length and length + conv_positions >= self.config.max_source_positions:
                    if row.mels:
                        rows.append(row)
                    row = _Row(run=run, mels=[], past=None, past_length=0, target=None)
                    length = 0
                row.mels.append(mel)
                length += POSITIONS_PER_UNIT
            row.target = kv
            rows.append(row)
        return rows

    def _embed_units(self, mels: list[MelUnit]) -> torch.Tensor:
        """The convolutions, the redundancy trim and nothing else: [units, 50, d_model]."""
        weight = self.conv1.weight
        out = torch.empty(
            len(mels),
            POSITIONS_PER_UNIT,
            self.config.d_model,
            dtype=weight.dtype,
            device=weight.device,
        )
        # units of one frame count go through the convolutions together (the first unit of a
        # session is 2 frames shorter)
        by_length: dict[int, list[int]] = {}
        for i, mel in enumerate(mels):
            by_length.setdefault(mel.frames.shape[1], []).append(i)
        for members in by_length.values():
            frames = torch.from_numpy(np.stack([mels[i].frames for i in members]))
            frames = frames.to(device=weight.device, dtype=weight.dtype)
            conv = F.gelu(self.conv2(F.gelu(self.conv1(frames))))  # [n, d, positions]
            for j, i in enumerate(members):
                # a redundancy frame pair became one conv position on that side
                prefix = (mels[i].prefix_frames + 1) // 2
                suffix = (mels[i].suffix_frames + 1) // 2
                out[i] = conv[j, :, prefix : conv.shape[2] - suffix].transpose(0, 1)
        return out

    def _mask(self, rows: list[_Row], past_max: int, new_max: int) -> torch.Tensor:
        """[rows, 1, new_max, past_max + new_max]: every cached position, and the positions of
        the row's units up to the query's own (bidirectional inside a unit)."""
        device = self.conv1.weight.device
        past_lengths = torch.tensor([row.past_length for row in rows], device=device)
        unit_counts = torch.tensor([len(row.mels) for row in rows], device=device)
        past = torch.arange(past_max, device=device)[None, :] < past_lengths[:, None]
        unit_of = torch.arange(new_max, device=device) // POSITIONS_PER_UNIT
        new = (unit_of[None, :] <= unit_of[:, None])[None] & (
            unit_of[None, None, :] < unit_counts[:, None, None]
        )
        # padded queries see the row's first unit (never empty), so no row of the softmax is
        # empty; their outputs are thrown away
        past = past[:, None, :].expand(len(rows), new_max, past_max)
        return torch.cat([past, new], dim=2)[:, None]

    @torch.no_grad()
    def encode(self, runs: Sequence[tuple[EncoderKV, Sequence[MelUnit]]]) -> list[torch.Tensor]:
        """Encodes, for each session, its next consecutive units in one forward, and advances
        each session's KV. Returns per run [units, 50, d_model], post-final-LayerNorm."""
        rows = self._plan(runs)
        mels = [mel for row in rows for mel in row.mels]
        embedded = self._embed_units(mels)
        past_max = max(row.past_length for row in rows)
        new_max = max(row.positions for row in rows)
        weight = self.conv1.weight
        hidden = torch.zeros(
            len(rows), new_max, self.config.d_model, dtype=weight.dtype, device=weight.device
        )
        position_ids = torch.zeros(len(rows), new_max, dtype=torch.long, device=weight.device)
        first = 0
        for r, row in enumerate(rows):
            n = row.positions
            hidden[r, :n] = embedded[first : first + len(row.mels)].reshape(n, -1)
            position_ids[r] = torch.arange(row.past_length, row.past_length + new_max).clamp(
                max=self.config.max_source_positions - 1
            )
            first += len(row.mels)
        hidden = hidden + self.embed_positions(position_ids)
        mask = self._mask(rows, past_max, new_max)

        for index, layer in enumerate(self.layers):
            past_keys = past_values = None
            if past_max:
                # a copy of every row's cache, taken before any row writes this layer's slot
                past_keys = hidden.new_zeros(len(rows), layer.heads, past_max, self.config.head_dim)
                past_values = torch.zeros_like(past_keys)
                for r, row in enumerate(rows):
                    if row.past is not None and row.past_length:
                        cached = slice(0, row.past_length)
                        past_keys[r, :, cached] = row.past.keys[index, :, cached]
                        past_values[r, :, cached] = row.past.values[index, :, cached]
            hidden, keys, values = layer(hidden, past_keys, past_values, mask)
            for r, row in enumerate(rows):
                if row.target is not None:
                    start, n = row.past_length, row.positions
                    row.target.keys[index, :, start : start + n] = keys[r, :, :n]
                    row.target.values[index, :, start : start + n] = values[r, :, :n]
        hidden = self.layer_norm(hidden)

        outputs: list[list[torch.Tensor]] = [[] for _ in runs]
        for r, row in enumerate(rows):
            outputs[row.run].append(
                hidden[r, : row.positions].reshape(len(row.mels), POSITIONS_PER_UNIT, -1)
            )
            if row.target is not None:
                row.target.length = row.past_length + row.positions
        for kv, run_mels in runs:
            kv.next_unit += len(run_mels)
        return [torch.cat(parts) for parts in outputs]


# ---------------------------------------------------------------------------------------------
# projector, pooling, and the tower


class AudioProjector(nn.Module):
    """`audio_projection_layer`: Linear(d_model -> D), ReLU, Linear(D -> D)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(hidden)))


#: the longest reference voice the whole-clip path takes (Whisper's window: the reference
#: splits a longer clip into 30 s pieces; we refuse it instead)
MAX_CLIP_SAMPLES = 30 * SAMPLE_RATE
#: positions of a chunk of the whole-clip pass's attention mask (1 s after the convolutions)
CLIP_CHUNK_POSITIONS = 50


def clip_mel(samples: np.ndarray, *, dynamic_floor: bool) -> np.ndarray:
    """A reference voice's log-mel as Whisper's feature extractor makes it for one clip (the
    reference's `process_audio`): the clip zero-padded to 30 s, the log-mel of all of it (so
    a dynamic floor is `max - 8` of the whole padded window), then the frames of the clip
    itself kept: [80, ceil(len / 160)]."""
    if samples.ndim != 1 or not 0 < samples.shape[0] <= MAX_CLIP_SAMPLES:
        raise ValueError(f"a reference voice is 1-D audio of at most 30 s, got {samples.shape}")
    padded = np.zeros(MAX_CLIP_SAMPLES, dtype=np.float32)
    padded[: samples.shape[0]] = samples
    frames = -(-samples.shape[0] // HOP_LENGTH)
    return log_mel_spectrogram(padded, dynamic_floor=dynamic_floor)[:, :frames]


class AudioTower(nn.Module):
    """The encoder and the projector under the checkpoint's names (`apm.*`,
    `audio_projection_layer.*`): mel units in, `embeddings_per_unit` LLM embeddings per unit
    out."""

    def __init__(
        self,
        config: AudioConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.apm = StreamingWhisperEncoder(config)
        self.audio_projection_layer = AudioProjector(config.d_model, config.llm_hidden_size)
        self.to(device=device, dtype=dtype)
        self.eval()

    def new_kv(self, next_unit: int = 0) -> EncoderKV:
        return self.apm.new_kv(next_unit)

    def embed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Projector then the mean of each `pool_step` positions: [u, 50, d] -> [u, 10, D]."""
        projected = self.audio_projection_layer(hidden)
        pooled = F.avg_pool1d(
            projected.transpose(1, 2), self.config.pool_step, stride=self.config.pool_step
        )
        return pooled.transpose(1, 2)

    @torch.no_grad()
    def step(self, mels: Sequence[MelUnit], kvs: Sequence[EncoderKV]) -> torch.Tensor:
        """The current unit of several sessions in one forward: [sessions, 10, D]."""
        if len(mels) != len(kvs):
            raise ValueError(f"{len(mels)} mel units for {len(kvs)} sessions")
        hidden = self.apm.encode([(kv, [mel]) for mel, kv in zip(mels, kvs, strict=True)])
        return self.embed(torch.cat(hidden))

    @torch.no_grad()
    def replay(self, mels: Sequence[MelUnit], kv: EncoderKV) -> torch.Tensor:
        """Consecutive units of one session in one forward (split at its KV resets):
        [units, 10, D], equal to stepping them one by one."""
        return self.embed(self.apm.encode([(kv, list(mels))])[0])

    @torch.no_grad()
    def encode_clip(self, mel: np.ndarray) -> torch.Tensor:
        """A whole clip (a reference voice) in one pass, as the reference's
        `get_audio_embedding(chunk_length=1.0)` does it: the convolutions over all its mel
        frames, positions from 0, each position attending to its own 1 s chunk and every
        chunk before it (no streaming cache), the final LayerNorm, the projector and the
        pooling: [positions // 5, D] embeddings for the language model."""
        apm = self.apm
        weight = apm.conv1.weight
        frames = torch.from_numpy(np.ascontiguousarray(mel)).to(weight.device, weight.dtype)
        hidden = F.gelu(apm.conv2(F.gelu(apm.conv1(frames[None]))))  # [1, d, positions]
        positions = hidden.shape[2]
        if positions > self.config.max_source_positions:
            raise ValueError(f"a clip of {positions} positions is longer than Whisper's window")
        hidden = hidden.transpose(1, 2) + apm.embed_positions.weight[:positions]
        index = torch.arange(positions, device=weight.device)
        chunk_end = (index // CLIP_CHUNK_POSITIONS + 1) * CLIP_CHUNK_POSITIONS
        mask = (index[None, :] < chunk_end[:, None])[None, None]  # [1, 1, P, P]
        for layer in apm.layers:
            hidden, _, _ = layer(hidden, None, None, mask)
        return self.embed(apm.layer_norm(hidden))[0]
