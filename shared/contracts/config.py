"""Configuration types shared by the worker, the API and the plugins.

`DuplexSessionConfig` (what one session runs with) is read from the wire by
the codec and re-exported here; `DuplexCapabilities` is what a model can do;
`SessionRuntimeConfig` is the deployment's session policy, the same for API pods and
workers (`shared.settings.SessionPolicy`; reference-contract.md 4.4 and 4.5).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.protocol.duplex import DuplexSessionConfig, ResponseCreateOptions, TurnDetection
from shared.settings import SessionPolicy


@dataclasses.dataclass(frozen=True)
class DuplexCapabilities:
    """What a model plugin supports. Clients branch on these flags, never on the model name.

    Defaults are the reference's conservative defaults; each plugin returns its own.
    """

    supports_session_adapter: bool = True
    supports_model_native_turn_policy: bool = False
    supports_external_turn_signal: bool = True
    supports_client_commit: bool = True
    supports_barge_in: bool = True
    supports_playback_ack: bool = True
    supports_input_append: bool = False
    supports_replace_latest_chunk: bool = True
    supports_reencode_context: bool = True
    supports_rollback_to_checkpoint: bool = False
    supports_turn_commit_only: bool = True
    supports_kv_lease: bool = False
    supports_core_kv_lease: bool = False
    supports_model_internal_state: bool = False
    supports_stage_resumption: bool = False
    supports_scheduler_native_append: bool = False
    supports_core_resumable_request: bool = False
    supports_overlapped_commit: bool = False
    required_input_modalities: tuple[str, ...] = ("audio",)
    optional_input_modalities: tuple[str, ...] = ("video",)
    supports_stage_connector_handoff: bool = False
    supports_independent_io_streams: bool = False
    supports_realtime_endpoint: bool = False
    supports_multi_session: bool = False
    supports_multi_session_same_replica: bool = False
    supports_session_lease: bool = False
    supports_session_resume: bool = False
    session_admission_mode: str = "serving_managed"
    supports_audio_truncate: bool = False
    supports_image_input: bool = False
    supports_text_only_turn: bool = False
    supports_chat_completions: bool = False
    text_turn_priming_units: int = 0
    requires_model_runner_kv: bool = False
    requires_native_stage_role: bool = False
    adapter_patterns: tuple[str, ...] = ("chunk_group_append",)
    signal_sources: tuple[str, ...] = ("client_event", "server_policy", "model_native")
    stage_handoff_transport: str | None = None
    chunk_period_ms: int = 1000
    target_barge_in_latency_ms: int | None = 1000

    @property
    def implementation_level(self) -> str:
        if self.supports_model_native_turn_policy:
            return "model_native_duplex"
        return "turn_based_duplex"

    @property
    def allows_video_without_audio(self) -> bool:
        return "audio" not in self.required_input_modalities

    def to_realtime(self) -> dict[str, Any]:
        """The `capabilities` object of the session object."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        out["implementation_level"] = self.implementation_level
        out["input_modes"] = ["append_audio_chunk"]
        return out


#: the plugin ABC's name for the deployment's session policy: one class, defined with the
#: settings it is read from (`shared.settings.SessionPolicy`)
SessionRuntimeConfig = SessionPolicy


__all__ = [
    "DuplexCapabilities",
    "DuplexSessionConfig",
    "ResponseCreateOptions",
    "SessionRuntimeConfig",
    "TurnDetection",
]
