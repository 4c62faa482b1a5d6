"""Checkpoint loading (clear errors, never a download) and the plugin's options and policy."""

import json
import shutil

import pytest
from moshi.models import loaders

from plugins.moshi import CheckpointError, MoshiCheckpoint, MoshiPlugin
from shared.contracts import DuplexRuntimeConfigError, DuplexSessionConfig
from tests.plugins.moshi.conftest import GREEDY


@pytest.fixture
def copy_dir(tiny_dir, tmp_path):
    def copy():
        target = tmp_path / "ckpt"
        shutil.copytree(tiny_dir, target)
        return target

    return copy


def test_the_tiny_checkpoint_loads_through_moshis_loaders(tiny_dir):
    checkpoint = MoshiCheckpoint.open(tiny_dir)
    assert checkpoint.info.moshi_weights == tiny_dir / loaders.MOSHI_NAME
    assert checkpoint.info.lm_config["dim"] == 32
    assert "mimi" not in checkpoint.info.lm_config  # our key is not an LMModel kwarg
    mimi = checkpoint.load_mimi("cpu")
    # the "mimi" overrides were applied to moshi's defaults, and the weights loaded
    assert mimi.encoder_transformer.transformer.layers.__len__() == 1
    assert mimi.num_codebooks == 2 and mimi.frame_size == 1920


@pytest.mark.parametrize(
    "name, role",
    [
        (loaders.MOSHI_NAME, "the LM weights"),
        (loaders.MIMI_NAME, "the Mimi weights"),
        (loaders.TEXT_TOKENIZER_NAME, "the text tokenizer"),
    ],
)
def test_a_missing_file_is_named(copy_dir, name, role):
    directory = copy_dir()
    (directory / name).unlink()
    with pytest.raises(CheckpointError, match=f"lacks {name} \\({role}\\)"):
        MoshiCheckpoint.open(directory)


def test_bad_directories_and_configs_are_clear_errors(copy_dir, tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        MoshiCheckpoint.open(tmp_path / "nowhere")
    directory = copy_dir()
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: unreadable config"):
        MoshiCheckpoint.open(directory)
    config = {"model_type": "hibiki", "dim": 32}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type 'hibiki'"):
        MoshiCheckpoint.open(directory)
    (directory / "config.json").write_text(json.dumps({"moshi_name": "../elsewhere.safetensors"}))
    with pytest.raises(CheckpointError, match="moshi_name must be a file name"):
        MoshiCheckpoint.open(directory)


def test_weights_that_do_not_match_the_config_are_a_clear_error(copy_dir):
    directory = copy_dir()
    config = json.loads((directory / "config.json").read_text())
    config["dim"] = 48
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match the LM config"):
        MoshiCheckpoint.open(directory).load_lm("cpu", None)


def test_a_config_without_lm_kwargs_means_moshi_7b(copy_dir):
    """PersonaPlex's config.json is empty: moshi's 7B defaults, not LMModel()'s."""
    directory = copy_dir()
    (directory / "config.json").write_text("{}")
    checkpoint = MoshiCheckpoint.open(directory)
    assert checkpoint.info.lm_config is None


def test_plugin_options_are_validated(tiny_dir):
    with pytest.raises(ValueError, match="--model-dir"):
        MoshiPlugin.from_options({})
    base = {"model_dir": str(tiny_dir), **GREEDY}
    with pytest.raises(ValueError, match="device must be"):
        MoshiPlugin.from_options({**base, "device": "tpu"})
    with pytest.raises(ValueError, match="temperature must be a float"):
        MoshiPlugin.from_options({**base, "temperature": "hot"})
    with pytest.raises(ValueError, match="top_k must be 0 or more"):
        MoshiPlugin.from_options({**base, "top_k": "-1"})
    with pytest.raises(ValueError, match="preset must be one of"):
        MoshiPlugin.from_options({**base, "preset": "minicpm"})
    with pytest.raises(CheckpointError, match="lacks"):
        MoshiPlugin.from_options({**base, "model_dir": str(tiny_dir.parent)})
    plugin = MoshiPlugin.from_options({**base, "top_k": "5"})
    assert plugin.preset == "moshi" and plugin.device == "cpu"
    assert plugin.sampling.greedy and plugin.sampling.top_k == 5


async def test_plugin_policy(tiny_dir):
    plugin = MoshiPlugin.from_options({"model_dir": str(tiny_dir), **GREEDY})
    capabilities = plugin.capabilities(8)
    assert capabilities.supports_model_native_turn_policy
    assert capabilities.supports_barge_in and capabilities.supports_session_resume
    assert capabilities.chunk_period_ms == 80
    assert not capabilities.supports_chat_completions
    assert not capabilities.supports_text_only_turn and not capabilities.supports_audio_truncate
    plugin.validate_client_extra_body({})
    with pytest.raises(DuplexRuntimeConfigError) as refused:
        plugin.validate_client_extra_body({"auto_response": False})
    assert refused.value.code == "invalid_duplex_runtime_config"
    # Moshi has no persona or voice prompt: the runtime config is empty whatever is asked
    config = DuplexSessionConfig(instructions="be a pirate", voice="NATF2")
    assert await plugin.prepare_runtime_config(config) == {}
    model = plugin.frame_model(2)
    assert model.slots == 2 and model.frame_ms == 80
    assert model.input_sample_rate_hz == plugin.input_sample_rate_hz == 24_000
