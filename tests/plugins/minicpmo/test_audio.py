"""MiniCPM-o 4.5's streaming audio path (plugins/minicpmo/audio.py): the log-mel's sample and
frame bookkeeping, the streaming Whisper encoder's KV and resets, batching and replay, the
checkpoint's parameter names, and the config's checks. A tiny random encoder (fp32, CPU) stands
in for Whisper-medium."""

import numpy as np
import pytest
import torch
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from plugins.minicpmo.audio import (
    AudioConfig,
    AudioTower,
    MelStream,
    MelUnit,
    log_mel_spectrogram,
    slaney_mel_filters,
)

TOLERANCE = 1e-5
CONFIG_JSON = {
    "hidden_size": 64,
    "audio_pool_step": 5,
    "audio_chunk_length": 1.0,
    "audio_config": {
        "d_model": 32,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "num_mel_bins": 80,
        "max_source_positions": 1500,
        "activation_function": "gelu",
    },
}
CONFIG = AudioConfig.from_json(CONFIG_JSON)


def _units(count: int, seed: int, scale: float = 0.1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(16000)).astype(np.float32) for _ in range(count)]


def _tone(frequency: float, amplitude: float) -> np.ndarray:
    t = np.arange(16000) / 16000.0
    return (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def _session_samples(units: list[np.ndarray]) -> np.ndarray:
    """What the mel sees after len(units) units: 560 zeros, then the audio less 80 samples."""
    audio = np.concatenate([np.zeros(560, np.float32), *units])
    return audio[:len(audio) - 80]


def _mel_units(count: int, seed: int) -> list[MelUnit]:
    """Random mel frames in the per-unit layout (the encoder tests need no real audio)."""
    rng = np.random.default_rng(seed)
    return [
        MelUnit(index=k, prefix_frames=0 if k == 0 else 2,
                frames=rng.standard_normal((80, 102 if k == 0 else 104)).astype(np.float32))
        for k in range(count)
    ]


@pytest.fixture(scope="module")
def tower() -> AudioTower:
    torch.manual_seed(0)
    model = AudioTower(CONFIG)
    with torch.no_grad():  # LayerNorms and biases off their 1/0 defaults too
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.normal_(0.5 if parameter.abs().sum() else 0.0, 0.2)
    return model


# --- log-mel --------------------------------------------------------------------------------


def test_filter_bank_is_whispers_slaney_bank():
    ours = slaney_mel_filters()
    theirs = mel_filter_bank(201, 80, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-15)
    # the float32 bank the mel uses is bit-identical
    np.testing.assert_array_equal(ours.astype(np.float32), theirs.astype(np.float32))


def test_first_unit_mel_equals_an_offline_computation():
    unit = _tone(440.0, 0.3) + _units(1, seed=1, scale=0.05)[0]
    mel = MelStream().push(unit)
    # transformers' numpy spectrogram (float64) over the 1030 ms the first unit consumes
    samples = np.concatenate([np.zeros(560, np.float32), unit[:15920]])
    offline = spectrogram(
        samples, window_function(400, "hann"), frame_length=400, hop_length=160, power=2.0,
        mel_filters=mel_filter_bank(201, 80, 0.0, 8000.0, 16000, norm="slaney",
                                    mel_scale="slaney"),
        log_mel="log10", mel_floor=1e-10)[:, :-1]
    offline = (np.maximum(offline, -10.0) + 4.0) / 4.0
    assert mel.index == 0 and mel.prefix_frames == 0
    np.testing.assert_allclose(mel.frames, offline[:, :102], atol=TOLERANCE)


def test_frame_counts_and_the_80_sample_carry():
    units = _units(5, seed=2)
    stream = MelStream()
    for k, unit in enumerate(units):
        mel = stream.push(unit)
        assert mel.index == k
        assert mel.frames.shape == ((80, 102) if k == 0 else (80, 104))
        assert mel.prefix_frames == (0 if k == 0 else 2)
        assert stream.carried_samples == 80
        assert stream.buffer_samples == 16480 + 16000 * k
        # frames [0, 102) then [100k - 2, 100k + 102) of the whole session's mel (< 5 s: fixed
        # floor), whose samples stop 80 before the end of unit k
        whole = log_mel_spectrogram(_session_samples(units[:k + 1]), dynamic_floor=False)
        np.testing.assert_array_equal(mel.frames, whole[:, max(0, 100 * k - 2):100 * k + 102])


def test_a_units_last_80_samples_reach_only_the_next_unit():
    units = _units(3, seed=3)
    changed = [u.copy() for u in units]
    changed[1][-80:] = 0.9
    plain, altered = MelStream(), MelStream()
    mels = [(plain.push(a), altered.push(b)) for a, b in zip(units, changed, strict=True)]
    np.testing.assert_array_equal(mels[1][0].frames, mels[1][1].frames)
    assert not np.allclose(mels[2][0].frames, mels[2][1].frames)


def test_floor_is_fixed_below_five_seconds_then_max_minus_8():
    loud = np.zeros(16000, np.float32)
    loud[4000:12000] = _tone(500.0, 0.8)[4000:12000]
    silence = np.zeros(16000, np.float32)
    stream = MelStream()
    first = stream.push(loud)
    mels = [stream.push(silence) for _ in range(4)]  # units 1..4
    assert stream.buffer_samples == 80480
    # unit 3 (4.03 s): silence sits on the fixed floor, log10 -10 -> (-10 + 4) / 4
    np.testing.assert_array_equal(mels[2].frames, np.full((80, 104), -1.5, np.float32))
    # unit 4 (5.03 s): on the buffer's max - 8, the max being the tone's (unit 0's) frames
    np.testing.assert_allclose(mels[3].frames, first.frames.max() - 2.0, atol=1e-6)


def test_buffer_drops_ten_seconds_when_it_reaches_thirty():
    units = [_tone(300.0 + 50 * k, 0.9) for k in range(6)] + _units(25, seed=4, scale=0.01)
    stream = MelStream()
    mels = [stream.push(unit) for unit in units]
    assert stream.units == 31
    whole = _session_samples(units[:30])
    assert len(whole) == 480480
    # unit 28 still sees everything; unit 29 brings the buffer to 30 s and it slides by 10 s
    np.testing.assert_array_equal(
        mels[28].frames,
        log_mel_spectrogram(whole[:464480], dynamic_floor=True)[:, 2798:2902])
    slid = log_mel_spectrogram(whole[160000:], dynamic_floor=True)
    np.testing.assert_array_equal(mels[29].frames, slid[:, 1898:2002])
    # the loud first seconds left the buffer, so the floor (and the frames) changed
    unslid = log_mel_spectrogram(whole, dynamic_floor=True)[:, 2898:3002]
    assert mels[29].frames.min() < unslid.min()
    assert stream.buffer_samples == 320480 + 16000
    assert stream.buffer_start_frame == 1000


def test_replayed_stream_equals_the_pushed_one():
    units = _units(32, seed=5)
    pushed = MelStream()
    mels = [pushed.push(unit) for unit in units]
    replayed, tail = MelStream.replay(units, emit_from=29)
    assert [m.index for m in tail] == [29, 30, 31]
    for ours, theirs in zip(tail, mels[29:], strict=True):
        np.testing.assert_array_equal(ours.frames, theirs.frames)
    assert (replayed.units, replayed.buffer_samples, replayed.buffer_start_frame,
            replayed.carried_samples) == (pushed.units, pushed.buffer_samples,
                                          pushed.buffer_start_frame, pushed.carried_samples)
    np.testing.assert_array_equal(replayed.push(units[0]).frames, pushed.push(units[0]).frames)


def test_a_unit_must_be_one_second():
    with pytest.raises(ValueError, match="16000 samples"):
        MelStream().push(np.zeros(15999, np.float32))


# --- encoder --------------------------------------------------------------------------------

EXPECTED_APM_KEYS = {
    "conv1.weight": (32, 80, 3), "conv1.bias": (32,),
    "conv2.weight": (32, 32, 3), "conv2.bias": (32,),
    "embed_positions.weight": (1500, 32),
    "layer_norm.weight": (32,), "layer_norm.bias": (32,),
} | {
    f"layers.{i}.{name}": shape
    for i in range(2)
    for name, shape in {
        "self_attn.k_proj.weight": (32, 32),  # Whisper's k_proj has no bias
        "self_attn.v_proj.weight": (32, 32), "self_attn.v_proj.bias": (32,),
        "self_attn.q_proj.weight": (32, 32), "self_attn.q_proj.bias": (32,),
        "self_attn.out_proj.weight": (32, 32), "self_attn.out_proj.bias": (32,),
        "self_attn_layer_norm.weight": (32,), "self_attn_layer_norm.bias": (32,),
        "fc1.weight": (128, 32), "fc1.bias": (128,),
        "fc2.weight": (32, 128), "fc2.bias": (32,),
        "final_layer_norm.weight": (32,), "final_layer_norm.bias": (32,),
    }.items()
}
EXPECTED_PROJECTOR_KEYS = {
    "linear1.weight": (64, 32), "linear1.bias": (64,),
    "linear2.weight": (64, 64), "linear2.bias": (64,),
}


def test_loads_the_checkpoints_keys_strictly():
    checkpoint = {f"apm.{k}": torch.randn(s) for k, s in EXPECTED_APM_KEYS.items()} | {
        f"audio_projection_layer.{k}": torch.randn(s) for k, s in EXPECTED_PROJECTOR_KEYS.items()}
    model = AudioTower(CONFIG)
    assert {k: tuple(v.shape) for k, v in model.apm.state_dict().items()} == EXPECTED_APM_KEYS
    model.load_state_dict(checkpoint, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, checkpoint[key])
    with pytest.raises(RuntimeError, match=r"k_proj\.bias"):
        model.load_state_dict(checkpoint | {"apm.layers.0.self_attn.k_proj.bias": torch.zeros(32)})


def test_kv_resets_before_unit_29_and_every_29_units(tower):
    mels = _mel_units(31, seed=6)
    kv = tower.new_kv()
    outputs, lengths = [], []
    for mel in mels:
        outputs.append(tower.step([mel], [kv])[0])
        lengths.append(kv.length)
    assert lengths == [50 * (k + 1) for k in range(29)] + [50, 100]
    assert CONFIG.units_per_context == 29 and CONFIG.context_start(57) == 29
    # unit 29 opens a new context: the same as encoding it with nothing before it
    fresh = tower.step([mels[29]], [tower.new_kv(next_unit=29)])[0]
    torch.testing.assert_close(outputs[29], fresh, atol=TOLERANCE, rtol=0)
    # unit 28 did see the units before it
    alone = tower.step([MelUnit(index=29, frames=mels[28].frames, prefix_frames=2)],
                       [tower.new_kv(next_unit=29)])[0]
    assert not torch.allclose(outputs[28], alone, atol=1e-3)
    assert outputs[0].shape == (10, 64)


def _advance(tower: AudioTower, mels: list[MelUnit]):
    kv = tower.new_kv()
    for mel in mels:
        tower.step([mel], [kv])
    return kv


def test_batched_step_equals_each_session_alone(tower):
    # sessions at unit 0, unit 7 and unit 29 (its KV resets inside the batch)
    histories = [_mel_units(n + 1, seed=10 + n) for n in (0, 7, 29)]
    solo_kvs = [_advance(tower, h[:-1]) for h in histories]
    batch_kvs = [_advance(tower, h[:-1]) for h in histories]
    solo = [tower.step([h[-1]], [kv])[0] for h, kv in zip(histories, solo_kvs, strict=True)]
    batched = tower.step([h[-1] for h in histories], batch_kvs)
    assert batched.shape == (3, 10, 64)
    for alone, together in zip(solo, batched, strict=True):
        torch.testing.assert_close(together, alone, atol=TOLERANCE, rtol=0)
    for a, b in zip(solo_kvs, batch_kvs, strict=True):
        assert (a.length, a.next_unit) == (b.length, b.next_unit)
        torch.testing.assert_close(b.keys[:, :, :b.length], a.keys[:, :, :a.length],
                                   atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(b.values[:, :, :b.length], a.values[:, :, :a.length],
                                   atol=TOLERANCE, rtol=0)


def test_replay_equals_stepping_across_a_reset(tower):
    mels = _mel_units(35, seed=7)
    stepped_kv = tower.new_kv()
    stepped = torch.cat([tower.step([mel], [stepped_kv]) for mel in mels])
    replay_kv = tower.new_kv()
    replayed = tower.replay(mels, replay_kv)
    torch.testing.assert_close(replayed, stepped, atol=TOLERANCE, rtol=0)
    assert (replay_kv.length, replay_kv.next_unit) == (stepped_kv.length, stepped_kv.next_unit)
    torch.testing.assert_close(replay_kv.keys[:, :, :300], stepped_kv.keys[:, :, :300],
                               atol=TOLERANCE, rtol=0)
    # a restore replays only from the context start, into an empty KV
    restored_kv = tower.new_kv(next_unit=CONFIG.context_start(34))
    restored = tower.replay(mels[29:], restored_kv)
    torch.testing.assert_close(restored, stepped[29:], atol=TOLERANCE, rtol=0)
    # and continues like the stepped one: a replay split across calls
    split_kv = _advance(tower, mels[:10])
    torch.testing.assert_close(tower.replay(mels[10:], split_kv), stepped[10:],
                               atol=TOLERANCE, rtol=0)


def test_kv_and_unit_order_are_checked(tower):
    mels = _mel_units(2, seed=8)
    with pytest.raises(ValueError, match="context starts"):
        tower.new_kv(next_unit=5)
    with pytest.raises(ValueError, match="unit 1 given where unit 0"):
        tower.step([mels[1]], [tower.new_kv()])
    kv = tower.new_kv()
    with pytest.raises(ValueError, match="twice"):
        tower.step(mels[:1] * 2, [kv, kv])


def test_bfloat16_tower_follows_the_float32_one(tower):
    mels = _mel_units(3, seed=9)
    half = AudioTower(CONFIG, dtype=torch.bfloat16)
    half.load_state_dict(tower.state_dict())
    reference = tower.replay(mels, tower.new_kv())
    result = half.replay(mels, half.new_kv())
    assert result.dtype == torch.bfloat16 and half.new_kv().keys.dtype == torch.bfloat16
    torch.testing.assert_close(result.float(), reference, atol=0.1, rtol=0.05)


# --- config ---------------------------------------------------------------------------------


def _config_with(**changes) -> dict:
    audio = dict(CONFIG_JSON["audio_config"])
    top = {k: v for k, v in CONFIG_JSON.items() if k != "audio_config"}
    for key, value in changes.items():
        target = top if key in ("hidden_size", "audio_pool_step", "audio_chunk_length") else audio
        if value is None:
            target.pop(key)
        else:
            target[key] = value
    return top | {"audio_config": audio}


@pytest.mark.parametrize(("changes", "message"), [
    ({"encoder_ffn_dim": 96}, "encoder_ffn_dim must be 4 \\* d_model = 128"),
    ({"num_mel_bins": 128}, "num_mel_bins must be 80"),
    ({"max_source_positions": 448}, "max_source_positions must be 1500"),
    ({"encoder_attention_heads": 5}, "not a multiple of encoder_attention_heads"),
    ({"encoder_layers": 0}, "encoder_layers must be a positive integer"),
    ({"d_model": None}, "audio_config lacks d_model"),
    ({"hidden_size": None}, "lacks hidden_size"),
    ({"audio_pool_step": 3}, "audio_pool_step must divide the 50"),
    ({"audio_chunk_length": 2.0}, "audio_chunk_length must be 1.0"),
    ({"activation_function": "relu"}, "activation_function must be 'gelu'"),
])
def test_config_errors_say_what_is_wrong(changes, message):
    with pytest.raises(ValueError, match=message):
        AudioConfig.from_json(_config_with(**changes))


def test_config_without_audio_config_is_refused():
    with pytest.raises(ValueError, match="no audio_config"):
        AudioConfig.from_json({"hidden_size": 64})
