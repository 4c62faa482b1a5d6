"""The FrameModel contract (tests/contracts/frame_model_suite.py) over the tiny Moshi and the
tiny PersonaPlex (MoshiFrameModel on harness/tiny_moshi.py's checkpoint), in .venv-moshi.

Mimi's encoder starts afresh at a restore (its state is in no record), so the codes it makes
of the same audio differ for a few frames after one: as tests/plugins/moshi/test_replay.py does, the
subject gives the LM each conversation's user codes directly (`ScriptedCodes` in place of
Mimi's encoder output; the encoder still runs, on silence), and compares the LM's tokens,
the records, the words and the audio Mimi decodes. PersonaPlex's conversations open with a
`.pt` voice (its embeddings replayed as the slot's prefix, by `replay_work`) and a persona
(prompt frames stepped before the conversation)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from plugins.moshi import MoshiPlugin
from plugins.moshi.frame_model import MoshiFrameModel
from plugins.moshi.personaplex import SILENCE_FRAMES
from plugins.moshi.replay import decode_records
from shared.contracts import FrameModel, FrameOutput
from tests.contracts.frame_model_suite import FrameModelContract, FrameSubject, Observation
from tests.plugins.moshi.conftest import GREEDY
from tests.plugins.moshi.test_personaplex import (
    SILENCE,
    SINE,
    VOICE_FRAMES,
    fork_voice_file,
    write_noise_wav,
)

#: the tiny LM's context (harness/tiny_moshi.py: TINY_LM["context"])
CONTEXT = 100
#: personas of PersonaPlex's conversations (the tiny tokenizer's words), by seed: one word,
#: as "<system> word <system>" is already about 20 tokens of the tiny tokenizer
PERSONAS = ["hello", "good", "tell", "robot"]


class ScriptedCodes:
    """Mimi's encoder output replaced, for the LM: the codes `next` holds for each slot of
    this step (the subject sets them with the slot's frame), zeros for the others."""

    def __init__(self, model: MoshiFrameModel) -> None:
        self.real = model.mimi.encode
        self.next: dict[int, np.ndarray] = {}
        model.mimi.encode = self

    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        real = self.real(audio)  # Mimi's encoder state moves on as it would
        codes = torch.zeros_like(real)
        for slot, row in self.next.items():
            codes[slot, : row.size, 0] = torch.from_numpy(row)
        self.next = {}
        return codes


class MoshiSubject(FrameSubject):
    context_frames = CONTEXT
    #: Mimi decodes a batch: a row's samples move by float rounding (1e-7) with the batch
    atol = 1e-5
    restore_may_differ = {"audio": 10}
    restore_may_differ_why = (
        "Mimi's decoder is not rebuilt by a restore, only warmed on the history's last 4 "
        "frames (DECODER_WARM_FRAMES): its audio is off by up to 1e-3 in the first frame and "
        "1e-5 after, until its transformer's context (20 steps at 25 Hz: 10 frames, tiny "
        "Mimi) holds only frames it decoded itself; the LM's tokens, the records, the words "
        "and speaking are exact from the first frame"
    )

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__()
        self.plugin = MoshiPlugin.from_options(
            {**options, **GREEDY, "replay_chunk_frames": "5", "interrupt_frames": "3"}
        )

    def make(self, slots: int) -> MoshiFrameModel:
        model = self.plugin.frame_model(slots)
        assert isinstance(model, MoshiFrameModel)
        ScriptedCodes(model)
        return model

    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        """Silence to Mimi; the conversation's user codes (its own per seed) to the LM."""
        assert isinstance(model, MoshiFrameModel) and isinstance(model.mimi.encode, ScriptedCodes)
        rng = np.random.default_rng((seed, index))
        model.mimi.encode.next[slot] = rng.integers(0, model.lm.card, size=model.user_codebooks)
        return np.zeros(model.frame_samples, np.float32)

    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        assert isinstance(model, MoshiFrameModel)
        return {
            "record": output.record,
            "tokens": model.last_tokens[slot].copy(),
            "text": output.text,
            "speaking": output.speaking,
            "audio": output.audio,
        }

    def fail_next_step(self, model: FrameModel) -> str:
        """Mimi's decoding raises, once: after the LM stepped every slot."""
        assert isinstance(model, MoshiFrameModel)
        mimi = model.mimi

        def broken(*args: Any, **kwargs: Any) -> None:
            del mimi.decode  # the class's own again
            raise RuntimeError("out of memory")

        mimi.decode = broken
        return "advanced"


class PersonaPlexSubject(MoshiSubject):
    """A `.pt` voice (a prefix of VOICE_FRAMES + 1 frames replayed) and a persona per
    conversation: its first frames are the prompt's (silence, persona, silence)."""

    #: frames before an event: the prompt (6 + the persona's 19-22 tokens + 6 frames), then
    #: at least 12 of the conversation
    frames = 46

    def prompt_frames(self, seed: int) -> int:
        preset = self.plugin.personaplex
        assert preset is not None
        return 2 * SILENCE_FRAMES + len(preset.persona_tokens(self.options(seed)["persona"]))

    def options(self, seed: int) -> dict[str, Any]:
        return {"persona": PERSONAS[seed % len(PERSONAS)], "voice": "MADE.pt"}


@pytest.fixture(scope="module")
def personaplex_dirs(tiny_dir, tmp_path_factory) -> tuple[str, str]:
    """The tiny checkpoint as PersonaPlex (its token constants), and a voice directory with
    MADE.pt, made from a `.wav` voice as NVIDIA's fork makes `.pt` voices."""
    directory = tmp_path_factory.mktemp("contract-personaplex") / "ckpt"
    shutil.copytree(tiny_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["personaplex"] = {"silence_tokens": SILENCE, "sine_tokens": SINE}
    (directory / "config.json").write_text(json.dumps(config))
    voices = tmp_path_factory.mktemp("contract-voices")
    write_noise_wav(voices / "VARIED.wav", VOICE_FRAMES, seed=11)
    plugin = MoshiPlugin.from_options(
        {"model_dir": str(directory), "voice_prompt_dir": str(voices), **GREEDY}
    )
    model = plugin.frame_model(1)
    model.open_slot(0, {"voice": "VARIED.wav"})
    zeros = np.zeros((1, model.frame_samples), np.float32)
    history = b"".join(
        model.step(zeros, np.array([True]))[0].record for _ in range(VOICE_FRAMES + 1)
    )
    made = fork_voice_file(model.lm, decode_records(history, model.lm.num_codebooks)[0])
    torch.save(made, voices / "MADE.pt")
    return str(directory), str(voices)


@pytest.fixture(scope="module", params=["moshi", "personaplex"])
def subject(request, tiny_dir) -> FrameSubject:
    if request.param == "moshi":
        return MoshiSubject({"model_dir": str(tiny_dir)})
    model_dir, voices = request.getfixturevalue("personaplex_dirs")
    plex = PersonaPlexSubject({"model_dir": model_dir, "voice_prompt_dir": voices})
    assert all(plex.prompt_frames(seed) + 12 <= plex.frames for seed in range(len(PERSONAS)))
    return plex


class TestMoshiFrameModel(FrameModelContract):
    """The tiny Moshi and PersonaPlex under the contract."""
