"""The PersonaPlex preset on the tiny model: persona and voice validation, the prompt stepped
before the conversation (forced tokens, one frame per tick), per slot and reset with it; and
`.pt` voice prompts (NVIDIA's fork's LM input embeddings and token cache), made here from a
`.wav` voice the way the fork makes them, replayed as the slot's prefix."""

import asyncio
import json
import shutil
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.frame_models import ManualClock
from harness.sessions import appends
from plugins.moshi import MoshiPlugin
from plugins.moshi.personaplex import (
    SILENCE_FRAMES,
    LMLayout,
    checkpoint_preset,
    wrap_with_system_tags,
)
from plugins.moshi.replay import decode_records, lm_inputs, lmgen_columns
from services.worker.control.manager import SessionManager
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import (
    DuplexRuntimeConfigError,
    DuplexSessionConfig,
    DuplexSessionError,
    SessionRuntimeConfig,
)
from tests.plugins.moshi.conftest import GREEDY, user_audio
from tests.plugins.moshi.test_frame_model import alone, run
from tests.plugins.moshi.test_replay import Codes, script, step
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
        ("NOBODY", "no NOBODY.wav or NOBODY.pt"),
        ("NATF2", "NATF2.pt: not a torch file"),
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


def test_a_slot_opened_again_steps_the_prompt_again(plugin):
    model = plugin.frame_model(1)
    model.open_slot(0, {"persona": PERSONA})
    total = model.prompt_frames_left(0)
    audio = user_audio(300, 4)
    for frame in audio:
        model.step(frame[None], np.array([True]))
    assert model.prompt_frames_left(0) == total - 4
    model.close_slot(0)
    assert model.prompt_frames_left(0) == 0
    model.open_slot(0, {"persona": PERSONA})
    assert model.prompt_frames_left(0) == total


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
        assert manager.table.live_ids() == [] and port.free_slots == 2
        opened = await client.open({"voice": "TINYF0", "instructions": PERSONA})
        assert port.slot_of(opened.session_id) is not None and port.free_slots == 1
    finally:
        await manager.shutdown()


# ---------------------------------------------------------------- .pt voice prompts

#: frames of the voice the `.pt` is made from (VARIED.wav)
VOICE_FRAMES = 6
#: conversation frames stepped after the prompt in the comparisons
AFTER = 25


def write_noise_wav(path, frames: int, seed: int, rate: int = 24_000) -> None:
    """A voice of `frames` Mimi frames of noise: its codes change from frame to frame."""
    samples = user_audio(seed, frames).reshape(-1) * 32767
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.clip(samples, -32768, 32767).astype("<i2").tobytes())


def fork_embed_codes(lm, columns: np.ndarray) -> torch.Tensor:
    """[K, T] LM input columns -> [T, 1, 1, dim], as the fork's `LMModel.embed_codes` makes
    each (the audio codebooks' embeddings summed in order, then the text's) and
    `torch.stack` puts them together."""
    tokens = torch.from_numpy(columns)[None]
    with torch.no_grad():
        total = lm.emb[0](tokens[:, 1])
        for codebook in range(1, lm.num_audio_codebooks):
            total = total + lm.emb[codebook](tokens[:, codebook + 1])
        total = total + lm.text_emb(tokens[:, 0])
    return total[0][:, None, None, :]


def fork_voice_file(lm, records: np.ndarray) -> dict[str, torch.Tensor]:
    """The `.pt` NVIDIA's fork saves, from a slot that stepped a `.wav` voice of N frames
    and the first frame of silence after it (N + 1 records).

    The fork's LMGen reads cache column o - 1 at its step of offset o (its step at offset 0
    only initializes, and its first frame's tokens are overwritten by the initial ones), and
    saves the LM input embeddings of every step that ran the transformer. Our slot, which
    reads column o at its step o, wrote the very columns the fork writes for the voice
    [v0, v0, v1, ..., v(N-1)] (N + 1 frames): so the fork's file for that voice holds E,
    the embeddings of columns 0..N-1 (P = N frames: what our steps 0..N-1 read), and C, its
    ring of 4 after them: column N whole (our step N's input; its user codes are the sine's,
    as everywhere in the prompt), the delayed codebooks of column N + 1 (the voice's last
    codes and the sine's), and the rest of that column stale (the fork's ring left column
    N - 3 there)."""
    voice_frames = len(records) - 1
    inputs = lm_inputs(records, lm)  # [K, N + 1]: what our steps 0..N read
    ring = np.full((lm.num_codebooks, 4), -2, dtype=np.int64)
    for position in range(voice_frames - 2, voice_frames + 1):
        ring[:, position % 4] = inputs[:, position]
    ahead = lmgen_columns(records, lm, voice_frames + 1, 4)[(voice_frames + 1) % 4]
    delayed = np.array(lm.delays) >= 1
    stale = inputs[:, voice_frames - 3]
    ring[:, (voice_frames + 1) % 4] = np.where(delayed, ahead, stale)
    return {
        "embeddings": fork_embed_codes(lm, inputs[:, :voice_frames]),
        "cache": torch.from_numpy(ring)[None],
    }


