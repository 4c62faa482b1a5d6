"""`NemotronPlugin`: NVIDIA's Nemotron VoiceChat as a frame-clocked plugin
(`duplex worker --plugin nemotron`).

Worker options (strings, from `--model-dir` / `--plugin-option KEY=VALUE`):

- `model_dir` (required): a local checkpoint directory (plugins/nemotron/checkpoint.py); it
  must exist when the worker starts, and is never downloaded;
- `device`: `cpu`, `cuda` or `cuda:N` (default: cuda when torch sees a GPU);
- `threads`: torch CPU threads (default: the model's choice);
- `replay_chunk_frames`: the most frames of a restored session's history one replay call
  replays, in one forward of each part (default 128): the stage asks for as many as the
  tick's spare time holds, this many at most, so a restore spreads over as many ticks as it
  needs (a prompt is one forward);
- `max_injected_tokens`: tokens of a tool's result fed to the model per frame (default 16;
  a long result is fed over several frames while the model goes on listening).

Input is 16 kHz, output 22.05 kHz, one step per 80 ms frame. The model decides when it
speaks: `extra_body.auto_response: false` is refused (`unsupported_nemotron_duplex_mode`).
A session declares at most 5 tools (NVIDIA's advice for this model), and its instructions
and tools are fixed when it opens: they are the prompt the model read first, which a
`session.update` cannot change (`instructions_update_unsupported`, `invalid_tools`; the
same values echoed back are accepted). The prompt and the tool-call format are tools.py's.

This module imports neither torch nor NeMo: the model (plugins/nemotron/frame_model.py) is
imported when a worker builds it (`frame_model`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugins.nemotron.defaults import MAX_INJECTED_TOKENS, REPLAY_CHUNK_FRAMES
from plugins.nemotron.tools import render_system_prompt
from plugins.options import option_count
from plugins.options import read_device as options_device
from plugins.options import read_model_dir as options_model_dir
from shared.contracts import DuplexRuntimeConfigError, DuplexSessionConfig
from shared.contracts.frame_model import FrameClockedPlugin
from shared.contracts.tools import read_tools

if TYPE_CHECKING:  # the model needs torch and NeMo: imported where it is loaded
    from plugins.nemotron.frame_model import NemotronFrameModel
    from shared.contracts.frame_model import FrameModel

#: the most tools one session may declare (NVIDIA: the model is reliable with up to 5)
MAX_TOOLS = 5


def _count(options: Mapping[str, Any], key: str, minimum: int) -> int | None:
    return option_count(options, key, minimum, "nemotron")


def read_device(options: Mapping[str, Any]) -> str:
    """`device`: cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)."""
    return options_device(options, "nemotron")


def read_model_dir(options: Mapping[str, Any]) -> Path:
    """`model_dir`: an existing local directory (a checkpoint is never downloaded)."""
    return options_model_dir(options, "nemotron")


def session_tools(config: DuplexSessionConfig) -> list[dict[str, Any]]:
    """The session's declared function tools, validated (`shared.contracts.tools` shape)."""
    return [dict(tool) for tool in read_tools(config.extra_body.get("realtime_tools"))]


class NemotronPlugin(FrameClockedPlugin):
    plugin_id = "nemotron"
    input_sample_rate_hz = 16_000
    output_sample_rate_hz = 22_050
    frame_period_ms = 80

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        threads: int | None = None,
        replay_chunk_frames: int = REPLAY_CHUNK_FRAMES,
        max_injected_tokens: int = MAX_INJECTED_TOKENS,
    ) -> None:
        if replay_chunk_frames < 1:
            raise ValueError("nemotron option replay_chunk_frames must be at least 1")
        if max_injected_tokens < 1:
            raise ValueError("nemotron option max_injected_tokens must be at least 1")
        self.model_dir = model_dir
        self.device = device
        self.threads = threads
        self.replay_chunk_frames = replay_chunk_frames
        self.max_injected_tokens = max_injected_tokens

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> NemotronPlugin:
        return cls(
            read_model_dir(options),
            device=read_device(options),
            threads=_count(options, "threads", 0) or None,  # 0: the model's choice
            replay_chunk_frames=_count(options, "replay_chunk_frames", 1) or REPLAY_CHUNK_FRAMES,
            max_injected_tokens=_count(options, "max_injected_tokens", 1) or MAX_INJECTED_TOKENS,
        )

    def frame_model_class(self) -> type[NemotronFrameModel]:
        """The model class `frame_model` loads (imported here: it needs torch and NeMo,
        which the plugin itself does not)."""
        from plugins.nemotron.frame_model import NemotronFrameModel

        return NemotronFrameModel

    def frame_model(self, max_sessions: int) -> FrameModel:
        return self.frame_model_class().load(
            str(self.model_dir),
            max_sessions,
            self.device,
            self.threads,
            replay_chunk_frames=self.replay_chunk_frames,
            max_injected_tokens=self.max_injected_tokens,
        )

    # ------------------------------------------------------------ session policy

    def validate_client_extra_body(self, extra_body: Mapping[str, Any]) -> None:
        """Nemotron's own refusals: `auto_response: false` (its code, not the base class's:
        the seed's contract), and more than MAX_TOOLS tools; then the base's checks."""
        if extra_body.get("auto_response", True) is False:
            raise DuplexRuntimeConfigError(
                "unsupported_nemotron_duplex_mode",
                "Nemotron VoiceChat is full-duplex: it decides itself when it speaks, so "
                "extra_body.auto_response must be true",
                param="extra_body.auto_response",
            )
        super().validate_client_extra_body(extra_body)
        tools = read_tools(extra_body.get("realtime_tools"))
        if len(tools) > MAX_TOOLS:
            raise DuplexRuntimeConfigError(
                "invalid_tools",
                f"a nemotron session declares at most {MAX_TOOLS} tools ({len(tools)} given)",
                param="tools",
            )

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        """The slot's options (JSON-able: checkpointed with the session): the prompt the
        model reads first (instructions and tool declarations) and the session's tools."""
        tools = session_tools(config)
        return {
            "system_prompt": render_system_prompt(config.instructions or "", tools),
            "tools": tools,
        }

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        """Instructions and tools are the prompt the model read when the session opened (its
        memory, which moves with the session, is rebuilt from it): a `session.update` that
        changes either is refused, one that repeats them is accepted."""
        tools = session_tools(config)
        if tools != list(runtime_config.get("tools") or []):
            raise DuplexRuntimeConfigError(
                "invalid_tools",
                "a nemotron session's tools are fixed when it is created: session.update "
                "cannot change them",
                param="tools",
            )
        prompt = render_system_prompt(config.instructions or "", tools)
        if prompt != runtime_config.get("system_prompt"):
            raise DuplexRuntimeConfigError(
                "instructions_update_unsupported",
                "a nemotron session's instructions are fixed when it is created: "
                "session.update cannot change them",
                param="instructions",
            )
        return dict(runtime_config)


__all__ = ["MAX_TOOLS", "NemotronPlugin", "read_device", "read_model_dir", "session_tools"]
