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

Voice prompts: a `.wav` (the fork's `load_voice_prompt`) is supported: Mimi-encoded once per
file, its frames forced as the model's audio with text padding. The fork normalizes it to
-24 LUFS; we scale it to -24 dBFS RMS (no K-weighting: a little louder or softer than the
fork for the same file). The `.pt` voice prompts NVIDIA distributes (voices.tgz: NATF0..3,
NATM0..3, VARF0..4, VARM0..4) hold LM input embeddings and the fork's token cache, replayed
by the fork's `LMGen.step_embeddings` / `LMModel.forward_embeddings`, which 0.2.13 lacks:
they are refused with that reason. Config.json key `"personaplex"` (ours) may override the
token constants (`silence_tokens`, `sine_tokens`: the tiny test model's codebooks are small).
"""

from __future__ import annotations

import contextlib
import wave
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plugins.moshi.checkpoint import CheckpointError, MoshiCheckpoint
from plugins.moshi.frame_model import MoshiFrameModel, PromptFrame
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
                if path.suffix == ".pt":
                    raise DuplexRuntimeConfigError(
                        "invalid_duplex_runtime_config",
                        f"voice {voice!r} is a .pt voice prompt (LM input embeddings replayed "
                        "by NVIDIA's moshi fork, LMGen.step_embeddings), which kyutai's moshi "
                        "0.2.13 cannot replay: give a .wav voice prompt",
                        param="voice",
                    )
                return path
        raise DuplexRuntimeConfigError(
            "invalid_duplex_runtime_config",
            f"voice {voice!r}: no {voice}.wav in the voice prompt directory",
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
        model.prompt_builder = self.prompt_frames

    def prompt_frames(self, options: Mapping[str, Any]) -> list[PromptFrame]:
        """Voice prompt, silence, persona, silence (the fork's `step_system_prompts`)."""
        sine, silence = self.sine_tokens, self.silence_tokens
        frames: list[PromptFrame] = []
        if options.get("voice"):
            for codes in self.voice_codes(options["voice"]):
                frames.append(PromptFrame(sine, TEXT_PADDING, codes))
        frames += [PromptFrame(sine, TEXT_PADDING, silence)] * SILENCE_FRAMES
        persona = self.persona_tokens(options.get("persona"))
        if persona:
            frames += [PromptFrame(sine, token, silence) for token in persona]
            frames += [PromptFrame(sine, TEXT_PADDING, silence)] * SILENCE_FRAMES
        return frames

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
    "PersonaPlexPreset",
    "check_voice_wav",
    "checkpoint_preset",
    "read_wav",
    "wrap_with_system_tags",
]