@pytest.fixture(scope="module")
def pt_dir(plex_dir, tmp_path_factory):
    """A voice prompt directory with VARIED.wav, MADE.pt made from it as the fork makes
    `.pt` voices (MADE16.pt the same in bf16, as NVIDIA's are), and malformed `.pt` files."""
    directory = tmp_path_factory.mktemp("pt-voices")
    write_noise_wav(directory / "VARIED.wav", VOICE_FRAMES, seed=11)
    plugin = MoshiPlugin.from_options(
        {"model_dir": str(plex_dir), "voice_prompt_dir": str(directory), **GREEDY}
    )
    model = plugin.frame_model(1)
    lm = model.lm
    model.open_slot(0, {"voice": "VARIED.wav"})
    assert model.prompt_frames_left(0) == VOICE_FRAMES + SILENCE_FRAMES
    zeros = np.zeros((1, model.frame_samples), np.float32)
    history = b"".join(
        model.step(zeros, np.array([True]))[0].record for _ in range(VOICE_FRAMES + 1)
    )
    made = fork_voice_file(lm, decode_records(history, lm.num_codebooks)[0])
    torch.save(made, directory / "MADE.pt")
    half = {"embeddings": made["embeddings"].bfloat16(), "cache": made["cache"]}
    torch.save(half, directory / "MADE16.pt")
    embeddings, cache = made["embeddings"], made["cache"]
    bad_tokens = cache.clone()
    bad_tokens[0, 1, VOICE_FRAMES % 4] = 999  # column P, read next: out of the card
    malformed = {
        "WIDE": {"embeddings": torch.zeros(4, 1, 1, lm.dim + 1), "cache": cache},
        "KEYS": {"embeddings": embeddings, "ring": cache},
        "LIST": [embeddings, cache],
        "CODEBOOKS": {"embeddings": embeddings, "cache": cache[:, :-1]},
        "SHAPE": {"embeddings": embeddings[:, 0], "cache": cache},
        "EMPTY": {"embeddings": embeddings[:0], "cache": cache},
        "FLOATCACHE": {"embeddings": embeddings, "cache": cache.float()},
        "SHORTRING": {"embeddings": embeddings, "cache": cache[:, :, :1]},
        "TOKENS": {"embeddings": embeddings, "cache": bad_tokens},
        "NAN": {"embeddings": embeddings * float("nan"), "cache": cache},
        "OBJECT": {"embeddings": SimpleNamespace(frames=embeddings), "cache": cache},
    }
    for name, value in malformed.items():
        torch.save(value, directory / f"{name}.pt")
    (directory / "JUNK.pt").write_bytes(b"PK\x03\x04 not quite a zip of tensors")
    return directory


@pytest.fixture
def pt_plugin(plex_dir, pt_dir):
    return MoshiPlugin.from_options(
        {"model_dir": str(plex_dir), "voice_prompt_dir": str(pt_dir), **GREEDY}
    )


def drive(model, slot_script: np.ndarray, frames: int, slot: int = 0):
    """Step `model`'s slot `frames` times, the LM given `slot_script`'s user codes once the
    prompt is done (Codes: Mimi's encoder replaced): its tokens and outputs per frame."""
    codes = Codes(model, {slot: slot_script})
    tokens, outputs = [], []
    for _ in range(frames):
        outputs.append(step(model, codes, [slot])[slot])
        tokens.append(model.last_tokens[slot].copy())
    return tokens, outputs


