"""The PersonaPlex preset: NVIDIA's Moshi fine-tune with a persona and a voice prompt.

PersonaPlex (nvidia/personaplex-7b-v1) is Moshi 7B's architecture and weight layout (its
checkpoint ships the 8 depformer steps Moshi has; NVIDIA's fork copies them to 16 at load
so that the depformer also predicts the user's codebooks, which are always given: the
model's own tokens are distributed the same with 8), so kyutai's PyPI `moshi` loads it
unchanged. What differs is the prompt stepped before the conversation (NVIDIA's fork,
`LMGen.step_system_prompts`): the voice prompt, 6 frames (0.5 s) of silence, the persona as
text tokens forced one per frame (`"<system> " + persona + " <system>"`, sentencepiece ids
without BOS/EOS), 6 frames of silence. Throughout, the user stream is the Mimi codes of a
440 Hz sine (`SINE_TOKENS`), the model's audio is forced to the codes of silence
(`SILENCE_TOKENS`) and its text to padding (3) except for the persona's tokens.

PyPI `moshi` 0.2.13 has no way to force the model's tokens by argument (the fork's
`LMGen.step(moshi_tokens=, text_token=)`); MoshiFrameModel forces them through LMGen's text
and audio hooks, per slot, one prompt frame per tick while the other slots run on.

Voice prompts: a `.wav` (the fork's `load_voice_prompt`) is Mimi-encoded once per file, its
frames forced as the model's audio with text padding. The fork normalizes it to -24 LUFS; we
scale it to -24 dBFS RMS (no K-weighting: a little louder or softer than the fork for the
same file).

A `.pt` voice prompt (NVIDIA's voices.tgz: NATF0..3, NATM0..3, VARF0..4, VARM0..4) is what
the fork saved while stepping a `.wav` one: `{"embeddings": E, "cache": C}`, E the LM's input
embeddings of the P steps that ran the transformer ([P, 1, 1, dim]: the columns 0..P-1 it
read; the fork's first step, at offset 0, only initializes), C its token cache after them
([1, K, CT], CT = max delay + 3 in the fork). The fork replays E through the transformer
alone (`LMGen.step_embeddings`, which PyPI moshi 0.2.13 lacks) and copies C back. We load it
(checked when a session opens, kept per file) as MoshiFrameModel's `PromptPrefix`, replayed
by its side-batch replay before the prompt frames (as many frames a `replay_work` call as
the stage asks; a restored slot's prefix and history count alike, one call may span both):

- positions: the fork's LMGen offset runs one ahead of its transformer (its step at offset o
  reads cache column o - 1), PyPI's LMGen runs the transformer at every step (its step at
  offset o reads column o). Cache columns mean the same in both (column p: the model's
  tokens predicted from column p - 1 and the user's codes of that frame, each codebook in
  its delayed layout), so after E our LMGen offset is P, the transformer's position, and
  C's columns map onto PyPI's ring (CT = max delay + 2) by absolute position: PyPI
  position p takes C[:, :, p % CT]. The fork's ring holds positions P - 2..P + 1: column P
  (the fork's next input) whole, and the delayed codebooks of column P + 1.
- the first frame of silence after the voice is part of the prefix: its input is C's column
  P (embedded here with the LM's embeddings, as `forward_text` does) and its output, column
  P + 1, is forced whole, text padding, silence for the codebooks without delay, and for the
  delayed ones the voice's last codes, which C holds at P + 1. Stepped as a prompt frame it
  would force silence there instead (the frame model's delayed layout starts from the frame
  itself), one column off the fork's. So a `.pt` prefix is P + 1 frames, the prompt frames
  after it 5 of silence, the persona, 6 of silence, and the LM state after the whole prompt
  is the fork's column for column (tests/plugins/moshi/test_personaplex.py makes a `.pt` the way
  the fork does and checks it against the `.wav` it was made from, token for token).

A bad `.pt` (not a torch file, other keys, a width or codebook count not the LM's, tokens
out of range where the next steps read) refuses the session's open, as a bad `.wav` does.
Config.json key `"personaplex"` (ours) may override the token constants (`silence_tokens`,
`sine_tokens`: the tiny test model's codebooks are small).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import wave
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moshi.models import loaders
from moshi.models.lm import LMModel

from plugins.moshi.checkpoint import CheckpointError, MoshiCheckpoint
from plugins.moshi.frame_model import MoshiFrameModel, PromptFrame, PromptPrefix
from shared.contracts import DuplexRuntimeConfigError
from shared.protocol.duplex import StreamingResampler

#: Mimi codes of one frame of silence and of a 440 Hz sine (NVIDIA's fork, lm.py)
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
#: frames of silence after the voice prompt and after the persona (0.5 s at 12.5 Hz)
SILENCE_FRAMES = 6
TEXT_PADDING = 3
#: a persona longer than this (in tokens, one frame each: 32 s) is refused
MAX_PERSONA_TOKENS = 400
VOICE_SUFFIXES = (".wav", ".pt")
TARGET_DBFS = -24.0
#: Mimi's frame (12.5 Hz), before a model is attached to tell its own
MIMI_FRAME_S = 0.08


def checkpoint_preset(checkpoint: MoshiCheckpoint) -> str:
    """The preset a checkpoint calls for: config.json's `"preset"`, else `personaplex` when
    it carries PersonaPlex's voices (`voices/`, `voices.tgz`) or our `"personaplex"` key."""
    raw = checkpoint.raw_config
    if isinstance(raw.get("preset"), str):
        return raw["preset"]
    directory = checkpoint.directory
    if (
        (directory / "voices").is_dir()
        or (directory / "voices.tgz").exists()
        or "personaplex" in raw
    ):
        return "personaplex"
    return "moshi"


