"""Settings of each process kind, from flags and DUPLEX_* environment variables.

One dataclass per process kind (arq's style): defaults here, overridden by the
environment, overridden by command-line flags. Secrets never appear in repr.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Iterable, Mapping

ENV_PREFIX = "DUPLEX_"
#: how long a closed session's keys stay readable (a late resume gets session_resume_expired)
CLOSED_SESSION_TTL_S = 60.0


def _env(name: str, default: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    return (os.environ if env is None else env).get(ENV_PREFIX + name, default)


MIB = 1024 * 1024

#: what `--log-level` and DUPLEX_LOG_LEVEL accept (any case); INFO when neither is given
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"


class LogLevelError(ValueError):
    """A log level that is not one of LOG_LEVELS (the command line or DUPLEX_LOG_LEVEL)."""


def parse_log_level(text: str, source: str | None = None) -> str:
    """`debug`, `Info`, ... -> the upper-case name; raises `LogLevelError` (naming `source`
    when given: argparse names the flag itself)."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        where = f"{source}: " if source else ""
        raise LogLevelError(
            f"{where}{text.strip()!r} is not one of {', '.join(LOG_LEVELS).lower()}"
        )
    return level


def log_level_from_env(env: Mapping[str, str] | None = None) -> str:
    """Every process kind's log level: DUPLEX_LOG_LEVEL, INFO when unset or blank (a flag
    given on the command line goes over it: services/cli.py)."""
    raw = _env("LOG_LEVEL", env=env)
    if raw is None or not raw.strip():
        return DEFAULT_LOG_LEVEL
    return parse_log_level(raw, "DUPLEX_LOG_LEVEL")