def open_and_replay(model, options, slot: int = 0) -> int:
    """Open the slot and run its replay to the end: the frames it had to replay."""
    model.open_slot(slot, options)
    pending = model.replay_pending(slot)
    while model.replay_pending(slot):
        model.replay_work(slot, model.replay_chunk_frames)
    return pending


def test_the_layout_a_pt_voice_must_fit_comes_from_the_lm_or_its_config(pt_plugin):
    model = pt_plugin.frame_model(1)
    assert LMLayout.of_checkpoint(pt_plugin.checkpoint) == LMLayout.of_lm(model.lm)
    moshi_7b = LMLayout.of_checkpoint(SimpleNamespace(info=SimpleNamespace(lm_config=None)))
    assert (moshi_7b.dim, moshi_7b.num_codebooks, moshi_7b.card) == (4096, 17, 2048)


async def test_a_pt_voice_is_the_prefix_and_the_prompt_after_it_is_silence_persona_silence(
    pt_plugin,
):
    """The voice's P embeddings and the first frame of silence (its input C's column P) are
    the prefix, in the LM's dtype whatever the file's; the prompt frames are the rest."""
    assert await pt_plugin.prepare_runtime_config(
        DuplexSessionConfig(instructions=PERSONA, voice="MADE")
    ) == {"persona": PERSONA, "voice": "MADE.pt"}
    model = pt_plugin.frame_model(1)
    preset = pt_plugin.personaplex
    persona = preset.persona_tokens(PERSONA)
    options = {"voice": "MADE.pt", "persona": PERSONA}
    frames = model.prompt_builder(options)
    assert len(frames) == SILENCE_FRAMES - 1 + len(persona) + SILENCE_FRAMES
    assert all(list(f.model_codes) == SILENCE and list(f.user_codes) == SINE for f in frames)
    assert [f.text_token for f in frames[SILENCE_FRAMES - 1 :][: len(persona)]] == persona
    prefix = model.prefix_builder(options)
    assert prefix.frames == VOICE_FRAMES + 1
    assert prefix.embeddings.shape == (VOICE_FRAMES + 1, model.lm.dim)
    assert prefix.embeddings.dtype == model.lm.dtype
    assert sorted(prefix.columns) == [VOICE_FRAMES + 1, VOICE_FRAMES + 2]
    forced = prefix.columns[VOICE_FRAMES + 1]
    delays = list(model.lm.delays)
    dep_q = model.lm.dep_q
    assert forced[0] == 3  # text padding
    for k in range(1, 1 + dep_q):  # silence where undelayed; the voice's last codes where not
        voice_last = preset.voice_embeddings("MADE.pt").column(VOICE_FRAMES + 1)[k]
        assert forced[k] == (SILENCE[k - 1] if delays[k] == 0 else voice_last)
    assert model.prefix_builder(options) is prefix  # built once per file
    assert model.prefix_builder({"voice": "VARIED.wav"}) is None
    assert model.prefix_builder({}) is None
    half = model.prefix_builder({"voice": "MADE16.pt"})
    assert half.embeddings.dtype == model.lm.dtype
    torch.testing.assert_close(half.embeddings, prefix.embeddings, atol=0.05, rtol=0.02)


def test_a_pt_voice_replays_then_prompts_then_speaks(pt_plugin):
    """(a) A slot opened with a `.pt` voice replays its prefix (by `replay_work`, and cannot
    step before), steps its prompt silent, then speaks; opened again, it replays the prefix
    again."""
    model = pt_plugin.frame_model(2)
    model.open_slot(0, {})
    model.open_slot(1, {"voice": "MADE.pt", "persona": PERSONA})
    assert model.replay_pending(1) == VOICE_FRAMES + 1
    zeros = np.zeros((2, model.frame_samples), np.float32)
    with pytest.raises(ValueError, match="replaying"):
        model.step(zeros, np.array([True, True]))
    model.step(zeros, np.array([True, False]))  # the other slot steps on meanwhile
    assert model.replay_work(1, model.replay_chunk_frames) == 0 and model.replay_pending(1) == 0
    prompt = model.prompt_frames_left(1)
    audio = user_audio(400, prompt + 4)
    outputs = []
    for frame in audio:
        outputs.append(model.step(np.stack([audio[0], frame]), np.array([True, True]))[1])
    assert all(o.audio.size == 0 and not o.speaking for o in outputs[:prompt])
    assert all(o.audio.shape == (1920,) for o in outputs[prompt:])
    assert all(len(o.record) == model.state_record_bytes for o in outputs)
    # opened again, the slot is where the open left it: the prefix to replay, the prompt
    model.close_slot(1)
    model.open_slot(1, {"voice": "MADE.pt", "persona": PERSONA})
    assert model.replay_pending(1) == VOICE_FRAMES + 1
    assert model.prompt_frames_left(1) == prompt


