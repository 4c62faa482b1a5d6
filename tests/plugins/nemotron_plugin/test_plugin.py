"""The Nemotron plugin's contract layer, in the main venv (no torch, no NeMo): its worker
options, its refusals at open and at `session.update` (by the plugin, and through a worker's
SessionManager with a stand-in frame model), and the slot options it prepares."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from harness.frame_models import EchoFrameModel, ManualClock
from plugins.nemotron import NemotronPlugin
from plugins.nemotron.plugin import MAX_TOOLS, read_device
from plugins.nemotron.tools import render_system_prompt
from services.worker.control.manager import SessionManager
from services.worker.plugins import KNOWN_PLUGINS, load_plugin
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import (
    DuplexRuntimeConfigError,
    DuplexSessionConfig,
    DuplexSessionError,
    SessionRuntimeConfig,
)
from shared.contracts.frame_model import FrameClockedPlugin

ROOT = Path(__file__).resolve().parents[3]


def tool(name: str, **extra) -> dict:
    return {"type": "function", "name": name, **extra}


WEATHER = tool(
    "get_weather",
    description="The weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)


@pytest.fixture
def plugin(tmp_path) -> NemotronPlugin:
    return NemotronPlugin.from_options({"model_dir": str(tmp_path)})


def opened(**session) -> DuplexSessionConfig:
    """A session's config as a client's open makes it."""
    return DuplexSessionConfig.from_realtime(session, client=True)


# ---------------------------------------------------------------- options


def test_the_plugin_module_imports_without_torch():
    code = (
        "import sys, plugins.nemotron, services.worker.plugins; "
        "assert 'torch' not in sys.modules and 'nemo' not in sys.modules; "
        "assert 'plugins.nemotron.frame_model' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_it_is_registered_as_nemotron(tmp_path):
    assert KNOWN_PLUGINS["nemotron"] == "plugins.nemotron:NemotronPlugin"
    loaded = load_plugin("nemotron", {"model_dir": str(tmp_path)})
    assert isinstance(loaded, NemotronPlugin) and isinstance(loaded, FrameClockedPlugin)


def test_defaults(plugin, tmp_path):
    assert plugin.plugin_id == "nemotron"
    assert (plugin.input_sample_rate_hz, plugin.output_sample_rate_hz) == (16_000, 22_050)
    assert plugin.model_dir == tmp_path and plugin.device == "cpu" and plugin.threads is None
    assert (plugin.replay_chunk_frames, plugin.max_injected_tokens) == (128, 16)
    capabilities = plugin.capabilities(8)
    assert capabilities.chunk_period_ms == 80 and capabilities.supports_model_native_turn_policy


def test_options_are_read(tmp_path):
    plugin = NemotronPlugin.from_options(
        {
            "model_dir": str(tmp_path),
            "device": "cpu",
            "threads": "3",
            "replay_chunk_frames": "32",
            "max_injected_tokens": "4",
        }
    )
    assert (plugin.threads, plugin.replay_chunk_frames, plugin.max_injected_tokens) == (3, 32, 4)
    assert NemotronPlugin.from_options({"model_dir": str(tmp_path), "threads": "0"}).threads is None


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--model-dir"):
        NemotronPlugin.from_options({})
    with pytest.raises(ValueError, match=r"is not a directory.*never downloaded"):
        NemotronPlugin.from_options({"model_dir": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="is not a directory"):
        NemotronPlugin.from_options({"model_dir": "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B"})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        NemotronPlugin.from_options({"model_dir": str(tmp_path / "file")})
    base = {"model_dir": str(tmp_path)}
    for device in ("tpu", "cuda:", "cuda:x", "gpu0"):
        with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
            NemotronPlugin.from_options({**base, "device": device})
    with pytest.raises(ValueError, match="threads must be an integer"):
        NemotronPlugin.from_options({**base, "threads": "many"})
    with pytest.raises(ValueError, match="threads must be 0 or more"):
        NemotronPlugin.from_options({**base, "threads": "-1"})
    for key in ("replay_chunk_frames", "max_injected_tokens"):
        with pytest.raises(ValueError, match=f"{key} must be 1 or more"):
            NemotronPlugin.from_options({**base, key: "0"})


def test_cuda_needs_a_gpu_torch_sees(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch: no GPU
    assert read_device({}) == "cpu"
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        read_device({"device": "cuda:1"})
    gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", gpu)
    assert read_device({}) == "cuda"
    assert read_device({"device": "cuda:1"}) == "cuda:1"
    assert read_device({"device": "cpu"}) == "cpu"


def test_the_model_is_imported_and_loaded_only_when_built(plugin, monkeypatch, tmp_path):
    loads = []

    class FakeFrameModel:
        @classmethod
        def load(cls, checkpoint_dir, max_sessions, device, threads, **settings):
            loads.append((checkpoint_dir, max_sessions, device, threads, settings))
            return "model"

    module = types.ModuleType("plugins.nemotron.frame_model")
    module.NemotronFrameModel = FakeFrameModel
    monkeypatch.setitem(sys.modules, "plugins.nemotron.frame_model", module)
    assert plugin.frame_model(6) == "model"
    assert loads == [
        (str(tmp_path), 6, "cpu", None, {"replay_chunk_frames": 128, "max_injected_tokens": 16})
    ]


# ---------------------------------------------------------------- refusals at open


def test_auto_response_false_has_nemotrons_own_code(plugin):
    plugin.validate_client_extra_body({})
    plugin.validate_client_extra_body({"auto_response": True})
    with pytest.raises(DuplexRuntimeConfigError) as refused:
        plugin.validate_client_extra_body({"auto_response": False})
    assert refused.value.code == "unsupported_nemotron_duplex_mode"
    assert refused.value.param == "extra_body.auto_response"


def test_at_most_five_tools(plugin):
    five = [tool(f"t{i}") for i in range(MAX_TOOLS)]
    plugin.validate_client_extra_body({"realtime_tools": five})
    with pytest.raises(DuplexRuntimeConfigError) as refused:
        plugin.validate_client_extra_body({"realtime_tools": [*five, tool("t5")]})
    assert refused.value.code == "invalid_tools" and refused.value.param == "tools"
    assert "at most 5" in refused.value.message


def test_malformed_tools_are_refused_as_anywhere(plugin):
    with pytest.raises(DuplexSessionError) as refused:
        plugin.validate_client_extra_body({"realtime_tools": [{"type": "mcp"}]})
    assert refused.value.code == "invalid_tools"


async def test_the_slot_options_are_the_prompt_and_the_tools(plugin):
    config = opened(instructions="Be brief.", tools=[WEATHER])
    options = await plugin.prepare_runtime_config(config)
    assert options == {
        "system_prompt": render_system_prompt("Be brief.", [WEATHER]),
        "tools": [WEATHER],
    }
    assert json.loads(json.dumps(options)) == options  # checkpointed with the session
    assert await plugin.prepare_runtime_config(opened()) == {"system_prompt": "", "tools": []}


# ---------------------------------------------------------------- session.update


async def test_an_update_that_changes_instructions_or_tools_is_refused(plugin):
    config = opened(instructions="Be brief.", tools=[WEATHER])
    options = await plugin.prepare_runtime_config(config)
    for patch, code, param in (
        ({"instructions": "Be a pirate."}, "instructions_update_unsupported", "instructions"),
        ({"instructions": None}, "instructions_update_unsupported", "instructions"),
        ({"tools": []}, "invalid_tools", "tools"),
        ({"tools": [WEATHER, tool("get_time")]}, "invalid_tools", "tools"),
        ({"tools": [{**WEATHER, "description": "other"}]}, "invalid_tools", "tools"),
    ):
        with pytest.raises(DuplexRuntimeConfigError) as refused:
            plugin.runtime_config_for_update(options, config.apply_update(patch))
        assert (refused.value.code, refused.value.param) == (code, param), patch
    assert "fixed when it is created" in refused.value.message


async def test_an_update_that_repeats_them_or_leaves_them_out_is_accepted(plugin):
    config = opened(instructions="Be brief.", tools=[WEATHER])
    options = await plugin.prepare_runtime_config(config)
    stored = json.loads(json.dumps(options))  # as a restored session holds them
    for patch in (
        {},
        {"instructions": "Be brief.", "tools": [WEATHER]},
        {"tools": [{k: v for k, v in WEATHER.items() if k != "type"}]},  # type defaults
        {"voice": "other", "temperature": 0.5},
    ):
        assert plugin.runtime_config_for_update(stored, config.apply_update(patch)) == stored


# ---------------------------------------------------------------- through a worker's manager


class StandInPlugin(NemotronPlugin):
    """NemotronPlugin with a stand-in model: the echo frame model at Nemotron's frame."""

    def frame_model(self, max_sessions: int) -> EchoFrameModel:
        model = EchoFrameModel(max_sessions, frame_samples=1280)
        model.input_sample_rate_hz = self.input_sample_rate_hz
        model.output_sample_rate_hz = self.output_sample_rate_hz
        return model


