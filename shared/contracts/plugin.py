"""`DuplexModelPlugin`: the one class a model provides.

It merges the three halves of the seed's design:

- session policy: capabilities, validation of client `extra_body`, the
  server-owned runtime config of a session;
- engine policy: which stage requests to submit for a response (turn-based
  models);
- data plane: turning raw stage outputs into what the runner projects
  (audio, text, listen, done).

What the echo model and a vLLM-backed model need is here; the seed's hooks for
sliding windows, input clocks and partial Talker forwarding are not (no plugin
of ours needs them yet).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from shared.contracts.config import (
    DuplexCapabilities,
    DuplexSessionConfig,
    ResponseCreateOptions,
    SessionRuntimeConfig,
)
from shared.contracts.stages import DuplexFence, StageOutput, StagePlan, StagePort
from shared.contracts.tools import ToolChoice, check_session_tools
from shared.errors import CodedError


class DuplexRuntimeConfigError(CodedError):
    """The plugin refused a session's configuration; `code` is a contract error code."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(code, message, param=param)


@dataclasses.dataclass
class CommittedTurn:
    """A committed user turn: its audio at the plugin's input rate, and any text."""

    turn_id: int
    item_id: str
    audio: np.ndarray
    sample_rate_hz: int
    text: str = ""
    transcript: str | None = None  # what the plugin's recogniser heard in `audio`

    @property
    def duration_ms(self) -> int:
        """Whole milliseconds of committed audio."""
        return (len(self.audio) * 1000) // self.sample_rate_hz


@dataclasses.dataclass
class ResponsePlanRequest:
    """What a turn-based plugin needs to plan one response."""

    fence: DuplexFence
    request_id: str
    response_id: str
    turn: CommittedTurn
    config: DuplexSessionConfig
    runtime_config: Mapping[str, Any]
    options: ResponseCreateOptions
    history: Sequence[Mapping[str, Any]]
    #: the function tools this response may call (`response.create`'s, else the session's),
    #: validated (`shared.contracts.tools`), and its `tool_choice`; a plugin without tool
    #: support ignores both. A response planned after a client's `function_call_output`
    #: has an empty `turn` (no audio, no text): its input is the end of `history`. On the
    #: openai surface a `response.create` with no committed audio plans one too: a turn
    #: with no audio whose `text` is what the client's user text items said since the
    #: last response, or "" (nothing: the model speaks first, e.g. a greeting).
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"

    @property
    def audio_output(self) -> bool:
        """Whether the response speaks (its modalities hold "audio"). A text response
        (`output_modalities: ["text"]`) wants words only: the runner drops any audio of
        it, so a plugin should not make any (emit "text" outputs instead of synthesizing)."""
        return "audio" in self.options.output_modalities(self.config)

    @property
    def max_output_tokens(self) -> int | None:
        """The response's max_output_tokens (None: no limit), on both surfaces. On the
        openai surface the runner also cuts the words at the limit and ends the response
        `incomplete` whatever the plugin does (GA); on the duplex surface it is the
        plugin's alone. A plugin with an LLM passes it on as the LLM's own limit."""
        return self.options.output_token_limit(self.config)


