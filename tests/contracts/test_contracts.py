"""Contract types: fences and request ids, runtime config defaults, capabilities, lease."""

import pytest

from services.worker.engine.lease import LeaseState
from shared.contracts import (
    DuplexCapabilities,
    DuplexFence,
    ImageInput,
    SessionRuntimeConfig,
    image_format,
    parse_stage_request_id,
    stage_request_id,
)


def test_stage_request_ids_derive_from_the_fence():
    fence = DuplexFence("duplex-0123abcd", epoch=3, turn_id=9)
    request_id = stage_request_id(fence, "stage0")
    assert request_id == "duplex-s.ZHVwbGV4LTAxMjNhYmNk.e.3.r.stage0"  # urlsafe base64, unpadded
    assert parse_stage_request_id(request_id) == ("duplex-0123abcd", 3, "stage0")
    with pytest.raises(ValueError):
        parse_stage_request_id("other.x.e.1.r.stage0")


def test_runtime_config_defaults_are_the_contracts():
    config = SessionRuntimeConfig()
    assert (config.idle_ttl_s, config.disconnect_grace_s, config.reaper_interval_s) == (
        300.0,
        30.0,
        5.0,
    )
    assert config.max_pending_input_bytes_per_session == 16 * 1024 * 1024
    assert config.max_pending_turns_per_session == 4
    assert config.max_pending_output_bytes_per_session == 2 * 1024 * 1024
    assert config.max_pending_output_events_per_session == 512
    assert (config.output_reserve_bytes, config.output_reserve_events) == (64 * 1024, 8)
    assert config.resume_replay_max_bytes_per_session == 8 * 1024 * 1024
    assert SessionRuntimeConfig(idle_ttl_s=None).idle_ttl_s is None
    for bad in (
        {"max_sessions": 0},
        {"disconnect_grace_s": -1},
        {"max_pending_turns_per_session": 0},
    ):
        with pytest.raises(ValueError):
            SessionRuntimeConfig(**bad)


def test_capabilities_render_for_the_wire():
    wire = DuplexCapabilities(supports_model_native_turn_policy=True).to_realtime()
    assert wire["implementation_level"] == "model_native_duplex"
    assert wire["required_input_modalities"] == ["audio"] and wire["input_modes"] == [
        "append_audio_chunk"
    ]
    assert DuplexCapabilities().to_realtime()["implementation_level"] == "turn_based_duplex"


def test_a_frame_clocked_plugin_offers_video_only_where_its_model_takes_images():
    from harness.frame_models import EchoFramePlugin

    class Seeing(EchoFramePlugin):
        frame_period_ms = 1000
        image_input = ImageInput(max_per_frame=1, max_bytes=1 << 20)

    blind = EchoFramePlugin().capabilities(4)
    assert not blind.supports_image_input and blind.optional_input_modalities == ()
    seeing = Seeing().capabilities(4)
    assert seeing.supports_image_input and seeing.optional_input_modalities == ("video",)
    assert seeing.required_input_modalities == ("audio",)  # never video alone
    assert seeing.chunk_period_ms == 1000
    with pytest.raises(ValueError):
        ImageInput(max_per_frame=0, max_bytes=1)


def test_images_are_told_by_their_first_bytes():
    assert image_format(b"\xff\xd8\xff\xe0rest") == "jpeg"
    assert image_format(b"\x89PNG\r\n\x1a\nrest") == "png"
    assert image_format(b"GIF89a") is None and image_format(b"") is None


def test_the_idle_lease_expires_idle_sessions_only():
    now = [0.0]
    lease = LeaseState(idle_ttl_s=10, clock=lambda: now[0])
    assert lease.generation == 0 and lease.expiry(9.9, busy=False) is None
    assert lease.expiry(10, busy=False) == "idle_ttl_expired"
    assert lease.expiry(10, busy=True) is None  # active operations keep it alive
    lease.touch(5)
    assert lease.expiry(14.9, busy=False) is None and lease.expiry(15, busy=False)
    lease.mark_terminal()
    assert lease.generation == 1 and lease.expiry(1e9, busy=False) is None
    assert LeaseState(idle_ttl_s=None).expiry(1e9, busy=False) is None


#: a seam's members its implementations call on themselves, not the services: each must
#: have a caller in plugins/ (the frame models' shared shape check)
HELPERS = {"FrameModel": {"checked_active"}}


def test_every_hook_of_the_seams_has_a_caller_in_the_services():
    """A hook the worker never calls is a second, dead contract: wire it or remove it. For
    FrameModel (the tick-batched stage's seam) its attributes count too: one the stage never
    reads (`replay_chunk_frames`, `state_record_bytes`) is a promise nobody keeps."""
    import ast
    from pathlib import Path

    from shared.contracts import DuplexModelPlugin, FrameClockedPlugin, FrameModel, StagePort

    root = Path(__file__).resolve().parents[2]

    def attributes(top: str) -> set[str]:
        found: set[str] = set()
        for path in (root / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute):
                    found.add(node.attr)
        return found

    used, in_plugins = attributes("services"), attributes("plugins")
    for seam in (DuplexModelPlugin, StagePort, FrameClockedPlugin, FrameModel):
        hooks = {
            name
            for name, value in vars(seam).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))
        }
        if seam is FrameModel:
            hooks |= set(vars(seam).get("__annotations__", {}))
        helpers = HELPERS.get(seam.__name__, set())
        assert helpers <= hooks and helpers <= in_plugins, f"{seam.__name__}: {helpers}"
        hooks -= helpers
        assert hooks and hooks <= used, f"{seam.__name__}: never called {sorted(hooks - used)}"
