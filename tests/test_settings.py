"""Settings come from DUPLEX_* variables and flags; secrets never show in repr."""

import pytest

from shared.contracts import SessionRuntimeConfig
from shared.redis.connection import redact
from shared.settings import ApiSettings, SessionPolicy, WorkerSettings


def test_api_settings_from_env_and_overrides():
    env = {
        "DUPLEX_REDIS_URL": "redis://user:s3cret@redis:6379/0",
        "DUPLEX_API_KEYS": "k1, k2,,",
        "DUPLEX_HEARTBEAT_TTL_S": "7",
        "DUPLEX_CONFIG_TIMEOUT_S": "2.5",
        "DUPLEX_PLACEMENT_EPSILON": "0.5",
    }
    settings = ApiSettings.from_env(env, port=9000, host=None)
    assert settings.api_keys == frozenset({"k1", "k2"})
    assert (settings.heartbeat_ttl_s, settings.config_timeout_s, settings.placement_epsilon) == (
        7.0,
        2.5,
        0.5,
    )
    assert (settings.port, settings.host) == (9000, "127.0.0.1")  # None overrides keep the default
    shown = repr(settings)
    assert (
        "s3cret" not in shown and "k1" not in shown and "<2 keys>" in shown and "***@redis" in shown
    )


def test_worker_settings_from_env():
    settings = WorkerSettings.from_env(
        {"DUPLEX_PLUGIN": "echo", "DUPLEX_MAX_SESSIONS": "8", "DUPLEX_WORKER_ID": "w9"}
    )
    assert (settings.plugin, settings.max_sessions, settings.worker_id) == ("echo", 8, "w9")
    assert WorkerSettings.from_env({}).redis_url is None  # embedded Redis only for duplex serve


def test_redact():
    assert redact("redis://:pw@host:1/0") == "redis://***@host:1/0"
    assert redact("redis://host:1/0") == "redis://host:1/0"


def test_http_limits_and_origins_from_env():
    defaults = ApiSettings()
    assert (
        defaults.chat_max_body_bytes,
        defaults.header_timeout_s,
        defaults.keep_alive_s,
        defaults.limit_concurrency,
        defaults.allowed_origins,
        defaults.loop_lag_warn_s,
    ) == (1024 * 1024, 10.0, 5.0, 1000, frozenset(), 0.1)
    settings = ApiSettings.from_env(
        {
            "DUPLEX_CHAT_MAX_BODY_BYTES": "65536",
            "DUPLEX_HEADER_TIMEOUT_S": "2.5",
            "DUPLEX_KEEP_ALIVE_S": "3",
            "DUPLEX_LIMIT_CONCURRENCY": "0",
            "DUPLEX_ALLOWED_ORIGINS": " https://App.example.com/ ,, http://localhost:3000",
            "DUPLEX_LOOP_LAG_WARN_S": "0.25",
        }
    )
    assert (settings.chat_max_body_bytes, settings.header_timeout_s, settings.keep_alive_s) == (
        65536,
        2.5,
        3.0,
    )
    assert settings.limit_concurrency == 0  # no limit
    assert settings.allowed_origins == frozenset(
        {"https://app.example.com", "http://localhost:3000"}
    )
    assert settings.loop_lag_warn_s == 0.25
    assert WorkerSettings.from_env({"DUPLEX_LOOP_LAG_WARN_S": "0.5"}).loop_lag_warn_s == 0.5


def test_one_session_policy_for_both_process_kinds():
    """Pods and workers read the same DUPLEX_<FIELD> variables into the same policy."""
    env = {
        "DUPLEX_DISCONNECT_GRACE_S": "12.5",
        "DUPLEX_IDLE_TTL_S": "none",
        "DUPLEX_MAX_PENDING_INPUT_BYTES_PER_SESSION": "4096",
        "DUPLEX_MAX_PENDING_OUTPUT_EVENTS_PER_SESSION": "64",
        "DUPLEX_MAX_SESSIONS": "3",
    }
    api, worker = ApiSettings.from_env(env), WorkerSettings.from_env(env)
    assert api.session == worker.session
    policy = worker.session_policy()
    assert (policy.disconnect_grace_s, policy.idle_ttl_s) == (12.5, None)
    assert policy.max_pending_input_bytes_per_session == 4096
    assert policy.max_pending_output_events_per_session == 64
    assert policy.max_sessions == 3 == worker.max_sessions
    assert SessionRuntimeConfig is SessionPolicy  # the plugin ABC's name for the same class
    assert ApiSettings.from_env({}).session == SessionPolicy()
    with pytest.raises(ValueError, match="disconnect_grace_s"):
        ApiSettings.from_env({"DUPLEX_DISCONNECT_GRACE_S": "0"})


def test_model_dir_and_plugin_options_reach_the_plugin():
    env = {
        "DUPLEX_MODEL_DIR": "/models/moshiko",
        "DUPLEX_PLUGIN_OPTIONS": "preset=moshi, device=cpu,",
    }
    settings = WorkerSettings.from_env(env, extra_plugin_options={"device": "cuda", "x": "a=b"})
    options = settings.plugin_options()
    assert options["model_dir"] == "/models/moshiko"
    # the command line's options go over the environment's; a value may hold "="
    assert (options["preset"], options["device"], options["x"]) == ("moshi", "cuda", "a=b")
    assert "model_dir" not in WorkerSettings.from_env({}).plugin_options()


@pytest.mark.parametrize("bad", ["preset", "=cpu", "preset=moshi,oops"])
def test_a_malformed_plugin_option_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"DUPLEX_PLUGIN_OPTIONS: .* is not KEY=VALUE"):
        WorkerSettings.from_env({"DUPLEX_PLUGIN_OPTIONS": bad})


def test_the_native_surfaces_waits_are_the_api_pods():
    env = {"DUPLEX_ADMISSION_WAIT_S": "2.5", "DUPLEX_MODEL_READY_TIMEOUT_S": "30"}
    settings = ApiSettings.from_env(env)
    assert (settings.admission_wait_s, settings.model_ready_timeout_s) == (2.5, 30.0)
    defaults = ApiSettings.from_env({})
    assert (defaults.admission_wait_s, defaults.model_ready_timeout_s) == (10.0, 120.0)
    WorkerSettings.from_env(env)  # not the worker's: ignored there, never an error


def test_replica_acks_from_env_and_their_bounds():
    import pytest

    settings = WorkerSettings.from_env(
        {"DUPLEX_REDIS_REPLICA_ACKS": "1", "DUPLEX_REDIS_REPLICA_ACK_TIMEOUT_MS": "250"}
    )
    assert (settings.redis_replica_acks, settings.redis_replica_ack_timeout_ms) == (1, 250)
    assert WorkerSettings.from_env({}).redis_replica_acks == 0
    with pytest.raises(ValueError, match="1 or more"):  # WAIT 0 would wait for ever
        WorkerSettings.from_env({"DUPLEX_REDIS_REPLICA_ACK_TIMEOUT_MS": "0"})
    with pytest.raises(ValueError, match="0 or more"):
        WorkerSettings.from_env({"DUPLEX_REDIS_REPLICA_ACKS": "-1"})
