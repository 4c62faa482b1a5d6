"""Session configuration read from the Realtime session object (contract 4.1-4.3).

`DuplexSessionConfig` is what a session runs with; `TurnDetection` is the
server VAD setting; `ResponseCreateOptions` is one `response.create`. All are
frozen: an update produces a new config, so a runner can compare old and new.

Four surfaces (docs/wire-api.md, Connecting): a session opened on plain `/v1/realtime`
is an "openai" one, with the OpenAI Realtime GA defaults (pcm16 at 24 kHz in and out,
`server_vad`); one opened on `?duplex=1` or `/v1/duplex` is a "duplex" one, with the
contract's. Two more serve native (frame-clocked) models to the clients their users
already run: "moshi" (`/api/chat`, Moshi's binary protocol) and "live" (`/v1/live/sessions`,
OpenAI's GPT-Live protocol), both pcm16 at 24 kHz in and out and without turn detection (the
model takes the turns). The API pod says which by adding `duplex_surface` to the opening
session object; it is read only at open (and from a checkpoint), never from an update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shared.protocol.duplex.turn_detection import (
    SEMANTIC_VAD,
    SEMANTIC_VAD_SILENCE_MS,
    SERVER_VAD,
    TURN_DETECTION_TYPES,
    TurnDetection,
)
from shared.protocol.duplex.turn_detection import number as _number
from shared.protocol.realtime.errors import RealtimeProtocolError
from shared.protocol.realtime.formats import PCM16, WAV, AudioFormat, parse_audio_format
from shared.protocol.realtime.session import (
    InputAudioDefaults,
    read_input_format,
    read_max_tokens,
    read_modalities,
    read_output_format,
    read_speed,
    read_turn_detection,
    read_voice,
)

JSON = dict[str, Any]

LISTEN_ONLY = "listen_only"
BARGE_IN_ON_SPEECH = "barge_in_on_speech"
OVERLAP_POLICIES = (LISTEN_ONLY, BARGE_IN_ON_SPEECH)
COMMIT_ALL_ON_DONE = "commit_all_on_done"
ACK_ONLY = "ack_only"
PLAYBACK_COMMIT_POLICIES = (COMMIT_ALL_ON_DONE, ACK_ONLY)

#: Realtime-only session keys, kept under `extra_body.realtime_<key>` for plugins.
REALTIME_ONLY_KEYS = (
    "tools",
    "tool_choice",
    "metadata",
    "include",
    "prompt",
    "input_audio_transcription",
    "input_audio_noise_reduction",
    "audio",
    "tracing",
    "turn_detection",
    "output_audio_format",
)
#: Per-response keys stored under `extra_body.realtime_response_<key>`.
RESPONSE_PASSTHROUGH_KEYS = ("conversation", "metadata", "prompt", "tools", "tool_choice")
#: Per-response options a model-native session refuses.
NATIVE_UNSUPPORTED_RESPONSE_OPTIONS = (
    "instructions",
    "voice",
    "temperature",
    "max_tokens",
    "tools",
    "tool_choice",
)

#: GA's bound on `max_output_tokens` (an integer 1-4096, or "inf"): held on the openai
#: surface, on what a client sends; the duplex surface takes any positive integer
GA_MAX_OUTPUT_TOKENS = 4096

SURFACE_DUPLEX = "duplex"
SURFACE_OPENAI = "openai"
#: Moshi's binary WebSocket protocol (`/api/chat`; services/api/moshi_chat.py)
SURFACE_MOSHI = "moshi"
#: OpenAI's GPT-Live protocol (`/v1/live/sessions`; services/api/live_sessions.py)
SURFACE_LIVE = "live"
#: OpenBMB's MAP Realtime V1 (`/v1/realtime` with the subprotocol `map.realtime`;
#: services/api/map_realtime.py)
SURFACE_MAP = "map"
SURFACES = (SURFACE_DUPLEX, SURFACE_OPENAI, SURFACE_MOSHI, SURFACE_LIVE, SURFACE_MAP)
#: the surfaces of native (frame-clocked) models only: the worker projects a session's events
#: to what the API pod turns into that protocol (services/worker/engine/native_surfaces.py)
NATIVE_SURFACES = (SURFACE_MOSHI, SURFACE_LIVE, SURFACE_MAP)
#: the key the API pod adds to the opening session object (a client's own is stripped)
SURFACE_KEY = "duplex_surface"


def _config_error(
    message: str, param: str, code: str = "invalid_session_config"
) -> RealtimeProtocolError:
    return RealtimeProtocolError(code, message, param=param)


def _optional_str(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _config_error(f"{param} must be a string", param)
    return value


def _pick(session: Mapping[str, Any], extra: Mapping[str, Any], key: str) -> Any:
    """A key from the session object, falling back to `extra_body` (overlap/playback keys)."""
    return session[key] if key in session else extra.get(key)


def check_max_output_tokens(limit: int | None, param: str, *, openai_surface: bool) -> None:
    """GA's bound on max_output_tokens, on the openai surface only: 1-4096 (or "inf", read
    as None; `read_max_tokens` refused anything below 1). The duplex surface keeps the
    contract's: any positive integer."""
    if openai_surface and limit is not None and limit > GA_MAX_OUTPUT_TOKENS:
        raise _config_error(
            f"max_output_tokens must be an integer from 1 to {GA_MAX_OUTPUT_TOKENS} or 'inf'",
            param,
        )