def wrap_with_system_tags(persona: str) -> str:
    """The fork's persona framing: `<system> text <system>` (kept if already framed)."""
    text = persona.strip()
    if text.startswith("<system>") and text.endswith("<system>"):
        return text
    return f"<system> {text} <system>"


@contextlib.contextmanager
def _pcm16_wav(path: Path) -> Iterator[wave.Wave_read]:
    """A voice prompt opened as 16-bit PCM WAV; anything else is the session's config error."""
    try:
        with wave.open(str(path), "rb") as wav:
            if wav.getsampwidth() != 2:
                raise ValueError("not 16-bit PCM")
            yield wav
    except (OSError, EOFError, ValueError, ZeroDivisionError, wave.Error) as error:
        raise DuplexRuntimeConfigError(
            "invalid_duplex_runtime_config", f"voice prompt {path.name}: {error}", param="voice"
        ) from error


def read_wav(path: Path, rate_hz: int) -> np.ndarray:
    """A PCM16 WAV as mono float32 at `rate_hz`, scaled to TARGET_DBFS RMS."""
    with _pcm16_wav(path) as wav:
        channels, source_rate = wav.getnchannels(), wav.getframerate()
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    audio = samples.reshape(-1, channels).mean(axis=1).astype(np.float32) / 32768.0
    if source_rate != rate_hz:
        resampler = StreamingResampler(source_rate, rate_hz)
        audio = np.concatenate([resampler.process(audio), resampler.flush()])
    rms = float(np.sqrt(np.mean(audio**2))) if audio.size else 0.0
    if rms > 0:
        audio = audio * (10 ** (TARGET_DBFS / 20) / rms)
    return np.clip(audio, -1.0, 1.0).astype(np.float32)


def check_voice_wav(path: Path, min_seconds: float) -> None:
    """What a voice file's header tells without decoding it: 16-bit PCM, at least one
    frame long. Checked when a session opens, so the model's slot open does not fail on
    it after `session.created`."""
    with _pcm16_wav(path) as wav:
        seconds = wav.getnframes() / wav.getframerate()
    if seconds < min_seconds:
        raise DuplexRuntimeConfigError(
            "invalid_duplex_runtime_config",
            f"voice prompt {path.name} is too short ({seconds * 1000:.0f} ms: at least one "
            f"{min_seconds * 1000:.0f} ms frame)",
            param="voice",
        )


def _voice_error(path: Path, reason: str) -> DuplexRuntimeConfigError:
    return DuplexRuntimeConfigError(
        "invalid_duplex_runtime_config", f"voice prompt {path.name}: {reason}", param="voice"
    )


@dataclasses.dataclass(frozen=True)
class LMLayout:
    """What a `.pt` voice must fit: the LM's width, codebooks, cardinalities and delays."""

    dim: int
    card: int
    text_card: int
    dep_q: int
    delays: tuple[int, ...]

    @property
    def num_codebooks(self) -> int:
        return len(self.delays)

    @classmethod
    def of_lm(cls, lm: LMModel) -> LMLayout:
        return cls(lm.dim, lm.card, lm.text_card, lm.dep_q, tuple(lm.delays))

    @classmethod
    def of_checkpoint(cls, checkpoint: MoshiCheckpoint) -> LMLayout:
        """From the LM's kwargs, before the LM is loaded (LMModel's defaults where absent)."""
        kwargs = checkpoint.info.lm_config or loaders._lm_kwargs
        defaults = inspect.signature(LMModel.__init__).parameters

        def get(name: str) -> Any:
            return kwargs.get(name, defaults[name].default)

        return cls(
            int(get("dim")),
            int(get("card")),
            int(get("text_card")),
            int(get("dep_q")),
            tuple(int(d) for d in get("delays")),
        )