class DuplexModelPlugin(abc.ABC):
    """One per model; selected by `duplex worker --plugin <plugin_id>`."""

    plugin_id: ClassVar[str]
    #: input audio is converted to mono float32 at this rate before the plugin sees it
    input_sample_rate_hz: ClassVar[int] = 16_000
    #: the model's native output rate (the session's output format may resample it)
    output_sample_rate_hz: ClassVar[int] = 24_000
    #: roles of the session's stage requests, in pipeline order
    stage_roles: ClassVar[tuple[str, ...]] = ("stage0",)
    #: runtime-config keys the server owns; a client sending them is refused
    private_runtime_config_keys: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DuplexModelPlugin:
        """The plugin built from the worker's options. Strings from the command line
        (`asr`, ...) and, when the worker runs an LLM (`--llm-model`), `text_stage`: a
        `StagePort` taking `TextRequest` payloads (the vLLM stage; plugins never import
        the engine themselves). Plugins without options ignore them."""
        return cls()

    # ------------------------------------------------------------ session policy

    @abc.abstractmethod
    def capabilities(self, max_sessions: int) -> DuplexCapabilities:
        """What this model supports when a worker serves `max_sessions` sessions."""

    def validate_client_extra_body(self, extra_body: Mapping[str, Any]) -> None:
        """Refuse server-owned keys in a client's `extra_body`, and malformed `tools` /
        `tool_choice` (kept there as `realtime_tools` / `realtime_tool_choice`: this hook
        sees every session object, at open and at each update). Overrides call it."""
        check_session_tools(extra_body)
        private = sorted(set(extra_body) & self.private_runtime_config_keys)
        if private:
            raise DuplexRuntimeConfigError(
                "invalid_duplex_runtime_config",
                f"extra_body keys {private} are set by the server",
                param="extra_body",
            )

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        """The server-owned runtime config of a new session (may fetch reference
        audio, resolve voices, ...). Raise `DuplexRuntimeConfigError` to refuse."""
        return {}

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        """The runtime config after an accepted `session.update`."""
        return dict(runtime_config)

    # ------------------------------------------------------------ engine policy

    @abc.abstractmethod
    def create_stage_port(self, runtime: SessionRuntimeConfig) -> StagePort:
        """The stages of this model, shared by every session of one worker."""

    @abc.abstractmethod
    def plan_response(self, request: ResponsePlanRequest) -> StagePlan:
        """The stage submission that produces one response to a committed turn."""

    # ------------------------------------------------------------ data plane

    def project(self, output: StageOutput) -> StageOutput | None:
        """Raw stage output -> what the runner projects (None drops it)."""
        return output

    @property
    def transcribes(self) -> bool:
        """Whether this plugin overrides `transcribe` (the runner calls it at each commit)."""
        return type(self).transcribe is not DuplexModelPlugin.transcribe

    def transcribe(self, audio: np.ndarray, sample_rate_hz: int) -> str | None:
        """Speech recognition of a committed turn's audio (mono float32). Blocking: the
        runner calls it on the executor. The result becomes the item's transcript and a
        `conversation.item.input_audio_transcription.completed` event."""
        return None

    @property
    def transcribes_partials(self) -> bool:
        """Whether the runner should call `transcribe_partial` while the user speaks (False
        unless a plugin overrides `transcribe_partial`; a plugin may also override this to
        say no, e.g. for a recogniser mode with no useful partials)."""
        return type(self).transcribe_partial is not DuplexModelPlugin.transcribe_partial

    def transcribe_partial(self, audio: np.ndarray, sample_rate_hz: int) -> str | None:
        """The best transcript so far of the current uncommitted turn. `audio` is the whole
        turn so far (mono float32 at `input_sample_rate_hz`), not just what is new. Blocking:
        the runner calls it off the event loop (on the executor), at most every ~500 ms of
        new speech and never twice at once for one session. A non-empty result becomes a
        `conversation.item.input_audio_transcription.delta`; None or "" means nothing yet.
        It must be cheap enough to keep up with speech: the final transcript still comes
        from `transcribe` at the commit."""
        return None

    # ------------------------------------------------------------ session moves

    def export_session_state(self, session_id: str) -> dict[str, Any] | None:
        """The plugin's own state of one session that a checkpoint must carry (JSON-able,
        small: it is written with every durable change), or None when the plugin keeps
        none. A session that moves to another worker (drain, failover) gets it back
        through `import_session_state` there. Called on the event loop; must not block."""
        return None

    async def import_session_state(
        self,
        session_id: str,
        state: Mapping[str, Any] | None,
        history: Sequence[Mapping[str, Any]],
    ) -> None:
        """A session restored from a checkpoint on this worker: `state` is what
        `export_session_state` gave on the old worker (None when it gave nothing) and
        `history` the conversation's items (transcripts, no audio) as restored.

        The default rebuilds from history, which for a plugin that builds each response's
        prompt from `ResponsePlanRequest.history` (echo, assistant, the vLLM text stage)
        is nothing to do: the next response is planned from the restored conversation, and
        its prompt is prefilled then (the vLLM stage's prefix cache warms again on that
        first request). A plugin with per-session model state (a KV cache held across
        turns, a streaming recogniser's context) overrides this pair: export it, import
        it, or re-prefill from `history` here. Raise `DuplexRuntimeConfigError` to refuse
        the session (the restore fails and the session is closed with `worker_lost`)."""
        return None

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """`POST /v1/chat/completions` for models with `supports_chat_completions`."""
        raise NotImplementedError(f"{self.plugin_id} does not serve chat completions")


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of the last user message of an OpenAI chat request."""
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


__all__ = [
    "CommittedTurn",
    "DuplexModelPlugin",
    "DuplexRuntimeConfigError",
    "ResponsePlanRequest",
    "last_user_text",
]