# ---------------------------------------------------------------- 4.2 turn detection


def _resolve_overlap(
    session: Mapping[str, Any],
    extra: Mapping[str, Any],
    base_td: TurnDetection | None,
    base_policy: str,
    allow_no_interrupt: bool = False,
) -> tuple[TurnDetection | None, str]:
    """Turn detection and the overlap policy it forces (contract 4.2)."""
    declared, value = read_turn_detection(session)
    if declared:
        td = (
            None
            if value is None
            else TurnDetection.from_realtime(value, allow_no_interrupt=allow_no_interrupt)
        )
    else:
        td = base_td
    explicit = _pick(session, extra, "overlap_policy")
    if explicit is not None and explicit not in OVERLAP_POLICIES:
        explicit = LISTEN_ONLY  # unknown values normalise to listen_only
    forced = BARGE_IN_ON_SPEECH if td is not None else LISTEN_ONLY
    if explicit is None:
        return td, forced if declared else base_policy
    if explicit != forced:
        reason = (
            "barge_in_on_speech needs turn_detection (server_vad)"
            if td is None
            else "turn_detection forces overlap_policy=barge_in_on_speech"
        )
        raise _config_error(f"conflicting overlap_policy {explicit!r}: {reason}", "overlap_policy")
    return td, explicit


# ---------------------------------------------------------------- 4.1 session config


