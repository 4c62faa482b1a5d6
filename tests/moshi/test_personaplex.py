"""The PersonaPlex preset on the tiny model: persona and voice validation, the prompt stepped
before the conversation (forced tokens, one frame per tick), per slot and reset with it."""

import json
import shutil
import wave

import numpy as np
import pytest

from plugins.moshi import MoshiPlugin
from plugins.moshi.personaplex import SILENCE_FRAMES, checkpoint_preset, wrap_with_system_tags
from services.worker.session.manager import SessionManager
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import (
    DuplexRuntimeConfigError,
    DuplexSessionConfig,
    DuplexSessionError,
    SessionRuntimeConfig,
)
from tests.moshi.conftest import GREEDY, user_audio
from tests.moshi.test_frame_model import alone, run
from tests.worker.session_parts import LoudnessVad

SILENCE = [5, 6]
SINE = [7, 8]
PERSONA = "You are a wise and friendly teacher."


def write_wav(path, seconds: float, rate: int = 16_000) -> None:
    samples = (
        0.3 * np.sin(np.arange(int(seconds * rate)) * 2 * np.pi * 220 / rate) * 32767
    ).astype("<i2")
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.tobytes())


@pytest.fixture(scope="module")
def plex_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with PersonaPlex's voices/ and token constants that fit it."""
    directory = tmp_path_factory.mktemp("tiny-personaplex") / "ckpt"
    shutil.copytree(tiny_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["personaplex"] = {"silence_tokens": SILENCE, "sine_tokens": SINE}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "voices").mkdir()
    write_wav(directory / "voices" / "TINYF0.wav", 0.48)  # 6 frames at 24 kHz
    (directory / "voices" / "NATF2.pt").write_bytes(b"embeddings of NVIDIA's fork")
    write_wav(directory / "voices" / "BLIP.wav", 0.01)  # under one 80 ms frame
    with wave.open(str(directory / "voices" / "U8.wav"), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(1)
        wav.setframerate(16_000)
        wav.writeframes(bytes(16_000))
    (directory / "voices" / "GARBAGE.wav").write_bytes(b"not a RIFF file at all")
    return directory


@pytest.fixture
def plugin(plex_dir):
    return MoshiPlugin.from_options({"model_dir": str(plex_dir), **GREEDY})


def test_the_preset_comes_from_the_checkpoint(plugin, tiny_dir):
    assert plugin.preset == "personaplex"
    assert checkpoint_preset(MoshiPlugin.from_options({"model_dir": str(tiny_dir)}).checkpoint) == (
        "moshi"
    )
    assert wrap_with_system_tags("  hi ") == "<system> hi <system>"
    assert wrap_with_system_tags("<system> hi <system>") == "<system> hi <system>"


async def test_persona_and_voice_become_the_runtime_config(plugin):
    config = DuplexSessionConfig(instructions=f"  {PERSONA} ", voice="TINYF0")
    runtime = await plugin.prepare_runtime_config(config)
    assert runtime == {"persona": PERSONA, "voice": "TINYF0.wav"}
    json.dumps(runtime)  # checkpointed with the session
    assert await plugin.prepare_runtime_config(DuplexSessionConfig()) == {
        "persona": None,
        "voice": None,
    }


@pytest.mark.parametrize(
    "voice, message",
    [
        ("../config.json", "not a path"),
        ("voices/TINYF0.wav", "not a path"),
        (".hidden", "not a path"),
        ("NOBODY", "no NOBODY.wav"),
        ("NATF2", "cannot replay"),
        ("BLIP", "too short"),
        ("U8", "not 16-bit PCM"),
        ("GARBAGE", "voice prompt GARBAGE.wav"),
    ],
)
async def test_bad_voices_are_refused(plugin, voice, message):
    with pytest.raises(DuplexRuntimeConfigError, match=message) as refused:
        await plugin.prepare_runtime_config(DuplexSessionConfig(voice=voice))
    assert refused.value.code == "invalid_duplex_runtime_config"


async def test_a_persona_too_long_is_refused(plugin):
    with pytest.raises(DuplexRuntimeConfigError, match="at most"):
        await plugin.prepare_runtime_config(DuplexSessionConfig(instructions="tell me " * 500))


def test_the_prompt_is_voice_silence_persona_silence(plugin):
    model = plugin.frame_model(1)
    frames = model.prompt_builder({"persona": PERSONA, "voice": "TINYF0.wav"})
    persona = plugin.personaplex.persona_tokens(PERSONA)
    assert len(frames) == 6 + SILENCE_FRAMES + len(persona) + SILENCE_FRAMES
    assert all(list(f.user_codes) == SINE for f in frames)
    voice, rest = frames[:6], frames[6:]
    assert all(f.text_token == 3 and len(f.model_codes) == 2 for f in voice)
    assert [f.text_token for f in rest[SILENCE_FRAMES : SILENCE_FRAMES + len(persona)]] == persona
    assert all(list(f.model_codes) == SILENCE for f in rest)
    assert [f.text_token for f in model.prompt_builder({})] == [3] * SILENCE_FRAMES


def test_a_prompting_slot_is_silent_forced_and_leaves_the_others_alone(plugin, make_model):
    model = plugin.frame_model(2)
    persona = plugin.personaplex.persona_tokens(PERSONA)
    model.open_slot(0, {})
    model.open_slot(1, {"persona": PERSONA, "voice": "TINYF0.wav"})
    prompt_frames = model.prompt_frames_left(1)
    frames = prompt_frames + 6
    inputs = {slot: user_audio(200 + slot, frames) for slot in range(2)}
    texts, outputs1 = [], []
    for t in range(frames):
        outputs = model.step(np.stack([inputs[0][t], inputs[1][t]]), np.array([True, True]))
        texts.append(int(model.last_tokens[1, 0]))
        outputs1.append(outputs[1])
    # silent through its prompt, then it talks
    assert all(o.audio.size == 0 and not o.speaking for o in outputs1[:prompt_frames])
    assert all(o.audio.shape == (1920,) for o in outputs1[prompt_frames + 1 :])
    # the persona's tokens were forced as the model's text, in order (LMGen returns them one
    # step later: its acoustic delay)
    start = texts.index(persona[0])
    assert texts[start : start + len(persona)] == persona
    # slot 0 (no prompt; an empty options dict still gets the fork's 6 silence frames) is
    # exactly what it is alone with the same prompt
    reference_model = plugin.frame_model(1)
    reference_model.open_slot(0, {})
    reference = run(reference_model, [{0: frame} for frame in inputs[0]])[0]
    batched0 = plugin.frame_model(2)
    batched0.open_slot(0, {})
    batched0.open_slot(1, {"persona": PERSONA, "voice": "TINYF0.wav"})
    traces = run(batched0, [{0: inputs[0][t], 1: inputs[1][t]} for t in range(frames)])
    traces[0].assert_same(reference)
    # and a plain Moshi model never prompts
    plain = alone(make_model, inputs[0][:3])
    assert plain.audio[1].shape == (1920,)


def test_reset_steps_the_prompt_again(plugin):
    model = plugin.frame_model(1)
    model.open_slot(0, {"persona": PERSONA})
    total = model.prompt_frames_left(0)
    audio = user_audio(300, 4)
    for frame in audio:
        model.step(frame[None], np.array([True]))
    assert model.prompt_frames_left(0) == total - 4
    model.reset_slot(0)
    assert model.prompt_frames_left(0) == total
    model.close_slot(0)
    assert model.prompt_frames_left(0) == 0


async def test_a_voice_too_short_to_encode_refuses_the_open_and_frees_the_slot(plex_dir):
    """The voice file exists but holds less than a frame, which the model could not encode:
    the open is refused before session.created, and no slot is taken."""
    plugin = MoshiPlugin.from_options({"model_dir": str(plex_dir), **GREEDY})
    model = plugin.frame_model(2)
    port = TickBatchedStagePort.for_plugin(plugin, model)
    router = InlineEventRouter()
    manager = SessionManager(
        plugin, SessionRuntimeConfig(max_sessions=2), router, port=port, vad_backend=LoudnessVad
    )
    client = InlineDuplexClient(manager, router)
    try:
        with pytest.raises(DuplexSessionError) as refused:
            await client.open({"voice": "BLIP"})
        assert refused.value.code == "invalid_duplex_runtime_config"
        assert refused.value.param == "voice" and "too short" in refused.value.message
        assert manager.session_ids() == [] and port.free_slots == 2
        opened = await client.open({"voice": "TINYF0", "instructions": PERSONA})
        assert port.slot_of(opened.session_id) is not None and port.free_slots == 1
    finally:
        await manager.shutdown()
