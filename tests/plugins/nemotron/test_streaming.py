"""Our per-frame streaming step equals NeMo's offline inference, token for token.

The reference is nemo-toolkit 3.0.0's `NemotronVoiceChat.offline_inference` on the whole
recording (its encoder over all the audio at once, its Nemotron-H over the full history at
every position, its codec decoding incremental over the same window). Ours steps 80 ms at a
time with every state carried per slot (plugins/nemotron/streaming.py): the text channel,
the user-transcript channel and the decoded speech must be the same, for two sessions
stepped in one batch (one of them starting later, so their positions differ) and for each
alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.tiny_nemotron import build_tiny_checkpoint
from plugins.nemotron.streaming import FRAME_SAMPLES, StreamingVoiceChat
from tests.plugins.nemotron.conftest import user_audio

FRAMES = 30
WINDOW = 8


def offline(model, audio: torch.Tensor, speaker: torch.Tensor, **kwargs) -> dict:
    """NeMo's offline inference of `audio` [B, samples], greedy, its audio decoded
    incrementally over WINDOW frames (NeMo's own streaming decoder)."""
    model.cfg.inference_codec_decoding_prev_tokens_number = WINDOW
    batch = audio.shape[0]
    return model.offline_inference(
        audio,
        torch.full((batch,), audio.shape[1], dtype=torch.long),
        speaker_audio=speaker.repeat(batch, 1),
        speaker_audio_lens=torch.full((batch,), speaker.shape[1], dtype=torch.long),
        decode_audio=True,
        incremental_audio_decoding=True,
        **kwargs,
    )


def speaker() -> torch.Tensor:
    return torch.from_numpy(user_audio(99, 18).reshape(1, -1)[:, :22050].copy())


def stream(model, inputs: list[torch.Tensor], starts: list[int], slots: int = 3) -> list[dict]:
    """Step each input [frames, 1280] in its own slot, all in one batch per tick, input i
    joining at tick starts[i]; returns each one's text, asr and audio."""
    engine = StreamingVoiceChat(model, slots, WINDOW)
    engine.set_speaker(speaker(), None)
    rows = [2 * i % slots for i in range(len(inputs))]  # not 0..n-1: rows are slots
    got = [{"text": [], "asr": [], "audio": []} for _ in inputs]
    ticks = max(start + len(x) for start, x in zip(starts, inputs, strict=True))
    for tick in range(ticks):
        live = [i for i, x in enumerate(inputs) if starts[i] <= tick < starts[i] + len(x)]
        slots_now = [rows[i] for i in live]
        audio = torch.stack([inputs[i][tick - starts[i]] for i in live])
        user = engine.perception.step(slots_now, audio)
        for i, out in zip(live, engine.step(slots_now, user), strict=True):
            got[i]["text"].append(out.text)
            got[i]["asr"].append(out.asr)
            got[i]["audio"].append(out.audio)
    return got


def check(reference: dict, row: int, got: dict) -> None:
    frames = len(got["text"])
    assert got["text"] == reference["tokens_text"][row, :frames].tolist()
    assert got["asr"] == reference["tokens_text_src"][row, :frames].tolist()
    # NeMo decodes incrementally from position 1 on: its audio is our frames 1.. (the same
    # codes; the codec's float sums differ in the last bits with the batch's make-up)
    ours = torch.cat(got["audio"][1:])
    theirs = reference["audio"][row, : ours.shape[0]]
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5)
    assert ours.abs().max() > 1e-3  # it says something


def test_two_sessions_in_one_batch_and_each_alone_equal_nemo_offline(voicechat):
    audio = torch.from_numpy(np.stack([user_audio(1, FRAMES), user_audio(2, FRAMES)]))
    flat = audio.reshape(2, FRAMES * FRAME_SAMPLES)
    reference = offline(voicechat, flat, speaker())
    texts = reference["tokens_text"][:, :FRAMES]
    # a meaningful comparison: the tiny model says several different things
    assert len(set(texts.flatten().tolist())) > 1
    assert len(set(reference["tokens_text_src"][:, :FRAMES].flatten().tolist())) > 1

    together = stream(voicechat, [audio[0], audio[1]], starts=[0, 0])
    check(reference, 0, together[0])
    check(reference, 1, together[1])
    # the second session joins 7 frames later: the two rows step at different positions
    later = stream(voicechat, [audio[0], audio[1][: FRAMES - 7]], starts=[0, 7])
    check(reference, 0, later[0])
    check(reference, 1, later[1])
    for row in (0, 1):
        (alone,) = stream(voicechat, [audio[row]], starts=[0])
        check(reference, row, alone)


def test_a_prompted_session_equals_nemo_offline_with_its_prompt_tokens(voicechat):
    """A system prompt is NeMo's prompt positions ([bos] + tokens + [eos], one position each,
    before the audio): the text and ASR channels match. (The speech decoder starts at the
    first frame here, not during the prompt: its codes are not compared.)"""
    tokenizer = voicechat.stt_model.tokenizer
    stt = voicechat.stt_model
    ids = [
        stt.text_bos_id,
        *tokenizer.text_to_ids("you are a helpful voice assistant"),
        stt.text_eos_id,
    ]
    audio = torch.from_numpy(user_audio(3, FRAMES))
    reference = offline(
        voicechat,
        audio.reshape(1, -1),
        speaker(),
        prompt_tokens=torch.tensor([ids]),
        prompt_token_lens=torch.tensor([len(ids)]),
    )
    engine = StreamingVoiceChat(voicechat, 2, WINDOW)
    engine.set_speaker(speaker(), None)
    engine.prefill_prompt(1, ids)
    text, asr = [], []
    for frame in audio:
        user = engine.perception.step([1], frame[None])
        (out,) = engine.step([1], user)
        text.append(out.text)
        asr.append(out.asr)
    # NeMo trims the prompt positions from what it returns
    assert text == reference["tokens_text"][0, :FRAMES].tolist()
    assert asr == reference["tokens_text_src"][0, :FRAMES].tolist()


@pytest.fixture(scope="module")
def gemma_mix(tmp_path_factory):
    """The tiny model with a speech decoder of Gemma-3's layer mix (a sliding-window layer
    and a full-attention one) and a window of 40 frames, which the decoder's warm-up (37
    positions) and a few frames cross: its cache is kept per layer."""
    from plugins.nemotron.checkpoint import NemotronCheckpoint

    directory = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gemma-mix"), speech_window=40)
    return NemotronCheckpoint.inspect(directory).load()


def test_past_the_speech_decoders_window_each_layer_keeps_its_own_length(gemma_mix):
    frames = 20
    audio = torch.from_numpy(np.stack([user_audio(1, frames), user_audio(2, frames)]))
    reference = offline(gemma_mix, audio.reshape(2, frames * FRAME_SAMPLES), speaker())
    backbone = gemma_mix.tts_model.tts_model.backbone.config
    assert backbone.layer_types == ["sliding_attention", "full_attention"]
    (alone,) = stream(gemma_mix, [audio[0]], starts=[0])
    check(reference, 0, alone)
    staggered = stream(gemma_mix, [audio[0], audio[1][: frames - 7]], starts=[0, 7])
    check(reference, 0, staggered[0])
    check(reference, 1, staggered[1])