@dataclasses.dataclass(frozen=True)
class DuplexSessionConfig:
    """A session's configuration with the contract's defaults (4.1)."""

    model: str | None = None
    modalities: tuple[str, ...] = ("text", "audio")
    instructions: str | None = None
    initial_user_text: str | None = None
    voice: str | None = None
    ref_audio: str | None = None
    response_format: str = WAV
    temperature: float | None = None
    max_tokens: int | None = None
    speed: float | None = None
    use_tts_template: bool = True
    idle_timeout_s: float = 300.0
    overlap_policy: str = LISTEN_ONLY
    overlap_short_ack_ms: int | float = 700
    overlap_barge_in_ms: int | float = 1200
    overlap_silence_rms: float = 0.003
    playback_commit_policy: str = COMMIT_ALL_ON_DONE
    turn_detection: TurnDetection | None = None
    input_audio_format: AudioFormat = AudioFormat(PCM16, 16_000)
    output_audio_format: AudioFormat = AudioFormat(PCM16, None)
    extra_body: JSON = dataclasses.field(default_factory=dict, hash=False)
    #: "duplex" or "openai" (module docstring): fixed at open
    surface: str = SURFACE_DUPLEX

    # -- reading

    @classmethod
    def for_surface(cls, surface: str) -> DuplexSessionConfig:
        """The defaults of a surface: the openai one has OpenAI's (pcm16 at 24 kHz in and
        out, server_vad turn detection, so barge-in on speech)."""
        if surface == SURFACE_DUPLEX:
            return cls()
        if surface in NATIVE_SURFACES:
            # the protocols' own audio: 24 kHz pcm16 both ways (Moshi's Opus is decoded and
            # encoded at the API pod), and the model takes the turns
            return cls(
                surface=surface,
                input_audio_format=AudioFormat(PCM16, 24_000),
                output_audio_format=AudioFormat(PCM16, 24_000),
                response_format="pcm",
            )
        if surface != SURFACE_OPENAI:
            raise _config_error(f"unknown surface {surface!r}", SURFACE_KEY)
        return cls(
            surface=SURFACE_OPENAI,
            input_audio_format=AudioFormat(PCM16, 24_000),
            output_audio_format=AudioFormat(PCM16, 24_000),
            response_format="pcm",
            turn_detection=TurnDetection(),
            overlap_policy=BARGE_IN_ON_SPEECH,
        )

    @classmethod
    def from_realtime(
        cls,
        session: Mapping[str, Any],
        base: DuplexSessionConfig | None = None,
        *,
        client: bool = False,
    ) -> DuplexSessionConfig:
        """`base` (the defaults of the object's `duplex_surface` when None) with a
        session object applied.

        Ids inside the object are ignored (the server allocates them), and so is
        `duplex_surface` when there is a base (an update keeps the surface). Formats
        are checked before turn detection, as the contract orders it. `client`: the
        object is a client's (an open, an update), so GA's bound on max_output_tokens
        holds on the openai surface; a stored object (a checkpoint, perhaps of an older
        version) is never refused on it.
        """
        if not isinstance(session, Mapping):
            raise _config_error("session must be an object", "session")
        if base is None:
            base = cls.for_surface(session.get(SURFACE_KEY) or SURFACE_DUPLEX)
        client_extra = session.get("extra_body")
        client_extra = {} if client_extra is None else client_extra
        if not isinstance(client_extra, Mapping):
            raise _config_error("extra_body must be an object", "extra_body")
        input_format = (
            read_input_format(session, base.input_audio_format) or base.input_audio_format
        )
        output_format = read_output_format(session, base.output_audio_format)
        td, policy = _resolve_overlap(
            session,
            client_extra,
            base.turn_detection,
            base.overlap_policy,
            allow_no_interrupt=base.openai_surface,
        )

        extra = {**base.extra_body, **client_extra}
        for key in REALTIME_ONLY_KEYS:
            if key in session:
                extra[f"realtime_{key}"] = session[key]
        extra["realtime_session_payload"] = {
            k: v
            for k, v in session.items()
            if k not in ("id", "session_id", "extra_body", SURFACE_KEY)
        }
        changes: JSON = {
            "input_audio_format": input_format,
            "turn_detection": td,
            "overlap_policy": policy,
            "extra_body": extra,
        }
        if output_format is not None:
            changes["output_audio_format"] = output_format
            changes["response_format"] = WAV if output_format.encoding == WAV else "pcm"
        if "response_format" in session:
            fmt = parse_audio_format(
                session["response_format"], output=True, param="response_format"
            )
            changes["response_format"] = WAV if fmt.encoding == WAV else "pcm"

        for key in ("model", "instructions"):
            if key in session:
                changes[key] = _optional_str(session[key], key)
        initial = session.get("initial_user_text", client_extra.get("duplex_initial_user_text"))
        if initial is not None:
            changes["initial_user_text"] = _optional_str(initial, "initial_user_text")
        modalities = read_modalities(session)
        if modalities is not None:
            changes["modalities"] = tuple(modalities)
        voice = read_voice(session)
        if voice is not None:
            changes["voice"] = _optional_str(voice, "voice")
        ref_audio = session.get(
            "ref_audio", client_extra.get("ref_audio", client_extra.get("tts_ref_audio"))
        )
        if ref_audio is not None:
            changes["ref_audio"] = _optional_str(ref_audio, "ref_audio")
        if session.get("temperature") is not None:
            changes["temperature"] = float(_number(session["temperature"], "temperature"))
        declared, max_tokens = read_max_tokens(session)
        if declared:
            if client:
                check_max_output_tokens(
                    max_tokens, "max_output_tokens", openai_surface=base.openai_surface
                )
            changes["max_tokens"] = max_tokens
        speed = read_speed(session)
        if speed is not None:
            changes["speed"] = float(_number(speed, "speed", exclusive=True))
        if "use_tts_template" in session:
            if not isinstance(session["use_tts_template"], bool):
                raise _config_error("use_tts_template must be a boolean", "use_tts_template")
            changes["use_tts_template"] = session["use_tts_template"]
        if session.get("idle_timeout_s") is not None:
            changes["idle_timeout_s"] = float(
                _number(session["idle_timeout_s"], "idle_timeout_s", exclusive=True)
            )
        for key in ("overlap_short_ack_ms", "overlap_barge_in_ms"):
            value = _pick(session, client_extra, key)
            if value is not None:
                changes[key] = _number(value, key)
        rms = _pick(session, client_extra, "overlap_silence_rms")
        if rms is not None:
            changes["overlap_silence_rms"] = float(_number(rms, "overlap_silence_rms"))
        commit_policy = _pick(session, client_extra, "playback_commit_policy")
        if commit_policy is not None:
            changes["playback_commit_policy"] = (
                commit_policy if commit_policy in PLAYBACK_COMMIT_POLICIES else COMMIT_ALL_ON_DONE
            )
        return dataclasses.replace(base, **changes)

    def apply_update(self, patch: Mapping[str, Any]) -> DuplexSessionConfig:
        """A live `session.update`: the model and ref_audio cannot change (an echo of
        the same value is fine, since Realtime clients echo the session object)."""
        if isinstance(patch, Mapping):
            model = patch.get("model")
            if model is not None and self.model is not None and model != self.model:
                raise _config_error(
                    "session.update cannot change the model", "model", "model_update_unsupported"
                )
            ref = patch.get("ref_audio")
            if ref is not None and ref != self.ref_audio:
                raise _config_error(
                    "ref_audio cannot change after open",
                    "ref_audio",
                    "ref_audio_update_unsupported",
                )
        return DuplexSessionConfig.from_realtime(patch, base=self, client=True)

    # -- derived

    @property
    def openai_surface(self) -> bool:
        """Opened on plain /v1/realtime: every event is OpenAI GA's (worker `surface.py`)."""
        return self.surface == SURFACE_OPENAI

    @property
    def native_surface(self) -> bool:
        """Opened on `/api/chat`, `/v1/live/sessions` or MAP Realtime's `/v1/realtime`: the
        worker projects its events to those protocols' (services/worker/engine/
        native_surfaces.py)."""
        return self.surface in NATIVE_SURFACES

    @property
    def stamps_seq(self) -> bool:
        """Its events' JSON carries `server_event_seq`: the duplex surface's only (the
        others' protocols have no such field; the seq travels in the live header)."""
        return self.surface == SURFACE_DUPLEX

    @property
    def audio_output(self) -> bool:
        return "audio" in self.modalities

    @property
    def model_native(self) -> bool:
        """Model-native (auto-response) sessions: the model decides when to speak."""
        return self.extra_body.get("auto_response", True) is not False

    @property
    def auto_responds(self) -> bool:
        """Every committed turn gets a response, whatever the commit says: the duplex
        surface with `extra_body.auto_response: true` said explicitly (vLLM-Omni 0.30.0's
        runner; its DuplexClient sends it by default). The model answers the turn."""
        return not self.openai_surface and self.extra_body.get("auto_response") is True

    def input_defaults(self) -> InputAudioDefaults:
        return InputAudioDefaults(
            self.input_audio_format, self.output_audio_format, self.overlap_silence_rms
        )

    # -- rendering

    def to_realtime(self) -> JSON:
        """The configuration part of the session object (both beta and GA spellings)."""
        td = self.turn_detection.to_realtime() if self.turn_detection else None
        output: JSON = {"format": self.output_audio_format.to_ga(), "voice": self.voice}
        if self.speed is not None:
            output["speed"] = self.speed
        client_extra = {k: v for k, v in self.extra_body.items() if not k.startswith("realtime_")}
        # the surface rides along only when it is not the default: a duplex session's
        # object is unchanged, and a checkpoint of an openai one restores as one
        surface = {SURFACE_KEY: self.surface} if self.surface != SURFACE_DUPLEX else {}
        return {
            **surface,
            "object": "realtime.session",
            "type": "realtime",
            "model": self.model,
            "modalities": list(self.modalities),
            "output_modalities": list(self.modalities),
            "instructions": self.instructions,
            "initial_user_text": self.initial_user_text,
            "voice": self.voice,
            "ref_audio": self.ref_audio,
            "response_format": self.response_format,
            "input_audio_format": self.input_audio_format.to_beta(),
            "output_audio_format": self.output_audio_format.to_beta(),
            "audio": {
                "input": {
                    "format": self.input_audio_format.to_ga(),
                    "sample_rate_hz": self.input_audio_format.rate,
                    "turn_detection": td,
                },
                "output": output,
            },
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "speed": self.speed,
            "use_tts_template": self.use_tts_template,
            "idle_timeout_s": self.idle_timeout_s,
            "overlap_policy": self.overlap_policy,
            "overlap_short_ack_ms": self.overlap_short_ack_ms,
            "overlap_barge_in_ms": self.overlap_barge_in_ms,
            "overlap_silence_rms": self.overlap_silence_rms,
            "playback_commit_policy": self.playback_commit_policy,
            "turn_detection": td,
            "input_audio_transcription": self.extra_body.get("realtime_input_audio_transcription"),
            "tracing": self.extra_body.get("realtime_tracing"),
            "extra_body": client_extra,
        }