@dataclasses.dataclass(frozen=True)
class SessionPolicy:
    """The deployment's session policy, one for both process kinds (reference-contract.md
    4.4 and 4.5): the API pod applies the grace, the door limit on appends and the output
    queue bounds; the worker the idle TTL, the input budgets and its slots. Each field is
    read from `DUPLEX_<FIELD>` (e.g. `DUPLEX_DISCONNECT_GRACE_S`,
    `DUPLEX_MAX_PENDING_INPUT_BYTES_PER_SESSION`), so pods and workers given the same
    environment (the chart's ConfigMap) apply the same policy. All values > 0, except
    `idle_ttl_s`, which may be None (`none`) to disable idle expiry.

    The plugin ABC knows it as `shared.contracts.SessionRuntimeConfig` (the same class)."""

    idle_ttl_s: float | None = 300.0
    disconnect_grace_s: float = 30.0
    reaper_interval_s: float = 5.0
    resume_replay_ttl_s: float = 60.0
    resume_replay_max_bytes_per_session: int = 8 * MIB
    max_pending_input_bytes_per_session: int = 16 * MIB
    max_pending_turns_per_session: int = 4
    max_sessions: int = 1
    max_pending_output_bytes_per_session: int = 2 * MIB
    max_pending_output_events_per_session: int = 512
    output_reserve_bytes: int = 64 * 1024
    output_reserve_events: int = 8
    server_vad_model_path: str | None = None
    executor_threads: int = 4

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in ("idle_ttl_s", "server_vad_model_path"):
                continue
            if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"session policy: {field.name} must be > 0, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> SessionPolicy:
        values: dict = {}
        for field in dataclasses.fields(cls):
            raw = _env(field.name.upper(), env=env)
            if raw is None:
                continue
            if field.name == "server_vad_model_path":
                values[field.name] = raw or None
            elif field.name == "idle_ttl_s" and raw.strip().lower() in ("", "none", "0"):
                values[field.name] = None
            elif isinstance(field.default, int):
                values[field.name] = int(raw)
            else:
                values[field.name] = float(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclasses.dataclass
class RedisSettings:
    #: None means an embedded fakeredis (only `duplex serve` allows that)
    redis_url: str | None = None
    key_prefix: str = "duplex"
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    #: every process kind: log a WARNING when its event loop lags past this (shared/loop_lag.py)
    loop_lag_warn_s: float = 0.1
    #: replicas that must acknowledge (WAIT) a resume's token rotation and an owner move
    #: before they take effect, so that a failover does not lose them (0: not waited; one
    #: Redis or a Sentinel-managed primary only, not a cluster)
    redis_replica_acks: int = 0
    redis_replica_ack_timeout_ms: int = 500

    def __repr__(self) -> str:
        from shared.redis.connection import redact

        url = redact(self.redis_url) if self.redis_url else None
        return f"{type(self).__name__}(redis_url={url!r}, key_prefix={self.key_prefix!r})"

    @classmethod
    def redis_from_env(cls, env: Mapping[str, str] | None = None) -> dict:
        values: dict = {}
        if (url := _env("REDIS_URL", env=env)) is not None:
            values["redis_url"] = url or None
        if (prefix := _env("KEY_PREFIX", env=env)) is not None:
            values["key_prefix"] = prefix
        if (interval := _env("HEARTBEAT_INTERVAL_S", env=env)) is not None:
            values["heartbeat_interval_s"] = float(interval)
        if (ttl := _env("HEARTBEAT_TTL_S", env=env)) is not None:
            values["heartbeat_ttl_s"] = float(ttl)
        if (lag := _env("LOOP_LAG_WARN_S", env=env)) is not None:
            values["loop_lag_warn_s"] = float(lag)
        if (acks := _env("REDIS_REPLICA_ACKS", env=env)) is not None:
            values["redis_replica_acks"] = int(acks)
        if (timeout := _env("REDIS_REPLICA_ACK_TIMEOUT_MS", env=env)) is not None:
            values["redis_replica_ack_timeout_ms"] = int(timeout)
        if values.get("redis_replica_acks", 0) < 0:
            raise ValueError("DUPLEX_REDIS_REPLICA_ACKS must be 0 or more")
        if values.get("redis_replica_ack_timeout_ms", 1) < 1:
            # WAIT with 0 waits for ever: a replica that is gone would hang every resume
            raise ValueError("DUPLEX_REDIS_REPLICA_ACK_TIMEOUT_MS must be 1 or more")
        return values


@dataclasses.dataclass(repr=False)
class WorkerSettings(RedisSettings):
    plugin: str = "echo"
    worker_id: str = dataclasses.field(default_factory=default_worker_id)
    max_sessions: int = 64
    closed_ttl_s: float = CLOSED_SESSION_TTL_S
    #: /health and /health/ready for probes (0: no health port)
    health_port: int = 0
    #: an LLM for plugins that can use one (assistant): a local model directory for vLLM
    llm_model: str | None = None
    #: the assistant's speech recognition: whisper (default; tiny.en, streams partial
    #: transcripts), or pocketsphinx as sphinx/hybrid, lm or grammar (plugins/assistant)
    assistant_asr: str = "whisper"
    #: SIGTERM: how long a response in flight may run on before it is cancelled and its
    #: session moves to another worker (the chart derives terminationGracePeriodSeconds)
    drain_timeout_s: float = 20.0
    #: a local checkpoint directory for plugins that load one (moshi): their `model_dir`
    model_dir: str | None = None
    #: more plugin options, KEY -> VALUE (`--plugin-option`, DUPLEX_PLUGIN_OPTIONS)
    extra_plugin_options: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the session policy (its max_sessions is this worker's `max_sessions`)
    session: SessionPolicy = dataclasses.field(default_factory=SessionPolicy)

    def session_policy(self) -> SessionPolicy:
        """The policy this worker applies: the deployment's, with this worker's slots."""
        return dataclasses.replace(self.session, max_sessions=self.max_sessions)

    def plugin_options(self) -> dict[str, str]:
        """What `DuplexModelPlugin.from_options` receives."""
        options = {"asr": self.assistant_asr}
        if self.llm_model:
            options["llm_model"] = self.llm_model
        if self.model_dir:
            options["model_dir"] = self.model_dir
        options.update(self.extra_plugin_options)
        return options

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> WorkerSettings:
        values = cls.redis_from_env(env)
        if (plugin := _env("PLUGIN", env=env)) is not None:
            values["plugin"] = plugin
        if (worker_id := _env("WORKER_ID", env=env)) is not None:
            values["worker_id"] = worker_id
        if (max_sessions := _env("MAX_SESSIONS", env=env)) is not None:
            values["max_sessions"] = int(max_sessions)
        if (health_port := _env("WORKER_HEALTH_PORT", env=env)) is not None:
            values["health_port"] = int(health_port)
        if llm_model := _env("LLM_MODEL", env=env):
            values["llm_model"] = llm_model
        if asr := _env("ASSISTANT_ASR", env=env):
            values["assistant_asr"] = asr
        if (drain := _env("DRAIN_TIMEOUT_S", env=env)) is not None:
            values["drain_timeout_s"] = float(drain)
        if model_dir := _env("MODEL_DIR", env=env):
            values["model_dir"] = model_dir
        options = parse_plugin_options(
            (_env("PLUGIN_OPTIONS", env=env) or "").split(","), "DUPLEX_PLUGIN_OPTIONS"
        )
        # the command line's options (`--plugin-option`) are added over the environment's
        options.update(overrides.pop("extra_plugin_options", None) or {})
        values["extra_plugin_options"] = options
        values["session"] = SessionPolicy.from_env(env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class PluginOptionsError(ValueError):
    """A plugin option that is not KEY=VALUE (the command line or DUPLEX_PLUGIN_OPTIONS)."""


def parse_plugin_options(pairs: Iterable[str], source: str = "--plugin-option") -> dict[str, str]:
    """KEY=VALUE strings -> {KEY: VALUE} (blank entries skipped; a later KEY wins). Raises
    `PluginOptionsError` naming `source` for an entry without `=` or with an empty KEY."""
    options: dict[str, str] = {}
    for pair in pairs:
        if not pair.strip():
            continue
        key, equals, value = pair.partition("=")
        key = key.strip()
        if not equals or not key:
            raise PluginOptionsError(f"{source}: {pair.strip()!r} is not KEY=VALUE")
        options[key] = value.strip()
    return options


@dataclasses.dataclass(repr=False)
class ApiSettings(RedisSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    pod_id: str = dataclasses.field(
        default_factory=lambda: f"api-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    )
    api_keys: frozenset[str] = frozenset()
    config_timeout_s: float = 10.0
    open_timeout_s: float = 10.0
    chat_timeout_s: float = 30.0
    drain_timeout_s: float = 20.0
    #: `/api/chat` (Moshi's protocol): how long an upgrade waits for a free slot before its
    #: 429, as the reference servers' conversation lock makes a client wait (a client that
    #: closed its session and reconnects gets the slot back). DUPLEX_ADMISSION_WAIT_S
    admission_wait_s: float = 10.0
    #: Moshi's and GPT-Live's sockets: how long the model may take to open the slot and step
    #: its prompt (a PersonaPlex persona and voice: seconds) before the socket is given up.
    #: DUPLEX_MODEL_READY_TIMEOUT_S
    model_ready_timeout_s: float = 120.0
    #: placement: a worker takes a new session while its load is under ceil((1 + eps) * average)
    placement_epsilon: float = 0.25
    # HTTP limits of a pod that faces the internet (docs/deploy.md, "Limits")
    #: POST /v1/chat/completions bodies past this get 413 (counted while read, never buffered)
    chat_max_body_bytes: int = 1024 * 1024
    #: a new connection (or a kept-alive one between requests) must send a whole request
    #: head within this, or it is closed: idle and slowloris sockets cannot pile up
    header_timeout_s: float = 10.0
    #: an idle kept-alive HTTP connection is closed after this (uvicorn's timeout_keep_alive)
    keep_alive_s: float = 5.0
    #: open connections (HTTP and WebSocket) past which requests and upgrades get 503; 0: none
    limit_concurrency: int = 1000
    #: browser Origins allowed on the WebSockets besides the page's own host; "*": any.
    #: Empty: same-host only without API keys, any with them (the key is the credential).
    allowed_origins: frozenset[str] = frozenset()
    #: how long an append may wait for other sessions' appends to share its inbox entry
    #: (services/api/inbox_writer.py); 0: sent at once. DUPLEX_APPEND_LINGER_MS
    append_linger_ms: float = 10.0
    #: the session policy, the same as the workers' (DUPLEX_DISCONNECT_GRACE_S and the rest)
    session: SessionPolicy = dataclasses.field(default_factory=SessionPolicy)

    def __repr__(self) -> str:
        keys = f"<{len(self.api_keys)} keys>" if self.api_keys else "none"
        redis = super().__repr__()
        return f"ApiSettings(host={self.host!r}, port={self.port}, api_keys={keys}, redis={redis})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> ApiSettings:
        values = cls.redis_from_env(env)
        if keys := _env("API_KEYS", env=env):
            values["api_keys"] = frozenset(k.strip() for k in keys.split(",") if k.strip())
        if (pod := _env("POD_ID", env=env)) is not None:
            values["pod_id"] = pod
        values["session"] = SessionPolicy.from_env(env)
        if (config_timeout := _env("CONFIG_TIMEOUT_S", env=env)) is not None:
            values["config_timeout_s"] = float(config_timeout)
        if (drain := _env("DRAIN_TIMEOUT_S", env=env)) is not None:
            values["drain_timeout_s"] = float(drain)
        if (wait := _env("ADMISSION_WAIT_S", env=env)) is not None:
            values["admission_wait_s"] = float(wait)
        if (ready := _env("MODEL_READY_TIMEOUT_S", env=env)) is not None:
            values["model_ready_timeout_s"] = float(ready)
        if (epsilon := _env("PLACEMENT_EPSILON", env=env)) is not None:
            values["placement_epsilon"] = float(epsilon)
        if (body := _env("CHAT_MAX_BODY_BYTES", env=env)) is not None:
            values["chat_max_body_bytes"] = int(body)
        if (header := _env("HEADER_TIMEOUT_S", env=env)) is not None:
            values["header_timeout_s"] = float(header)
        if (keep_alive := _env("KEEP_ALIVE_S", env=env)) is not None:
            values["keep_alive_s"] = float(keep_alive)
        if (linger := _env("APPEND_LINGER_MS", env=env)) is not None:
            values["append_linger_ms"] = float(linger)
        if (concurrency := _env("LIMIT_CONCURRENCY", env=env)) is not None:
            values["limit_concurrency"] = int(concurrency)
        if (origins := _env("ALLOWED_ORIGINS", env=env)) is not None:
            values["allowed_origins"] = frozenset(
                o.strip().rstrip("/").lower() for o in origins.split(",") if o.strip()
            )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