@pytest.fixture
async def client(tmp_path):
    plugin = StandInPlugin(tmp_path)
    port = TickBatchedStagePort.for_plugin(plugin, plugin.frame_model(2), clock=ManualClock())
    router = InlineEventRouter()
    manager = SessionManager(plugin, SessionRuntimeConfig(max_sessions=2), router, port=port)
    yield InlineDuplexClient(manager, router), manager
    await manager.shutdown()


async def test_a_worker_refuses_the_open_with_the_plugins_codes(client):
    duplex, manager = client
    with pytest.raises(DuplexSessionError) as refused:
        await duplex.open({"extra_body": {"auto_response": False}})
    assert refused.value.code == "unsupported_nemotron_duplex_mode"
    with pytest.raises(DuplexSessionError) as refused:
        await duplex.open({"tools": [tool(f"t{i}") for i in range(6)]})
    assert (refused.value.code, refused.value.param) == ("invalid_tools", "tools")
    assert manager.table.slots_in_use == 0


async def test_a_worker_refuses_an_update_of_instructions_or_tools(client):
    duplex, manager = client
    session = await duplex.open({"instructions": "Be brief.", "tools": [WEATHER]})
    await manager.table.runner(session.session_id).settle_input()
    await session.send({"type": "session.update", "session": {"instructions": "Shout."}})
    error = (await session.until("error"))[-1]
    assert (error.code, error.param) == ("instructions_update_unsupported", "instructions")
    await session.send({"type": "session.update", "session": {"tools": []}})
    error = (await session.until("error"))[-1]
    assert (error.code, error.param) == ("invalid_tools", "tools")
    await session.send(
        {"type": "session.update", "session": {"instructions": "Be brief.", "tools": [WEATHER]}}
    )
    updated = (await session.until("session.updated"))[-1]
    assert updated.session["instructions"] == "Be brief."
