"""A restored history replays in one forward per part, and equals the frames stepped live.

`StreamingVoiceChat.replay` takes a history's frames at once (their audio, tool-result tokens,
text, ASR tokens and codes all in the records): the encoder over all their audio in one
streaming call, Nemotron-H over every position in one `extend` (Mamba-2's chunked scan from
the slot's state), the speech decoder's backbone over every frame in one call. A slot restored
that way must then go on exactly as the live one did; a restore's cost per frame must not be
one model step per frame (that was slower than real time on long histories).
"""

from __future__ import annotations

import numpy as np
import torch

from plugins.nemotron.frame_model import TokenText
from plugins.nemotron.streaming import (
    NemotronHStep,
    ReplayedFrame,
    StreamingPerception,
    StreamingVoiceChat,
)
from tests.plugins.nemotron.conftest import user_audio

WINDOW = 8


def test_the_encoder_over_many_frames_equals_it_frame_by_frame(voicechat):
    audio = torch.from_numpy(user_audio(3, 40))
    device = torch.device("cpu")
    stepped = StreamingPerception(voicechat.stt_model.perception, 2, device)
    chunked = StreamingPerception(voicechat.stt_model.perception, 2, device)
    want = torch.cat([stepped.step([1], audio[i : i + 1]) for i in range(40)])
    got = [chunked.step([1], audio[i : i + 1]) for i in range(2)]
    assert not StreamingPerception(voicechat.stt_model.perception, 1, device).can_extend(0)
    for start, end in ((2, 9), (9, 10), (10, 40)):  # uneven: 7, 1, 30 frames
        got.append(chunked.extend(1, audio[start:end]))
    assert torch.allclose(torch.cat(got), want, rtol=0, atol=1e-4)
    assert torch.equal(chunked.mel, stepped.mel) and torch.equal(chunked.raw, stepped.raw)
    assert torch.allclose(chunked.cache_channel, stepped.cache_channel, rtol=0, atol=1e-5)
    assert torch.equal(chunked.cache_len, stepped.cache_len)


def test_nemotron_h_over_many_positions_equals_it_position_by_position(voicechat):
    """Mamba-2's chunked scan and the attention over the cache, from a slot's state."""
    llm = voicechat.stt_model.llm
    kinds = {layer.block_type for layer in llm.layers}
    assert {"linear_attention", "full_attention"} <= kinds  # both kinds of layer
    device = torch.device("cpu")
    stepped, chunked = NemotronHStep(llm, 2, device), NemotronHStep(llm, 2, device)
    chunked.extend_positions = 10  # the 16 and 42 positions below in forwards of 10 at most
    embeds = torch.randn(60, llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = torch.cat([stepped.step([0], embeds[i : i + 1]) for i in range(60)])
    got = torch.cat(
        [
            chunked.step([0], embeds[:1]),
            chunked.extend(0, embeds[1:17]),
            chunked.extend(0, embeds[17:18]),
            chunked.extend(0, embeds[18:]),  # past the 256-position cache it starts with: 42
        ]
    )
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    a, b = stepped.export(0), chunked.export(0)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-5), name
    assert int(chunked.length[0]) == 60


def speaker() -> torch.Tensor:
    return torch.from_numpy(user_audio(99, 18).reshape(1, -1)[:, :22050].copy())


def test_a_slot_replayed_in_chunks_goes_on_as_the_live_one(voicechat):
    """Slot 0 talks live for 30 frames (tool-result tokens before frames 12 and 13); slot 2
    is restored from what it said: its first two frames stepped with their tokens forced,
    then the rest in `replay` calls of 1, 9 and 18 frames. Both then hear the same 12
    frames: the same tokens, the same speech."""
    frames, after = 30, 12
    audio = torch.from_numpy(user_audio(5, frames + after))
    tool = {12: [11, 12, 13], 13: [14]}
    engine = StreamingVoiceChat(voicechat, 3, WINDOW)
    engine.set_speaker(speaker(), None)
    embed = voicechat.stt_model.embed_tokens
    history = []
    for index in range(frames):
        for token in tool.get(index, []):
            engine.step([0], embed(torch.tensor([token])), prompt=[True], speak=False)
        (out,) = engine.step([0], engine.perception.step([0], audio[index : index + 1]))
        assert out.codes is not None
        history.append(
            ReplayedFrame(audio[index], tool.get(index, []), out.text, out.asr, out.codes)
        )
    assert len({frame.text for frame in history}) > 1  # it says different things

    for frame in history[:2]:  # the first two frames one by one
        forced = {"text": frame.text, "asr": frame.asr, "codes": frame.codes}
        user = engine.perception.step([2], frame.audio[None])
        engine.step([2], user, forced=[forced], decode=False)
    assert engine.can_replay(2) and not engine.can_replay(1)
    for start, end in ((2, 3), (3, 12), (12, frames)):
        engine.replay(2, history[start:end])
    assert engine.state[2].position == engine.state[0].position == frames + 4
    assert engine.state[2].tts_position == engine.state[0].tts_position

    for index in range(frames, frames + after):
        heard = audio[index : index + 1].repeat(2, 1)
        live, restored = engine.step([0, 2], engine.perception.step([0, 2], heard))
        assert (restored.text, restored.asr) == (live.text, live.asr)
        assert torch.equal(restored.codes, live.codes)
        assert torch.allclose(restored.audio, live.audio, rtol=0, atol=1e-5)


def test_replay_work_runs_the_model_once_per_call_not_once_per_frame(make_model, tiny_dir):
    """A 40-frame history replayed 16 frames a call: after the first two frames each call is
    one encoder forward, not one per frame (each forward's cost is mostly the same whatever
    its length on a small batch: frame by frame, long restores ran slower than real time)."""
    model = make_model(1, replay_chunk_frames="16")
    model.open_slot(0, {})
    audio = user_audio(7, 40)
    records = [model.step(audio[i : i + 1], np.ones(1, dtype=bool))[0].record for i in range(40)]
    model.close_slot(0)
    encoder = model.engine.perception.encoder
    calls = []
    hook = encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        model.restore_slot(0, {}, b"".join(records))
        per_call = []
        while model.replay_pending(0):
            before = len(calls)
            model.replay_work(0, 16)
            per_call.append(len(calls) - before)
    finally:
        hook.remove()
    # 16 (the first two one by one, then 14 at once), 16, 8
    assert per_call == [3, 1, 1]


def test_words_are_decoded_a_few_tokens_at_a_time_and_say_the_same(voicechat):
    """A turn's text as the turn grows: pieces that join to the whole turn's decoding, each
    token decoded with at most the few before it (a long turn decoded whole every frame cost
    more every frame)."""
    tokenizer = voicechat.stt_model.tokenizer
    sentence = "the quick brown fox jumps over the lazy dog, naïve café — 東京 " * 6
    ids = tokenizer.text_to_ids(sentence)
    decoded: list[int] = []

    def decode(tokens: list[int]) -> str:
        decoded.append(len(tokens))
        return tokenizer.ids_to_text(tokens, remove_special_tokens=False)

    text = TokenText()
    said = "".join(text.add(token, decode) for token in ids)
    assert said == tokenizer.ids_to_text(ids, remove_special_tokens=False)
    assert len(ids) > 60 and max(decoded) <= 8