def embed_tokens(lm: LMModel, tokens: torch.Tensor) -> torch.Tensor:
    """[B, K, T] token columns -> [B, T, dim]: the LM's input embeddings, summed in the
    order `LMModel.forward_text` sums them (so that they are its own, to the last bit)."""
    total: torch.Tensor | None = None
    for codebook in range(lm.num_audio_codebooks):
        embedded = lm.emb[codebook](tokens[:, codebook + lm.audio_offset])
        total = embedded if total is None else total + embedded
    text = lm.text_emb(tokens[:, 0])
    return text if total is None else total + text


@dataclasses.dataclass(frozen=True)
class VoiceEmbeddings:
    """A `.pt` voice prompt as NVIDIA's fork saved it, checked against the LM (on the CPU)."""

    embeddings: torch.Tensor  # [P, dim], the file's dtype
    cache: np.ndarray  # [K, CT] int64: LMGen's token cache after the P steps

    @property
    def frames(self) -> int:
        return int(self.embeddings.shape[0])

    def column(self, position: int) -> np.ndarray:
        """The cache's column at an absolute position (the fork's ring, by its modulo)."""
        return self.cache[:, position % self.cache.shape[1]].copy()


def load_voice_embeddings(path: Path, layout: LMLayout) -> VoiceEmbeddings:
    """A `.pt` voice prompt, refused (the session's config error) unless it is a torch file
    of `{"embeddings": [P, 1, 1, dim] or [P, dim], "cache": [1, K, CT]}` that fits the LM,
    its tokens the next steps read in range."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an unpickler's errors are many: any of them is a bad file
        # (named, not quoted: torch's messages run long and suggest weights_only=False)
        reason = f"not a torch file of tensors, as NVIDIA's fork saves ({type(error).__name__})"
        raise _voice_error(path, reason) from error
    if not isinstance(state, Mapping) or not {"embeddings", "cache"} <= set(state):
        keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise _voice_error(path, f"wants the keys 'embeddings' and 'cache', got {keys}")
    embeddings, cache = state["embeddings"], state["cache"]
    if not isinstance(embeddings, torch.Tensor) or not isinstance(cache, torch.Tensor):
        raise _voice_error(path, "'embeddings' and 'cache' must be tensors")
    dim = layout.dim
    shape = tuple(embeddings.shape)
    if len(shape) == 4 and shape[1:3] == (1, 1):
        embeddings = embeddings[:, 0, 0]
    if embeddings.dim() != 2 or embeddings.shape[0] < 1 or not embeddings.is_floating_point():
        raise _voice_error(
            path, f"embeddings of shape {list(shape)} ({embeddings.dtype}): [frames, 1, 1, {dim}]"
        )
    if embeddings.shape[1] != dim:
        raise _voice_error(path, f"embeddings of width {embeddings.shape[1]}, the LM's is {dim}")
    if not torch.isfinite(embeddings).all():
        raise _voice_error(path, "embeddings that are not finite")
    k, max_delay = layout.num_codebooks, max(layout.delays)
    if (
        cache.dim() != 3
        or cache.shape[0] != 1
        or cache.is_floating_point()
        or cache.is_complex()
        or cache.dtype == torch.bool
    ):
        raise _voice_error(
            path, f"a cache of shape {list(cache.shape)} ({cache.dtype}): [1, {k}, CT]"
        )
    if cache.shape[1] != k:
        raise _voice_error(path, f"a cache of {cache.shape[1]} codebooks, the LM has {k}")
    if cache.shape[2] < max_delay + 2:
        raise _voice_error(path, f"a cache ring of {cache.shape[2]} columns, under {max_delay + 2}")
    voice = VoiceEmbeddings(embeddings, cache[0].to(torch.int64).numpy())
    # what the next steps read: column P whole, the delayed codebooks of P + 1 and on
    limits = np.array([layout.text_card] + [layout.card] * (k - 1))
    delays = np.array(layout.delays)
    for ahead in range(max_delay + 1):
        column, read = voice.column(voice.frames + ahead), delays >= ahead
        if ((column < 0) | (column > limits))[read].any():
            raise _voice_error(
                path, f"cache tokens at position {voice.frames + ahead} out of range: {column}"
            )
    return voice


class PersonaPlexPreset:
    """Validates a session's persona and voice, and builds its prompt frames."""

    def __init__(self, checkpoint: MoshiCheckpoint, voice_prompt_dir: Path | None) -> None:
        settings = checkpoint.raw_config.get("personaplex", {})
        if not isinstance(settings, dict):
            raise CheckpointError(
                f"{checkpoint.directory}/config.json: 'personaplex' must be a dict"
            )
        self.silence_tokens = tuple(settings.get("silence_tokens", SILENCE_TOKENS))
        self.sine_tokens = tuple(settings.get("sine_tokens", SINE_TOKENS))
        default_dir = checkpoint.directory / "voices"
        self.voice_prompt_dir = voice_prompt_dir or (default_dir if default_dir.is_dir() else None)
        if voice_prompt_dir is not None and not voice_prompt_dir.is_dir():
            raise ValueError(
                f"moshi option voice_prompt_dir {str(voice_prompt_dir)!r} is not a directory"
            )
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.load_tokenizer()
        self._model: MoshiFrameModel | None = None
        self._voice_codes: dict[str, list[tuple[int, ...]]] = {}
        self._voice_embeddings: dict[str, VoiceEmbeddings] = {}
        self._prefixes: dict[str, PromptPrefix] = {}
        self._encoder: Any = None

    # ------------------------------------------------------------ session policy

    def persona_tokens(self, persona: str | None) -> list[int]:
        if not persona or not persona.strip():
            return []
        return list(self.tokenizer.encode(wrap_with_system_tags(persona)))

    def voice_path(self, voice: str) -> Path:
        """The voice prompt file named `voice` in `voice_prompt_dir` (a name, never a path)."""
        if not voice or Path(voice).name != voice or voice.startswith("."):
            raise DuplexRuntimeConfigError(
                "invalid_duplex_runtime_config",
                f"voice {voice!r} must be the name of a voice prompt file, not a path",
                param="voice",
            )
        if self.voice_prompt_dir is None:
            raise DuplexRuntimeConfigError(
                "invalid_duplex_runtime_config",
                f"voice {voice!r}: this worker has no voice prompts (voice_prompt_dir)",
                param="voice",
            )
        names = [voice] + [voice + suffix for suffix in VOICE_SUFFIXES]
        for name in names:
            path = self.voice_prompt_dir / name
            if path.is_file() and path.suffix in VOICE_SUFFIXES:
                return path
        raise DuplexRuntimeConfigError(
            "invalid_duplex_runtime_config",
            f"voice {voice!r}: no {voice}.wav or {voice}.pt in the voice prompt directory",
            param="voice",
        )

    def runtime_config(self, instructions: str | None, voice: str | None) -> dict[str, Any]:
        tokens = self.persona_tokens(instructions)
        if len(tokens) > MAX_PERSONA_TOKENS:
            raise DuplexRuntimeConfigError(
                "invalid_duplex_runtime_config",
                f"instructions are {len(tokens)} tokens: a PersonaPlex persona is at most "
                f"{MAX_PERSONA_TOKENS} (one 80 ms frame each before the conversation)",
                param="instructions",
            )
        voice_name = None
        if voice:
            path = self.voice_path(voice)
            if path.suffix == ".pt":
                self.voice_embeddings(path.name)
            else:
                check_voice_wav(path, self.frame_seconds)
            voice_name = path.name
        return {"persona": instructions.strip() if tokens else None, "voice": voice_name}

    @property
    def frame_seconds(self) -> float:
        model = self._model
        if model is None:
            return MIMI_FRAME_S
        return model.frame_samples / model.input_sample_rate_hz

    # ------------------------------------------------------------ the model side

    def attach(self, model: MoshiFrameModel) -> None:
        card = model.lm.card
        for name, codes in (
            ("silence_tokens", self.silence_tokens),
            ("sine_tokens", self.sine_tokens),
        ):
            if len(codes) < model.lm.dep_q or not all(0 <= c < card for c in codes):
                raise CheckpointError(
                    f"personaplex {name} {codes} do not fit the LM ({model.lm.dep_q} codebooks "
                    f"of {card})"
                )
        self._model = model
        self._prefixes.clear()  # built for the model attached before
        model.prompt_builder = self.prompt_frames
        model.prefix_builder = self.prompt_prefix

    def prompt_frames(self, options: Mapping[str, Any]) -> list[PromptFrame]:
        """Voice prompt, silence, persona, silence (the fork's `step_system_prompts`). A
        `.pt` voice is the slot's prefix (`prompt_prefix`), and so is the first frame of
        silence after it."""
        sine, silence = self.sine_tokens, self.silence_tokens
        frames: list[PromptFrame] = []
        voice = options.get("voice")
        silence_after_voice = SILENCE_FRAMES
        if voice and self.is_embedded(voice):
            silence_after_voice -= 1
        elif voice:
            for codes in self.voice_codes(voice):
                frames.append(PromptFrame(sine, TEXT_PADDING, codes))
        frames += [PromptFrame(sine, TEXT_PADDING, silence)] * silence_after_voice
        persona = self.persona_tokens(options.get("persona"))
        if persona:
            frames += [PromptFrame(sine, token, silence) for token in persona]
            frames += [PromptFrame(sine, TEXT_PADDING, silence)] * SILENCE_FRAMES
        return frames

    @staticmethod
    def is_embedded(voice: str) -> bool:
        """Whether a runtime config's voice (a file name) is a `.pt` voice prompt."""
        return Path(voice).suffix == ".pt"

    def layout(self) -> LMLayout:
        model = self._model
        return (
            LMLayout.of_lm(model.lm)
            if model is not None
            else LMLayout.of_checkpoint(self.checkpoint)
        )

    def voice_embeddings(self, voice: str) -> VoiceEmbeddings:
        """A `.pt` voice prompt, loaded and checked once per file."""
        if voice not in self._voice_embeddings:
            self._voice_embeddings[voice] = load_voice_embeddings(
                self.voice_path(voice), self.layout()
            )
        return self._voice_embeddings[voice]

    def prompt_prefix(self, options: Mapping[str, Any]) -> PromptPrefix | None:
        """A `.pt` voice's prefix (None for a `.wav` voice or none): the file's P embeddings,
        then the first frame of silence, its input C's column P embedded; LMGen's cache
        columns after it are C's by absolute position, column P + 1 forced as that frame
        forces it (see the module doc)."""
        voice = options.get("voice")
        if not voice or not self.is_embedded(voice):
            return None
        if voice not in self._prefixes:
            assert self._model is not None, "attach the preset to its model first"
            self._prefixes[voice] = self._build_prefix(self.voice_embeddings(voice))
        return self._prefixes[voice]

    @torch.no_grad()
    def _build_prefix(self, voice: VoiceEmbeddings) -> PromptPrefix:
        assert self._model is not None
        lm = self._model.lm
        dep_q, delays, frames = lm.dep_q, list(lm.delays), voice.frames
        embeddings = voice.embeddings.to(device=lm.device, dtype=lm.dtype)
        read = torch.from_numpy(voice.column(frames)).to(lm.device)[None, :, None]
        embeddings = torch.cat([embeddings, embed_tokens(lm, read)[0]])
        forced = voice.column(frames + 1)
        forced[0] = TEXT_PADDING
        for k in range(1, len(delays)):
            if delays[k] == 0:  # the delayed codebooks keep the voice's last codes
                forced[k] = (
                    self.silence_tokens[k - 1] if k <= dep_q else self.sine_tokens[k - 1 - dep_q]
                )
        columns = {frames + 1: forced}
        for position in range(frames + 2, frames + 2 + max(delays)):
            columns[position] = voice.column(position)  # rewritten before they are read
        return PromptPrefix(embeddings=embeddings, columns=columns)

    def voice_codes(self, voice: str) -> list[tuple[int, ...]]:
        """The voice prompt's Mimi codes per frame, encoded once per file (on the model
        thread: open_slot runs there) by a Mimi of its own, outside the batch's streaming."""
        if voice not in self._voice_codes:
            assert self._model is not None, "attach the preset to its model first"
            path = self.voice_path(voice)
            if self._encoder is None:
                self._encoder = self.checkpoint.load_mimi(self._model.device)
            audio = read_wav(path, self._model.input_sample_rate_hz)
            frame = self._model.frame_samples
            usable = len(audio) // frame * frame
            if usable == 0:
                raise DuplexRuntimeConfigError(
                    "invalid_duplex_runtime_config",
                    f"voice prompt {path.name} is too short",
                    param="voice",
                )
            pcm = torch.from_numpy(audio[:usable]).to(self._model.device)[None, None]
            with torch.no_grad():
                codes = self._encoder.encode(pcm)[0]  # [codebooks, frames]
            self._voice_codes[voice] = [tuple(column) for column in codes.T.tolist()]
        return self._voice_codes[voice]


__all__ = [
    "MAX_PERSONA_TOKENS",
    "SILENCE_TOKENS",
    "SINE_TOKENS",
    "LMLayout",
    "PersonaPlexPreset",
    "VoiceEmbeddings",
    "check_voice_wav",
    "checkpoint_preset",
    "embed_tokens",
    "load_voice_embeddings",
    "read_wav",
    "wrap_with_system_tags",
]