def test_a_pt_voice_leaves_the_lm_where_stepping_its_voice_does(pt_plugin):
    """(b) MADE.pt was made from VARIED.wav's slot: a slot opened with it goes on exactly as
    the slot that stepped VARIED.wav's frames as forced tokens, token for token through the
    prompt and the conversation (greedy, the same user codes). Exact because the prefix
    covers the first frame of silence too: stepped as a prompt frame, it would force
    silence in the delayed codebooks of column P + 1 where the fork (and the `.wav` slot)
    keeps the voice's last codes."""
    options = {"persona": PERSONA}
    stepped = pt_plugin.frame_model(1)
    stepped.open_slot(0, {**options, "voice": "VARIED.wav"})
    wav_prompt = stepped.prompt_frames_left(0)
    conversation = script(21, AFTER)
    lead = np.zeros((wav_prompt, 2), dtype=np.int64)  # prompt frames: their own user codes
    wav_tokens, wav_outputs = drive(
        stepped, np.concatenate([lead, conversation]), wav_prompt + AFTER
    )

    replayed = pt_plugin.frame_model(1)
    assert open_and_replay(replayed, {**options, "voice": "MADE.pt"}) == VOICE_FRAMES + 1
    pt_prompt = replayed.prompt_frames_left(0)
    assert pt_prompt == wav_prompt - VOICE_FRAMES - 1
    lead = lead[:pt_prompt]
    pt_tokens, pt_outputs = drive(replayed, np.concatenate([lead, conversation]), pt_prompt + AFTER)

    skipped = VOICE_FRAMES + 1  # the frames the prefix stands for
    for index, (mine, theirs) in enumerate(zip(pt_tokens, wav_tokens[skipped:], strict=True)):
        assert np.array_equal(mine, theirs), f"frame {index}: {mine} != {theirs}"
    # the records from the first prompt frame on are the same too (the history a restore
    # replays), and the audio
    assert [o.record for o in pt_outputs] == [o.record for o in wav_outputs[skipped:]]
    for mine, theirs in zip(pt_outputs[pt_prompt:], wav_outputs[wav_prompt:], strict=True):
        np.testing.assert_allclose(mine.audio, theirs.audio, atol=1e-5, rtol=0)
    offsets = [int(m.lm_gen._streaming_state.offsets[0]) for m in (replayed, stepped)]
    assert offsets[0] == offsets[1] == wav_prompt + AFTER
    # the conversation is not a constant stream (the comparison says something)
    assert len({tuple(t) for t in pt_tokens[pt_prompt:]}) > 3


@pytest.mark.parametrize(
    "voice, message",
    [
        ("JUNK", "JUNK.pt: not a torch file"),
        ("WIDE", "embeddings of width 33, the LM's is 32"),
        ("KEYS", "wants the keys 'embeddings' and 'cache', got \\['embeddings', 'ring'\\]"),
        ("LIST", "wants the keys 'embeddings' and 'cache', got list"),
        ("CODEBOOKS", "a cache of 4 codebooks, the LM has 5"),
        ("SHAPE", "embeddings of shape \\[6, 1, 32\\]"),
        ("EMPTY", "embeddings of shape \\[0, 1, 1, 32\\]"),
        ("FLOATCACHE", "a cache of shape \\[1, 5, 4\\] \\(torch.float32\\)"),
        ("SHORTRING", "a cache ring of 1 columns, under 3"),
        ("TOKENS", "cache tokens at position 6 out of range"),
        ("NAN", "not finite"),
        ("OBJECT", "OBJECT.pt: not a torch file of tensors.*\\(UnpicklingError\\)$"),
    ],
)
@pytest.mark.parametrize("attached", [False, True], ids=["config", "lm"])
async def test_a_malformed_pt_voice_is_refused_at_the_open(pt_plugin, voice, message, attached):
    """(c) Checked against the LM when a model is attached, else against its config."""
    if attached:
        pt_plugin.frame_model(1)
    with pytest.raises(DuplexRuntimeConfigError, match=message) as refused:
        await pt_plugin.prepare_runtime_config(DuplexSessionConfig(voice=voice))
    assert refused.value.code == "invalid_duplex_runtime_config"
    assert refused.value.param == "voice"