# ---------------------------------------------------------------- 4.3 response.create options


@dataclasses.dataclass(frozen=True)
class ResponseCreateOptions:
    """One `response.create`'s options. `declared` names what the client set."""

    instructions: str | None = None
    voice: str | None = None
    response_format: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    speed: float | None = None
    modalities: tuple[str, ...] | None = None
    output_audio_format: AudioFormat | None = None
    extra_body: JSON = dataclasses.field(default_factory=dict, hash=False)
    declared: frozenset[str] = frozenset()

    @classmethod
    def from_realtime(
        cls,
        options: Mapping[str, Any],
        *,
        private_keys: frozenset[str] = frozenset(),
        openai_surface: bool = False,
    ) -> ResponseCreateOptions:
        """Read a `response` object; plugin-private keys in `extra_body` are stripped.
        On the openai surface max_output_tokens keeps GA's bound (1-4096 or "inf")."""
        if not isinstance(options, Mapping):
            raise _config_error("response must be an object", "response")
        declared: set[str] = set()
        kwargs: JSON = {}
        if options.get("instructions") is not None:
            kwargs["instructions"] = _optional_str(options["instructions"], "instructions")
            declared.add("instructions")
        voice = read_voice(options)
        if voice is not None:
            kwargs["voice"] = _optional_str(voice, "voice")
            declared.add("voice")
        if options.get("temperature") is not None:
            kwargs["temperature"] = float(_number(options["temperature"], "temperature"))
            declared.add("temperature")
        has_max, max_tokens = read_max_tokens(options)
        if has_max:
            check_max_output_tokens(
                max_tokens, "response.max_output_tokens", openai_surface=openai_surface
            )
            kwargs["max_tokens"] = max_tokens
            declared.add("max_tokens")
        speed = read_speed(options)
        if speed is not None:
            kwargs["speed"] = float(_number(speed, "speed", exclusive=True))
            declared.add("speed")
        modalities = read_modalities(options)
        if modalities is not None:
            kwargs["modalities"] = tuple(modalities)
            declared.add("modalities")
        output_format = read_output_format(options)
        if output_format is not None:
            kwargs["output_audio_format"] = output_format
            kwargs["response_format"] = WAV if output_format.encoding == WAV else "pcm"
            declared.add("output_audio_format")
        extra = options.get("extra_body")
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise _config_error("extra_body must be an object", "extra_body")
        extra = {k: v for k, v in extra.items() if k not in private_keys}
        for key in RESPONSE_PASSTHROUGH_KEYS:
            if options.get(key) is not None:
                extra[f"realtime_response_{key}"] = options[key]
                declared.add(key)
        return cls(extra_body=extra, declared=frozenset(declared), **kwargs)

    def output_modalities(self, config: DuplexSessionConfig) -> tuple[str, ...]:
        """The modalities of this response: its own, else the session's ("audio" in them:
        audio and its transcript; without it: text)."""
        return self.modalities or config.modalities

    def output_token_limit(self, config: DuplexSessionConfig) -> int | None:
        """The max_output_tokens of this response: its own when it set one ("inf": none),
        else the session's. The model plugin gets it on both surfaces (an LLM's own
        limit); the runner cuts a response at it on the openai surface only."""
        return self.max_tokens if "max_tokens" in self.declared else config.max_tokens

    def check_native(self) -> None:
        """Model-native sessions decide these per session, never per response."""
        refused = [key for key in NATIVE_UNSUPPORTED_RESPONSE_OPTIONS if key in self.declared]
        if refused:
            raise RealtimeProtocolError(
                "unsupported_native_response_options",
                f"a model-native session does not take per-response {', '.join(refused)}",
                param=f"response.{refused[0]}",
            )


__all__ = [
    "ACK_ONLY",
    "BARGE_IN_ON_SPEECH",
    "COMMIT_ALL_ON_DONE",
    "GA_MAX_OUTPUT_TOKENS",
    "LISTEN_ONLY",
    "NATIVE_SURFACES",
    "NATIVE_UNSUPPORTED_RESPONSE_OPTIONS",
    "OVERLAP_POLICIES",
    "PLAYBACK_COMMIT_POLICIES",
    "REALTIME_ONLY_KEYS",
    "SEMANTIC_VAD",
    "SEMANTIC_VAD_SILENCE_MS",
    "SERVER_VAD",
    "SURFACES",
    "SURFACE_DUPLEX",
    "SURFACE_KEY",
    "SURFACE_LIVE",
    "SURFACE_MAP",
    "SURFACE_MOSHI",
    "SURFACE_OPENAI",
    "TURN_DETECTION_TYPES",
    "DuplexSessionConfig",
    "InputAudioDefaults",
    "ResponseCreateOptions",
    "TurnDetection",
]
