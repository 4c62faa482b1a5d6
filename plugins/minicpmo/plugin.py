"""`MiniCPMOPlugin`: OpenBMB's MiniCPM-o 4.5 in duplex mode as a frame-clocked plugin
(`duplex worker --plugin minicpmo`).

Worker options (strings, from `--model-dir` / `--plugin-option KEY=VALUE`):

- `model_dir` (required): a local MiniCPM-o-4_5 download (`config.json`, the safetensors,
  the tokenizer; `assets/token2wav` for the real vocoder); never downloaded;
- `device`: `cpu`, `cuda` or `cuda:N` (default: cuda when torch sees a GPU);
- `dtype`: `bfloat16` or `float32` (default: bfloat16 on a GPU, float32 on the CPU);
- `threads`: torch CPU threads (default: torch's choice);
- `vocoder`: `token2wav` (Step-Audio2's, a CUDA GPU and `minicpmo-utils` needed) or `tone`
  (a CPU stand-in with the same streaming contract: the words and codes are the model's, the
  sound a tone per code); default token2wav on a GPU, tone on the CPU;
- `voice`: the voice prompt, a wav file (needed by token2wav: its voice comes from it);
- `window_high`, `window_low`: the language model's sliding window in positions (default
  8000 / 6000, vLLM-Omni's): past the high mark after a unit the oldest units go;
- `decode`: `sampling` (the reference's settings) or `greedy` (text argmax and speech-code
  argmax: reproducible runs, the parity tests);
- `replay_chunk_frames`: the most units one replay call feeds a restored slot (default 32).

A session: audio in at 16 kHz (any rate the surface converts), out at 24 kHz, one step per
1 s unit, with at most one camera frame a unit (`video_frames`, JPEG or PNG). The model
decides when it speaks (`auto_response: false` is refused). It makes no tool calls
(MiniCPM-o's duplex mode has none): tools are refused. Its instructions are the system
prompt it read first and cannot change mid-session.

This module imports neither torch nor transformers: the model is imported when a worker
loads it (`frame_model`).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plugins.options import option_choice, option_count, read_device, read_model_dir
from shared.contracts import DuplexRuntimeConfigError, DuplexSessionConfig
from shared.contracts.frame_model import FrameClockedPlugin
from shared.contracts.images import ImageInput
from shared.contracts.tools import read_tools
from shared.errors import CodedError
from shared.protocol.duplex.audio import StreamingResampler, decode_wav, float_to_pcm16

if TYPE_CHECKING:
    from shared.contracts.frame_model import FrameModel

#: the frame model's image input, declared before it is loaded (frame_model.py's)
IMAGE_INPUT = ImageInput(max_per_frame=1, max_bytes=2 * 1024 * 1024)


#: the longest reference voice (the audio encoder's window: 30 s)
MAX_VOICE_SECONDS = 30
VOICE_RATE = 16_000


def _refused_voice(message: str) -> DuplexRuntimeConfigError:
    return DuplexRuntimeConfigError("invalid_duplex_runtime_config", message, param="ref_audio")


def read_reference_voice(ref_audio: str) -> bytes:
    """A session's `ref_audio` (a `data:audio/wav;base64,...` URL: the duplex surface's and
    MAP Realtime's form) as 16 kHz mono pcm16 bytes, at most 30 s; a clear refusal for
    anything else (a remote URI is not fetched: a worker does not reach out to addresses
    a client names)."""
    head, _, payload = ref_audio.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and payload):
        raise _refused_voice("ref_audio must be a base64 WAV data URL (data:audio/wav;base64,...)")
    try:
        samples, rate = decode_wav(base64.b64decode(payload, validate=True))
        resampler = StreamingResampler(rate, VOICE_RATE)
        samples = np.concatenate([resampler.process(samples), resampler.flush()])
    except (binascii.Error, CodedError, ValueError) as exc:
        message = exc.message if isinstance(exc, CodedError) else str(exc)
        raise _refused_voice(f"ref_audio is not a WAV file we can read: {message}") from None
    if not 0 < samples.size <= MAX_VOICE_SECONDS * VOICE_RATE:
        raise _refused_voice(f"ref_audio must hold 0-{MAX_VOICE_SECONDS} s of audio")
    return float_to_pcm16(np.clip(samples, -1.0, 1.0))


class MiniCPMOPlugin(FrameClockedPlugin):
    plugin_id = "minicpmo"
    input_sample_rate_hz = 16_000
    output_sample_rate_hz = 24_000
    frame_period_ms = 1000
    image_input = IMAGE_INPUT

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        vocoder: str = "tone",
        voice: Path | None = None,
        window_high: int = 8000,
        window_low: int = 6000,
        decode: str = "sampling",
        replay_chunk_frames: int = 32,
    ) -> None:
        if not 0 < window_low <= window_high:
            raise ValueError("minicpmo options need 0 < window_low <= window_high")
        if vocoder == "token2wav" and voice is None:
            raise ValueError(
                "minicpmo's token2wav vocoder speaks with a voice prompt: "
                "--plugin-option voice=FILE.wav"
            )
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype
        self.threads = threads
        self.vocoder = vocoder
        self.voice = voice
        self.window_high = window_high
        self.window_low = window_low
        self.decode = decode
        self.replay_chunk_frames = replay_chunk_frames

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MiniCPMOPlugin:
        model_dir = read_model_dir(options, "minicpmo")
        device = read_device(options, "minicpmo")
        on_gpu = device != "cpu"
        voice = options.get("voice")
        return cls(
            model_dir,
            device=device,
            dtype=option_choice(
                options,
                "dtype",
                ("bfloat16", "float32"),
                "bfloat16" if on_gpu else "float32",
                "minicpmo",
            ),
            threads=option_count(options, "threads", 1, "minicpmo"),
            vocoder=option_choice(
                options,
                "vocoder",
                ("token2wav", "tone"),
                "token2wav" if on_gpu else "tone",
                "minicpmo",
            ),
            voice=Path(str(voice)).expanduser() if voice else None,
            window_high=option_count(options, "window_high", 1, "minicpmo") or 8000,
            window_low=option_count(options, "window_low", 1, "minicpmo") or 6000,
            decode=option_choice(options, "decode", ("sampling", "greedy"), "sampling", "minicpmo"),
            replay_chunk_frames=option_count(options, "replay_chunk_frames", 1, "minicpmo") or 32,
        )

    def frame_model(self, max_sessions: int) -> FrameModel:
        """Load the checkpoint and build the model for `max_sessions` slots (imports torch
        and transformers here: the plugin itself needs neither)."""
        import torch

        from plugins.minicpmo.duplex_loop import ContextWindow
        from plugins.minicpmo.engine import EngineSettings
        from plugins.minicpmo.frame_model import MiniCPMOFrameModel
        from plugins.minicpmo.model import MiniCPMOWeights
        from plugins.minicpmo.text_sampling import TextSampling
        from plugins.minicpmo.vocoder import CodecDecoder, Token2wavDecoder, ToneDecoder

        if self.threads:
            torch.set_num_threads(self.threads)
        dtype = torch.bfloat16 if self.dtype == "bfloat16" else torch.float32
        weights = MiniCPMOWeights.load(self.model_dir, dtype=dtype, device=self.device)
        decoder: CodecDecoder
        if self.vocoder == "token2wav":
            assert self.voice is not None
            decoder = Token2wavDecoder(self.model_dir, self.voice)
        else:
            decoder = ToneDecoder()
        greedy = self.decode == "greedy"
        settings = EngineSettings(
            slots=max_sessions,
            window=ContextWindow(high=self.window_high, low=self.window_low),
            sampling=TextSampling(greedy=greedy),
            speech_greedy=greedy,
        )
        return MiniCPMOFrameModel(
            weights, decoder, settings, replay_chunk_frames=self.replay_chunk_frames
        )

    # ------------------------------------------------------------ session policy

    def validate_client_extra_body(self, extra_body: Mapping[str, Any]) -> None:
        super().validate_client_extra_body(extra_body)
        if read_tools(extra_body.get("realtime_tools")):
            raise DuplexRuntimeConfigError(
                "invalid_tools",
                "MiniCPM-o's duplex mode makes no tool calls: a minicpmo session takes no tools",
                param="tools",
            )

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        """The slot's options (JSON-able: checkpointed with the session): its system prompt,
        its seed (each unit's draws come from it, so a restore draws the same), and its
        reference voice (`ref_audio`, a WAV data URL: checked and decoded here, at the
        open, and kept as 16 kHz pcm16 for the model, which feeds it into the system prompt
        as the reference does)."""
        options: dict[str, Any] = {
            "system_prompt": config.instructions or "",
            "seed": secrets.randbits(62),
        }
        if config.ref_audio:
            options["voice"] = base64.b64encode(read_reference_voice(config.ref_audio)).decode()
        return options

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        """The instructions are the prompt the model read first (its memory, rebuilt from
        it on a restore): an update that changes them is refused, one that repeats them
        accepted."""
        if (config.instructions or "") != runtime_config.get("system_prompt", ""):
            raise DuplexRuntimeConfigError(
                "instructions_update_unsupported",
                "a minicpmo session's instructions are fixed when it is created: "
                "session.update cannot change them",
                param="instructions",
            )
        return dict(runtime_config)


__all__ = ["MiniCPMOPlugin"]