@pytest.mark.parametrize(
    "calls", [[64], [VOICE_FRAMES, 3, 1, 5]], ids=["whole-chunks", "across-the-prefix-end"]
)
def test_a_restore_with_a_pt_voice_replays_the_prefix_then_the_history(pt_plugin, calls):
    """(d) A slot of a `.pt` voice restored from its history replays the prefix and then the
    records (P + 1 + frames), beside a busy neighbour, and goes on as the slot it was; each
    `replay_work` call replays exactly the frames it is asked for, prefix and history
    alike, a call across the prefix's end too (the second of `calls`: its last frame and
    the history's first two)."""
    options = {"voice": "MADE.pt", "persona": PERSONA}
    original = pt_plugin.frame_model(1)
    open_and_replay(original, options)
    prompt = original.prompt_frames_left(0)
    before = prompt + 15
    conversation = script(22, 15 + AFTER)
    lead = np.zeros((prompt, 2), dtype=np.int64)
    tokens, outputs = drive(original, np.concatenate([lead, conversation]), before + AFTER)
    history = b"".join(o.record for o in outputs[:before])

    model = pt_plugin.frame_model(2)
    model.open_slot(0, {})
    neighbour = Codes(model, {0: script(23, 200)})
    for _ in range(5):
        step(model, neighbour, [0])
    model.restore_slot(1, options, history)
    assert model.replay_pending(1) == VOICE_FRAMES + 1 + before
    index = 0
    while pending := model.replay_pending(1):
        step(model, neighbour, [0])
        asked = calls[index % len(calls)]
        assert model.replay_work(1, asked) == pending - min(asked, pending)
        index += 1
    assert model.prompt_frames_left(1) == 0
    restored, _ = drive(model, conversation[15:], AFTER, slot=1)
    for index, (mine, theirs) in enumerate(zip(restored, tokens[before:], strict=True)):
        assert np.array_equal(mine, theirs), f"frame {before + index}: {mine} != {theirs}"


async def test_a_session_with_a_pt_voice_replays_on_the_stage_and_speaks(plex_dir, pt_dir):
    """Through the session manager and the tick stage: the open loads the voice, the slot
    replays its prefix between ticks, steps its prompt, and the model's voice comes back;
    a malformed `.pt` refuses the open and takes no slot."""
    plugin = MoshiPlugin.from_options(
        {"model_dir": str(plex_dir), "voice_prompt_dir": str(pt_dir), **GREEDY}
    )
    model = plugin.frame_model(2)
    clock = ManualClock()
    port = TickBatchedStagePort.for_plugin(plugin, model, clock=clock)
    router = InlineEventRouter()
    manager = SessionManager(
        plugin, SessionRuntimeConfig(max_sessions=2), router, port=port, vad_backend=LoudnessVad
    )
    client = InlineDuplexClient(manager, router)

    async def tick(count: int) -> None:
        for _ in range(count):
            target = port.ticks + 1
            await clock.advance_to(await clock.next_sleeper())
            await asyncio.wait_for(port.wait_ticks(target), 30)

    try:
        with pytest.raises(DuplexSessionError) as refused:
            await client.open({"voice": "WIDE"})
        assert refused.value.code == "invalid_duplex_runtime_config"
        assert refused.value.param == "voice" and port.free_slots == 2
        session = await client.open({"voice": "MADE"})
        runner = manager.table.runner(session.session_id)
        await runner.settle_input()
        slot = port.slot_of(session.session_id)
        prompt = SILENCE_FRAMES - 1
        for command in appends(user_audio(500, prompt + 12).reshape(-1), 24_000, chunk_ms=80):
            await session.send(command)
        await runner.settle_input()
        # the prefix replays in the tick's wait for its frames, between their steps
        async with asyncio.timeout(30):
            while model.replay_pending(slot):
                await asyncio.sleep(0.01)
        assert port.stats()["replayed_frames"] == VOICE_FRAMES + 1  # all of it, on the stage
        await tick(prompt + 10)
        events = await session.until("response.output_audio.delta", timeout=30)
        assert events[-1].delta
    finally:
        await manager.shutdown()
