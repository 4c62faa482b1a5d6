"""The MiniCPM-o plugin's contract layer, in the main venv (no torch, no transformers): its
worker options and their refusals, its capabilities (1 s units, camera frames), and its
session policy (tools refused, instructions fixed, a seed per session)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plugins.minicpmo import MiniCPMOPlugin
from services.worker.plugins import KNOWN_PLUGINS, load_plugin
from shared.contracts import DuplexRuntimeConfigError, DuplexSessionConfig
from shared.contracts.frame_model import FrameClockedPlugin
from shared.protocol.duplex.audio import encode_wav

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def plugin(tmp_path) -> MiniCPMOPlugin:
    return MiniCPMOPlugin.from_options({"model_dir": str(tmp_path)})


def opened(**session) -> DuplexSessionConfig:
    return DuplexSessionConfig.from_realtime(session, client=True)


def test_the_plugin_module_imports_without_torch():
    code = (
        "import sys, plugins.minicpmo, services.worker.plugins; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_it_is_a_known_frame_clocked_plugin_with_cpu_defaults(tmp_path):
    assert KNOWN_PLUGINS["minicpmo"] == "plugins.minicpmo:MiniCPMOPlugin"
    plugin = load_plugin("minicpmo", {"model_dir": str(tmp_path)}, 4)
    assert isinstance(plugin, FrameClockedPlugin)
    # no GPU here: float32 and the tone stand-in for the CUDA-only vocoder
    assert (plugin.device, plugin.dtype, plugin.vocoder) == ("cpu", "float32", "tone")
    assert (plugin.window_high, plugin.window_low, plugin.decode) == (8000, 6000, "sampling")


def test_capabilities_say_1_s_units_and_camera_frames(plugin):
    caps = plugin.capabilities(4)
    assert caps.chunk_period_ms == 1000
    assert caps.supports_image_input and "video" in caps.optional_input_modalities
    assert caps.supports_model_native_turn_policy and caps.supports_barge_in


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"model_dir": ""}, "needs a checkpoint directory"),
        ({"model_dir": "/nonexistent/minicpmo"}, "is not a directory"),
        ({"device": "cuda"}, "torch sees no CUDA device"),
        ({"device": "tpu"}, "must be cpu, cuda or cuda:N"),
        ({"dtype": "float16"}, "dtype must be one of bfloat16, float32"),
        ({"vocoder": "hifigan"}, "vocoder must be one of token2wav, tone"),
        ({"vocoder": "token2wav"}, "voice prompt"),
        ({"decode": "beam"}, "decode must be one of sampling, greedy"),
        ({"window_high": "100", "window_low": "200"}, "window_low <= window_high"),
        ({"window_high": "lots"}, "window_high must be an integer"),
        ({"replay_chunk_frames": "0"}, "replay_chunk_frames must be 1 or more"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(tmp_path, options, message):
    base = {"model_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=message):
        MiniCPMOPlugin.from_options({**base, **options})


def test_tools_are_refused(plugin):
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    with pytest.raises(DuplexRuntimeConfigError) as refused:
        plugin.validate_client_extra_body({"realtime_tools": tools})
    assert refused.value.code == "invalid_tools"
    plugin.validate_client_extra_body({})


async def test_each_session_gets_its_prompt_and_a_seed_of_its_own(plugin):
    first = await plugin.prepare_runtime_config(opened(instructions="Be brief."))
    second = await plugin.prepare_runtime_config(opened(instructions="Be brief."))
    assert first["system_prompt"] == "Be brief."
    assert isinstance(first["seed"], int) and first["seed"] != second["seed"]


async def test_instructions_are_fixed_once_the_session_is_created(plugin):
    runtime = await plugin.prepare_runtime_config(opened(instructions="Be brief."))
    assert plugin.runtime_config_for_update(runtime, opened(instructions="Be brief.")) == runtime
    with pytest.raises(DuplexRuntimeConfigError) as refused:
        plugin.runtime_config_for_update(runtime, opened(instructions="Be long."))
    assert refused.value.code == "instructions_update_unsupported"


def wav_url(seconds: float, rate: int) -> str:
    samples = 0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate)
    return "data:audio/wav;base64," + base64.b64encode(encode_wav(samples, rate)).decode()


async def test_a_reference_voice_is_read_at_the_open_as_16_khz_pcm16(plugin):
    options = await plugin.prepare_runtime_config(
        opened(instructions="x", ref_audio=wav_url(1.5, 24_000))
    )
    voice = np.frombuffer(base64.b64decode(options["voice"]), "<i2")
    assert abs(voice.size - 24_000) <= 8  # 1.5 s at 16 kHz, whatever rate it came at
    assert "voice" not in await plugin.prepare_runtime_config(opened(instructions="x"))


@pytest.mark.parametrize(
    ("ref_audio", "message"),
    [
        ("https://example.com/voice.wav", "base64 WAV data URL"),
        ("data:audio/wav;base64,AAAA", "not a WAV file"),
        ("data:audio/wav;base64,!!", "not a WAV file"),
        (wav_url(31, 16_000), "0-30 s"),
    ],
)
async def test_a_reference_voice_we_cannot_use_is_refused_naming_it(plugin, ref_audio, message):
    with pytest.raises(DuplexRuntimeConfigError, match=message) as refused:
        await plugin.prepare_runtime_config(opened(instructions="x", ref_audio=ref_audio))
    assert refused.value.code == "invalid_duplex_runtime_config"
    assert refused.value.param == "ref_audio"
