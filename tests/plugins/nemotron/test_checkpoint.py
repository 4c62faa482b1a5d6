"""Loading a checkpoint directory (plugins/nemotron/checkpoint.py): the published layout,
local paths only, and a clear error for whatever is missing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from harness.tiny_nemotron import LLM_DIRNAME, SPEAKER_FILE
from plugins.nemotron import NemotronPlugin
from plugins.nemotron.checkpoint import FUNCTION_HEAD, CheckpointError, NemotronCheckpoint


@pytest.fixture
def copy(tiny_dir, tmp_path):
    """A copy of the tiny checkpoint to break."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, target)
    return target


def rewrite(directory, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_the_tiny_checkpoint_loads_with_its_function_head_and_voice(voicechat, tiny_dir):
    checkpoint = NemotronCheckpoint.inspect(tiny_dir)
    stt = checkpoint.config["model"]["stt"]["model"]
    assert stt["pretrained_llm"] == str(tiny_dir / LLM_DIRNAME)  # resolved, local
    assert stt["pretrained_weights"] is False
    head = voicechat.stt_model.function_head
    assert isinstance(head, torch.nn.Linear)
    # its weights came from model.safetensors (the tiny head says pad, loudly)
    assert float(head.bias[voicechat.stt_model.text_pad_id]) == 10.0
    assert checkpoint.speaker_audio(22050).shape == (1, 22050)
    assert FUNCTION_HEAD == "stt_model.function_head"


def test_a_hub_id_resolves_to_a_directory_named_as_its_last_part(copy):
    rewrite(
        copy, lambda c: c["model"]["stt"]["model"].update(pretrained_llm=f"nvidia/{LLM_DIRNAME}")
    )
    assert NemotronCheckpoint.inspect(copy).config["model"]["stt"]["model"][
        "pretrained_llm"
    ] == str(copy / LLM_DIRNAME)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "config.json").write_text("{"), "not readable JSON"),
        (lambda d: rewrite(d, lambda c: c.pop("data")), "not a NemotronVoiceChat config"),
        (lambda d: shutil.rmtree(d / LLM_DIRNAME), "nothing is downloaded"),
        (lambda d: (d / SPEAKER_FILE).unlink(), "inference_speaker_reference"),
        (
            lambda d: rewrite(d, lambda c: c["model"].pop("inference_speaker_reference")),
            "names no voice",
        ),
    ],
    ids=["weights", "config", "json", "data", "llm", "voice-file", "no-voice"],
)
def test_what_is_missing_is_said(copy, breakage, message):
    breakage(copy)
    with pytest.raises(CheckpointError, match=message):
        NemotronCheckpoint.inspect(copy)


def test_a_directory_that_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        NemotronCheckpoint.inspect(tmp_path / "nope")


def test_the_worker_fails_at_start_on_a_broken_checkpoint(copy):
    (copy / "model.safetensors").unlink()
    plugin = NemotronPlugin.from_options({"model_dir": str(copy), "device": "cpu"})
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        plugin.frame_model(1)
