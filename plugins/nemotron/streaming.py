"""Nemotron VoiceChat stepped one 80 ms frame at a time, for many sessions in one batch.

NeMo's own inference (`NemotronVoiceChat.offline_inference`) encodes the whole recording,
then runs its duplex loop with no LLM cache for Nemotron-H ("full history each step"), so
frame t costs a forward over t positions. Here every part of the model keeps its streaming
state per slot and a frame costs one step of each:

- **perception**: the mel front end over the frame's new samples only (`MelFrames`: the
  pre-emphasis and centred STFT of NeMo's `FilterbankFeatures`, cut to the frames this audio
  completes) and the FastConformer's cache-aware streaming step
  (`ConformerEncoder.cache_aware_stream_step`: per layer, the attention's left context and
  the causal convolution's tail). With causal downsampling, encoder step k needs mel frames
  up to 8k, i.e. audio up to 16 ms into frame k: it is computed at frame k, no lookahead;
- **LLM** (Nemotron-H): its own one-position step over the HF modules' weights
  (`NemotronHStep`): per Mamba-2 layer the convolution tail and the SSM state, per attention
  layer the key/value cache (Nemotron-H's attention has no positional encoding, so slots at
  different positions share one step: each row attends to its own cache length);
- **speech decoder** (EAR-TTS): its backbone's key/value cache per slot, one step per frame
  (`DuplexEARTTS.infer_codes_one_step`);
- **codec**: NeMo's incremental decoding (`decode_one_audio_step`) over the slot's last
  `decode_window` frames of codes.

The inputs of position t are built exactly as `DuplexSTTStreamingInference` builds them (the
user channel, plus the previous text and ASR tokens' embeddings, BOS at position 0, the
prompt's token embeddings in place of audio at prompt positions, forced turn taking when the
checkpoint asks for it), so the streamed tokens are NeMo's, token for token (the tests
compare them with `offline_inference`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: samples of one input frame (80 ms at 16 kHz)
FRAME_SAMPLES = 1280
#: mel frames per input frame (10 ms hop)
MEL_PER_FRAME = 8
#: the most positions of a slot one forward of `NemotronHStep.extend` takes (a Mamba-2
#: layer's chunked scan holds [heads, P, P]: 128 heads x 256 x 256 floats is 32 MB)
EXTEND_POSITIONS = 256


# ---------------------------------------------------------------- perception


class StreamingPerception:
    """NeMo's `AudioPerceptionModule` (mel front end, cache-aware FastConformer, adapter,
    projection) one frame at a time, its state kept per slot."""

    def __init__(self, perception: Any, slots: int, device: torch.device) -> None:
        self.perception = perception
        featurizer = perception.preprocessor.featurizer
        self.featurizer = featurizer
        if (
            featurizer.exact_pad
            or featurizer.normalize not in (None, "", "NA")
            or featurizer.frame_splicing > 1
        ):
            raise ValueError(
                "the perception's mel front end must be streamable: no exact_pad, no "
                "per-utterance normalization, no frame splicing"
            )
        if featurizer.hop_length * MEL_PER_FRAME != FRAME_SAMPLES:
            raise ValueError("the mel hop must be 10 ms (8 mel frames per 80 ms frame)")
        self.encoder = perception.encoder
        self.encoder.setup_streaming_params()
        cfg = self.encoder.streaming_cfg
        if list(cfg.chunk_size) != [1, MEL_PER_FRAME] or cfg.valid_out_len != 1:
            raise ValueError(
                "the speech encoder must step once per 80 ms frame (causal downsampling by "
                f"8, no lookahead): its streaming chunk is {cfg.chunk_size}"
            )
        self.cache_mel = int(cfg.pre_encode_cache_size[1])
        self.half_fft = featurizer.n_fft // 2
        # raw audio kept per slot: enough for the pre-emphasis and the STFT windows of the
        # 8 mel frames this frame completes (they reach 1376 samples back)
        self.keep = 3 * FRAME_SAMPLES
        self.slots = slots
        self.device = device
        channel, time, _ = self.encoder.get_initial_cache_state(batch_size=slots, device=device)
        self.cache_channel = channel
        self.cache_time = time
        self.cache_len = torch.zeros(slots, dtype=torch.long, device=device)
        self.raw = torch.zeros(slots, self.keep, device=device)
        n_mels = featurizer.nfilt
        self.mel = torch.zeros(slots, n_mels, self.cache_mel, device=device)
        self.frames = torch.zeros(slots, dtype=torch.long)
        self.window = featurizer.window.to(torch.float).to(device)

    def reset(self, slot: int) -> None:
        self.cache_channel[:, slot] = 0
        self.cache_time[:, slot] = 0
        self.cache_len[slot] = 0
        self.raw[slot] = 0
        self.mel[slot] = 0
        self.frames[slot] = 0

    def _mel(self, rows: Tensor, first: bool) -> Tensor:
        """The mel frames the slots' newest frame completes: log-mel [B, n_mels, 8] (1 at a
        slot's first frame), exactly as FilterbankFeatures computes them over a whole signal."""
        fb = self.featurizer
        x = self.raw[rows]
        y = torch.cat((x[:, :1], x[:, 1:] - fb.preemph * x[:, :-1]), dim=1) if fb.preemph else x
        # the buffer's last frame is frame k, its first sample at 2 * FRAME_SAMPLES; mel frame i
        # is centred on sample 160 i, so frames 8k-7 .. 8k span [1280k - 1376, 1280k + 256)
        end = 2 * FRAME_SAMPLES + self.half_fft
        if first:
            start = end - 2 * self.half_fft
        else:
            start = end - 2 * self.half_fft - (MEL_PER_FRAME - 1) * fb.hop_length
        return self._log_mel(y[:, start:end])

    def _log_mel(self, segment: Tensor) -> Tensor:
        """FilterbankFeatures' log-mel of a pre-emphasised segment, no centring: [B, n_mels,
        (samples - n_fft) / hop + 1]."""
        fb = self.featurizer
        spec = torch.stft(
            segment,
            n_fft=fb.n_fft,
            hop_length=fb.hop_length,
            win_length=fb.win_length,
            center=False,
            window=self.window,
            return_complex=True,
        )
        magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1))
        if fb.mag_power != 1.0:
            magnitude = magnitude.pow(fb.mag_power)
        mel = torch.matmul(fb.fb.to(magnitude.dtype), magnitude)
        if fb.log:
            if fb.log_zero_guard_type == "add":
                mel = torch.log(mel + fb.log_zero_guard_value_fn(mel))
            else:
                mel = torch.log(torch.clamp(mel, min=fb.log_zero_guard_value_fn(mel)))
        return mel

    @torch.no_grad()
    def step(self, slots: list[int], audio: Tensor) -> Tensor:
        """One frame per slot (`audio` [B, 1280]): the LLM's user-channel input [B, H]."""
        out: list[Tensor | None] = [None] * len(slots)
        rows_all = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.raw[rows_all] = torch.cat([self.raw[rows_all, FRAME_SAMPLES:], audio], dim=1)
        # the first two frames of a slot chunk the encoder differently (less context than
        # its pre-encode cache): slots are grouped by phase, steady state is one call
        phases: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            phases.setdefault(min(int(self.frames[slot]), 2), []).append(i)
        for phase, members in phases.items():
            index = torch.tensor([slots[i] for i in members], dtype=torch.long, device=self.device)
            mel = self._mel(index, first=phase == 0)
            if phase == 0:
                chunk, drop = mel, 0
            elif phase == 1:
                chunk, drop = torch.cat([self.mel[index, :, -1:], mel], dim=2), 1
            else:
                chunk, drop = torch.cat([self.mel[index], mel], dim=2), None
            self.mel[index] = torch.cat([self.mel[index], mel], dim=2)[:, :, -self.cache_mel :]
            lengths = torch.full(
                (len(members),), chunk.shape[2], dtype=torch.long, device=self.device
            )
            emb, emb_len, channel, time, cache_len = self.encoder.cache_aware_stream_step(
                processed_signal=chunk,
                processed_signal_length=lengths,
                cache_last_channel=self.cache_channel[:, index],
                cache_last_time=self.cache_time[:, index],
                cache_last_channel_len=self.cache_len[index],
                keep_all_outputs=True,
                drop_extra_pre_encoded=drop,
            )
            self.cache_channel[:, index] = channel
            self.cache_time[:, index] = time
            self.cache_len[index] = cache_len
            adapted, _ = self.perception.modality_adapter(audio_signal=emb, length=emb_len)
            projected = self.perception.proj(adapted.transpose(1, 2))[:, -1]
            for j, i in enumerate(members):
                out[i] = projected[j]
        for slot in slots:
            self.frames[slot] += 1
        return torch.stack([o for o in out if o is not None])

    def can_extend(self, slot: int) -> bool:
        """Whether `extend` may take the slot's next frames (it has passed the first two, whose
        chunking differs: those go through `step`)."""
        return int(self.frames[slot]) >= 2

    @torch.no_grad()
    def extend(self, slot: int, audio: Tensor) -> Tensor:
        """`audio` [M, 1280]: the slot's next M frames in one encoder call (a replay's, known
        in advance), equal to M `step`s: the mel of all 8M new mel frames over one STFT, and
        one cache-aware streaming step over them (each encoder position attends to the same
        left context through the chunk's mask, and the caches shift by M). Returns the LLM's
        user-channel inputs [M, H]."""
        if not self.can_extend(slot):
            raise ValueError(f"slot {slot} is in its first two frames: step them one by one")
        frames = audio.shape[0]
        fb = self.featurizer
        x = torch.cat([self.raw[slot, FRAME_SAMPLES:], audio.reshape(-1)])[None]
        self.raw[slot] = x[0, -self.keep :]
        y = torch.cat((x[:, :1], x[:, 1:] - fb.preemph * x[:, :-1]), dim=1) if fb.preemph else x
        # as `_mel`: the first new frame starts at 2 * FRAME_SAMPLES in `x`; from its first
        # mel frame's window to the last new frame's last one
        start = 2 * FRAME_SAMPLES - self.half_fft - (MEL_PER_FRAME - 1) * fb.hop_length
        end = (frames + 1) * FRAME_SAMPLES + self.half_fft
        mel = self._log_mel(y[:, start:end])
        chunk = torch.cat([self.mel[slot : slot + 1], mel], dim=2)
        self.mel[slot] = chunk[0, :, -self.cache_mel :]
        index = torch.tensor([slot], dtype=torch.long, device=self.device)
        # the encoder's own forward: `cache_aware_stream_step` would keep only the first
        # output of a "regular" context's chunk (`valid_out_len`), so its cache trim is here
        emb, emb_len, channel, time, cache_len = self.encoder(
            audio_signal=chunk,
            length=torch.tensor([chunk.shape[2]], device=self.device),
            cache_last_channel=self.cache_channel[:, index],
            cache_last_time=self.cache_time[:, index],
            cache_last_channel_len=self.cache_len[index],
        )
        keep = self.encoder.streaming_cfg.last_channel_cache_size
        if keep > 0:
            channel = channel[:, :, -keep:]
        self.cache_channel[:, index] = channel
        self.cache_time[:, index] = time
        self.cache_len[index] = cache_len
        adapted, _ = self.perception.modality_adapter(audio_signal=emb, length=emb_len)
        self.frames[slot] += frames
        return self.perception.proj(adapted.transpose(1, 2))[0, -frames:]


# ---------------------------------------------------------------- Nemotron-H


class NemotronHStep:
    """One position of Nemotron-H for a batch of slots, each at its own position, over the
    HF model's modules and weights (no HF cache object: one of those holds one length for
    the whole batch). Per slot: each Mamba-2 layer's convolution tail and SSM state, each
    attention layer's keys and values."""

    def __init__(self, llm: Any, slots: int, device: torch.device, capacity: int = 256) -> None:
        self.llm = llm
        self.layers = list(llm.layers)
        self.slots = slots
        self.device = device
        dtype = next(llm.parameters()).dtype
        self.dtype = dtype
        self.conv: dict[int, Tensor] = {}
        self.ssm: dict[int, Tensor] = {}
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = torch.zeros(slots, dtype=torch.long)
        #: the most positions one forward of `extend` takes
        self.extend_positions = EXTEND_POSITIONS
        for i, layer in enumerate(self.layers):
            mixer = layer.mixer
            if layer.block_type == "linear_attention":
                self.conv[i] = torch.zeros(
                    slots, mixer.conv_dim, mixer.conv_kernel_size - 1, device=device, dtype=dtype
                )
                self.ssm[i] = torch.zeros(
                    slots,
                    mixer.num_heads,
                    mixer.head_dim,
                    mixer.ssm_state_size,
                    device=device,
                    dtype=dtype,
                )
            elif layer.block_type == "full_attention":
                kv_heads = mixer.config.num_key_value_heads
                self.keys[i] = torch.zeros(
                    slots, kv_heads, capacity, mixer.head_dim, device=device, dtype=dtype
                )
                self.values[i] = torch.zeros_like(self.keys[i])
            elif layer.block_type not in ("mlp", "moe"):
                raise ValueError(f"unknown Nemotron-H block type {layer.block_type!r}")

    def reset(self, slot: int) -> None:
        for state in (*self.conv.values(), *self.ssm.values()):
            state[slot] = 0
        self.length[slot] = 0

    def _grow(self, needed: int) -> None:
        for i in list(self.keys):
            capacity = self.keys[i].shape[2]
            if needed <= capacity:
                continue
            size = max(needed, capacity * 2)
            for store in (self.keys, self.values):
                old = store[i]
                new = torch.zeros(
                    *old.shape[:2], size, old.shape[3], device=old.device, dtype=old.dtype
                )
                new[:, :, :capacity] = old
                store[i] = new

    def _layers(
        self,
        hidden: Tensor,
        mamba: Callable[[int, Any, Tensor], Tensor],
        attention: Callable[[int, Any, Tensor], Tensor],
    ) -> Tensor:
        """Every layer over `hidden` [B, T, H] (pre-norm, residual), its Mamba-2 and attention
        mixers the caller's (a step's or a chunk's, each with its slots' state)."""
        for i, layer in enumerate(self.layers):
            normed = layer.norm(hidden.to(dtype=layer.norm.weight.dtype))
            if layer.block_type == "linear_attention":
                mixed = mamba(i, layer.mixer, normed)
            elif layer.block_type == "full_attention":
                mixed = attention(i, layer.mixer, normed)
            else:
                mixed = layer.mixer(normed)
            hidden = hidden + mixed
        return hidden

    @torch.no_grad()
    def step(self, slots: list[int], embeds: Tensor) -> Tensor:
        """`embeds` [B, H]: one position per slot; returns the final hidden state [B, H]."""
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        positions = self.length[slots].to(self.device)
        self._grow(int(positions.max()) + 1)
        hidden = self._layers(
            embeds.to(self.dtype).unsqueeze(1),
            lambda i, mixer, x: self._mamba(i, mixer, x, rows),
            lambda i, mixer, x: self._attention(i, mixer, x, rows, positions),
        )
        for slot in slots:
            self.length[slot] += 1
        return self.llm.norm_f(hidden)[:, 0]

    @torch.no_grad()
    def prefill(self, slot: int, embeds: Tensor) -> Tensor:
        """A fresh slot's first positions at once (a prompt: `embeds` [P, H]), through the HF
        model's own full-sequence forward (Mamba-2's chunked scan, attention over the
        chunk), its cache then copied into the slot's state. Returns the final hidden
        states [P, H]."""
        from transformers import DynamicCache

        if int(self.length[slot]) != 0:
            raise ValueError(f"slot {slot} is not fresh: a prefill starts a conversation")
        positions = embeds.shape[0]
        self._grow(positions)
        cache = DynamicCache(config=self.llm.config)
        out = self.llm(
            inputs_embeds=embeds.to(self.dtype)[None],
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        )
        for i, layer in enumerate(out.past_key_values.layers):
            if i in self.conv:
                tail = self.conv[i].shape[-1]
                self.conv[i][slot] = layer.conv_states[0][0, :, -tail:]
                self.ssm[i][slot] = layer.recurrent_states[0][0]
            elif i in self.keys:
                self.keys[i][slot, :, :positions] = layer.keys[0]
                self.values[i][slot, :, :positions] = layer.values[0]
        self.length[slot] = positions
        return out.last_hidden_state[0]

    @torch.no_grad()
    def extend(self, slot: int, embeds: Tensor) -> Tensor:
        """The slot's next P positions at once (`embeds` [P, H], known in advance: a replayed
        history's), from its state: each Mamba-2 layer's scan over the positions in its
        chunked (SSD) form from the slot's SSM state and convolution tail, each attention
        layer over its cache and the new keys. Equal to P `step`s up to float rounding.
        At most `extend_positions` a forward (a replay call's frames with their tool-result
        tokens can be thousands of positions, and a Mamba-2 layer's scan holds a
        [heads, P, P] matrix). Returns the final hidden states [P, H]."""
        return torch.cat(
            [
                self._extend(slot, embeds[begin : begin + self.extend_positions])
                for begin in range(0, embeds.shape[0], self.extend_positions)
            ]
        )

    def _extend(self, slot: int, embeds: Tensor) -> Tensor:
        start = int(self.length[slot])
        positions = embeds.shape[0]
        self._grow(start + positions)
        hidden = self._layers(
            embeds.to(self.dtype)[None],
            lambda i, mixer, x: self._mamba_chunk(i, mixer, x, slot),
            lambda i, mixer, x: self._attention_chunk(i, mixer, x, slot, start),
        )
        self.length[slot] = start + positions
        return self.llm.norm_f(hidden)[0]

    def _mamba_chunk(self, i: int, mixer: Any, x: Tensor, slot: int) -> Tensor:
        """Mamba-2 over P positions of one slot (`x` [1, P, H]) from its state. With
        dA_t = dt_t A and h_t = exp(dA_t) h_(t-1) + dt_t B_t x_t, every h_t is the start state
        decayed by exp(sum dA_1..t) plus each position s <= t's input decayed by
        exp(sum dA_(s+1)..t): one masked matrix per head, no loop over positions."""
        length = x.shape[1]
        projected = mixer.in_proj(x)[0]
        gate, xbc, dt = projected.split(
            [mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1
        )
        tail = self.conv[i][slot]  # [conv_dim, kernel - 1]
        window = torch.cat([tail, xbc.transpose(0, 1)], dim=-1)  # [conv_dim, kernel - 1 + P]
        self.conv[i][slot] = window[:, -tail.shape[-1] :]
        xbc = F.conv1d(window[None], mixer.conv1d.weight, mixer.conv1d.bias, groups=window.shape[0])
        xbc = mixer.act(xbc[0].transpose(0, 1))  # [P, conv_dim]
        heads, head_dim, state_size = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size
        groups = mixer.n_groups
        states, b, c = torch.split(
            xbc,
            [mixer.intermediate_size, groups * state_size, groups * state_size],
            dim=-1,
        )
        states = states.view(length, heads, head_dim).float()
        b = b.view(length, groups, 1, state_size).expand(
            length, groups, heads // groups, state_size
        )
        b = b.reshape(length, heads, state_size).float()
        c = c.view(length, groups, 1, state_size).expand(
            length, groups, heads // groups, state_size
        )
        c = c.reshape(length, heads, state_size).float()
        a = -torch.exp(mixer.A_log.float())
        dt = F.softplus(dt + mixer.dt_bias)
        low, high = mixer.time_step_limit
        dt = torch.clamp(dt, low, high).float()  # [P, heads]
        decay_step = (dt * a).transpose(0, 1)  # [heads, P]
        # segment sums: [h, t, s] = sum of decay_step[h, s+1 .. t] for s <= t (-inf above)
        repeated = decay_step[:, :, None].expand(heads, length, length)
        below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), -1)
        segments = torch.cumsum(repeated.masked_fill(~below, 0.0), dim=1)
        upto = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device))
        mix = torch.exp(segments.masked_fill(~upto, float("-inf")))  # [h, t, s]
        start = self.ssm[i][slot].float()  # [heads, head_dim, state]
        from_start = torch.exp(torch.cumsum(decay_step, dim=1))  # [h, t]
        inputs = states * dt[:, :, None]  # [P, heads, head_dim]: dt_s x_s
        scores = torch.einsum("thn,shn->hts", c, b) * mix
        y = torch.einsum("hts,shd->thd", scores, inputs)
        y = y + torch.einsum("thn,hdn->thd", c, start) * from_start.transpose(0, 1)[:, :, None]
        last = mix[:, -1, :]  # [h, s]: decay from s to the chunk's last position
        end = start * from_start[:, -1, None, None] + torch.einsum(
            "hs,shd,shn->hdn", last, inputs, b
        )
        self.ssm[i][slot] = end.to(self.ssm[i].dtype)
        y = y.to(x.dtype) + states.to(x.dtype) * mixer.D[:, None]
        y = y.reshape(1, length, heads * head_dim)
        y = mixer.norm(y, gate[None])
        return mixer.out_proj(y.to(x.dtype))

    def _attention_chunk(self, i: int, mixer: Any, x: Tensor, slot: int, start: int) -> Tensor:
        length = x.shape[1]
        query = mixer.q_proj(x).view(1, length, -1, mixer.head_dim).transpose(1, 2)
        key = mixer.k_proj(x).view(1, length, -1, mixer.head_dim).transpose(1, 2)
        value = mixer.v_proj(x).view(1, length, -1, mixer.head_dim).transpose(1, 2)
        end = start + length
        self.keys[i][slot, :, start:end] = key[0]
        self.values[i][slot, :, start:end] = value[0]
        keys = self.keys[i][slot : slot + 1, :, :end]
        values = self.values[i][slot : slot + 1, :, :end]
        groups = mixer.num_key_value_groups
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        # position start + t sees every key up to itself
        visible = torch.arange(end, device=x.device)[None, :] <= (
            start + torch.arange(length, device=x.device)[:, None]
        )
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible[None, None], scale=mixer.scaling
        )
        return mixer.o_proj(attended.transpose(1, 2).reshape(1, length, -1))

    def _mamba(self, i: int, mixer: Any, x: Tensor, rows: Tensor) -> Tensor:
        """Mamba-2's recurrent form for one token (the HF mixer's own torch path), with the
        step size clamped as its chunked scan clamps it (`time_step_limit`), so a streamed
        step equals the full-sequence forward."""
        batch = x.shape[0]
        projected = mixer.in_proj(x)[:, 0]
        gate, xbc, dt = projected.split(
            [mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1
        )
        conv_state = self.conv[i][rows]
        window = torch.cat([conv_state, xbc.unsqueeze(-1)], dim=-1)
        self.conv[i][rows] = window[:, :, 1:]
        xbc = (window * mixer.conv1d.weight.squeeze(1)).sum(-1)
        if mixer.conv1d.bias is not None:
            xbc = xbc + mixer.conv1d.bias
        xbc = mixer.act(xbc)
        states, b, c = torch.split(
            xbc,
            [
                mixer.intermediate_size,
                mixer.n_groups * mixer.ssm_state_size,
                mixer.n_groups * mixer.ssm_state_size,
            ],
            dim=-1,
        )
        a = -torch.exp(mixer.A_log.float())
        dt = F.softplus(dt + mixer.dt_bias)
        low, high = mixer.time_step_limit
        dt = torch.clamp(dt, low, high)
        heads, head_dim, state_size = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size
        groups = mixer.n_groups
        states = states.view(batch, heads, head_dim)
        b = b.view(batch, groups, 1, state_size).expand(batch, groups, heads // groups, state_size)
        b = b.reshape(batch, heads, state_size)
        c = c.view(batch, groups, 1, state_size).expand(batch, groups, heads // groups, state_size)
        c = c.reshape(batch, heads, state_size)
        decay = torch.exp(dt.float() * a)[:, :, None, None]
        ssm = (
            self.ssm[i][rows].float() * decay
            + (dt[:, :, None, None] * b[:, :, None, :] * states[..., None]).float()
        )
        self.ssm[i][rows] = ssm.to(self.ssm[i].dtype)
        y = torch.einsum("bhds,bhs->bhd", ssm.to(c.dtype), c)
        y = y + states * mixer.D[:, None]
        y = y.reshape(batch, 1, heads * head_dim)
        y = mixer.norm(y, gate.unsqueeze(1))
        return mixer.out_proj(y.to(x.dtype))

    def _attention(self, i: int, mixer: Any, x: Tensor, rows: Tensor, positions: Tensor) -> Tensor:
        batch = x.shape[0]
        query = mixer.q_proj(x).view(batch, 1, -1, mixer.head_dim).transpose(1, 2)
        key = mixer.k_proj(x).view(batch, 1, -1, mixer.head_dim).transpose(1, 2)
        value = mixer.v_proj(x).view(batch, 1, -1, mixer.head_dim).transpose(1, 2)
        self.keys[i][rows, :, positions] = key[:, :, 0]
        self.values[i][rows, :, positions] = value[:, :, 0]
        span = int(positions.max()) + 1
        keys = self.keys[i][rows, :, :span]
        values = self.values[i][rows, :, :span]
        groups = mixer.num_key_value_groups
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        visible = torch.arange(span, device=x.device)[None, :] <= positions[:, None]
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible[:, None, None, :], scale=mixer.scaling
        )
        return mixer.o_proj(attended.transpose(1, 2).reshape(batch, 1, -1))

    def export(self, slot: int) -> dict[str, Tensor]:
        """The slot's state (for `bench` and tests: its size per position)."""
        state: dict[str, Tensor] = {}
        for i in self.conv:
            state[f"conv{i}"], state[f"ssm{i}"] = self.conv[i][slot], self.ssm[i][slot]
        n = int(self.length[slot])
        for i in self.keys:
            state[f"k{i}"], state[f"v{i}"] = self.keys[i][slot, :, :n], self.values[i][slot, :, :n]
        return state


# ---------------------------------------------------------------- the whole model


@dataclasses.dataclass
class SlotTokens:
    """What one slot has said and heard so far that the next positions read (small)."""

    position: int = 0
    text: int = 0
    asr: int = 0
    #: the speech decoder's previous subword and codes, its backbone's keys and values per
    #: layer ([rows, heads, length, dim]: rows 2 with classifier-free guidance) and the
    #: position of its next token (None: it has not started)
    tts_prev_subword: Tensor | None = None
    tts_code: Tensor | None = None
    tts_kv: list[tuple[Tensor, Tensor]] | None = None
    tts_position: int = 0
    #: the last `decode_window` frames of codes (the codec decodes over them)
    codes: deque[Tensor] = dataclasses.field(default_factory=deque)
    #: the recent text and ASR tokens forced turn taking looks back over
    recent_text: deque[int] = dataclasses.field(default_factory=deque)
    recent_asr: deque[int] = dataclasses.field(default_factory=deque)


@dataclasses.dataclass
class PositionOut:
    """One position's outputs for one slot."""

    text: int
    asr: int
    function: int | None
    #: the speech decoder's codes (None: a position it does not step, a prompt's)
    codes: Tensor | None
    audio: Tensor | None


@dataclasses.dataclass
class ReplayedFrame:
    """One frame of a restored history, as its record gives it: what the frame heard and
    what the model said (nothing is chosen again)."""

    #: the frame's input audio [1280]
    audio: Tensor
    #: tool-result tokens fed as positions before the frame
    injected: list[int]
    text: int
    asr: int
    #: the speech decoder's codes [Q]
    codes: Tensor


class StreamingVoiceChat:
    """NemotronVoiceChat's duplex loop, one position per call, for `slots` slots."""

    def __init__(self, model: Any, slots: int, decode_window: int, guidance: bool = True) -> None:
        self.model = model
        self.stt = model.stt_model
        self.tts = model.tts_model
        self.slots = slots
        self.device = next(model.parameters()).device
        self.decode_window = decode_window
        self.guidance = guidance
        self.perception = StreamingPerception(self.stt.perception, slots, self.device)
        self.llm = NemotronHStep(self.stt.llm, slots, self.device)
        cfg = self.stt.cfg
        self.user_weight = float(cfg.get("duplex_user_channel_weight", 1.0))
        self.text_weight = float(cfg.get("duplex_text_channel_weight", 1.0))
        self.asr_weight = float(cfg.get("duplex_asr_text_weight", 1.0))
        self.predict_asr = bool(self.stt.predict_user_text)
        self.pad = int(self.stt.text_pad_id)
        self.bos = int(self.stt.text_bos_id)
        self.eos = int(self.stt.text_eos_id)
        self.user_eos = int(self.stt.tokenizer.eos)
        self.force_turn_taking = bool(cfg.get("force_turn_taking", False))
        self.turn_threshold = int(cfg.get("force_turn_taking_threshold", 40))
        self.turn_pad_window = int(cfg.get("force_turn_taking_pad_window", 25))
        #: the function channel's head, or None (checkpoint.py sets it either way)
        self.function_head = self.stt.function_head
        self.generation = self.tts._get_generation_config(guidance)
        self.state = [SlotTokens() for _ in range(slots)]
        self._tts_init: tuple[list[tuple[Tensor, Tensor]], Tensor, Tensor, int] | None = None

    # ------------------------------------------------------------ the speech decoder's start

    @torch.no_grad()
    def set_speaker(self, speaker_audio: Tensor | None, speaker_name: str | None) -> None:
        """The voice: the TTS warm-up every slot starts from (computed once, then copied)."""
        lens = None
        if speaker_audio is not None:
            speaker_audio = speaker_audio.to(self.device).reshape(1, -1)
            lens = torch.tensor([speaker_audio.shape[1]], device=self.device)
        self.tts.set_init_inputs(
            speaker_audio=speaker_audio, speaker_audio_lens=lens, speaker_name=speaker_name
        )
        inputs = self.tts.get_init_inputs(B=1)
        inputs.update(
            {"use_cache": True, "past_key_values": None, "guidance_enabled": self.guidance}
        )
        outputs = self.tts.tts_model(**inputs)
        cache = outputs.past_key_values
        self._tts_init = (
            [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers],
            inputs["code"][:, -1:].clone(),
            inputs["subword_ids"][:, -1].unsqueeze(-1).clone(),
            int(inputs["code"].shape[1]),
        )

    def reset(self, slot: int) -> None:
        self.perception.reset(slot)
        self.llm.reset(slot)
        self.state[slot] = SlotTokens()

    # ------------------------------------------------------------ one position

    def _input(self, slot: int, user: Tensor) -> Tensor:
        """Position t's input as `DuplexSTTStreamingInference` builds it."""
        state = self.state[slot]
        x = user * self.user_weight
        if state.position == 0:
            x = x + self.stt._get_bos_embedding()[0] * self.text_weight
            if self.predict_asr:
                x = x + self.stt._get_asr_bos_embedding()[0] * self.asr_weight
        else:
            token = torch.tensor([state.text], device=self.device)
            x = x + self.stt.embed_tokens(token)[0] * self.text_weight
            if self.predict_asr:
                asr = torch.tensor([state.asr], device=self.device)
                x = x + self.stt.embed_asr_tokens(asr)[0] * self.asr_weight
        return x

    @torch.no_grad()
    def prefill_prompt(self, slot: int, tokens: list[int]) -> None:
        """A fresh slot's prompt positions in one forward: their inputs are known in advance
        (the text and ASR channels are pad at prompt positions, so each position's previous
        tokens are too), so NeMo's prompt positions need no step-by-step loop."""
        state = self.state[slot]
        if state.position != 0 or not tokens:
            raise ValueError("a prompt is the first thing a fresh slot hears")
        ids = torch.tensor(tokens, device=self.device)
        x = self.stt.embed_tokens(ids) * self.user_weight
        x[0] = x[0] + self.stt._get_bos_embedding()[0] * self.text_weight
        pad = torch.tensor([self.pad], device=self.device)
        if len(tokens) > 1:
            x[1:] = x[1:] + self.stt.embed_tokens(pad)[0] * self.text_weight
        if self.predict_asr:
            x[0] = x[0] + self.stt._get_asr_bos_embedding()[0] * self.asr_weight
            if len(tokens) > 1:
                x[1:] = x[1:] + self.stt.embed_asr_tokens(pad)[0] * self.asr_weight
        self.llm.prefill(slot, x)
        state.position = len(tokens)
        state.text = state.asr = self.pad
        state.recent_text.extend([self.pad] * min(len(tokens), self.turn_threshold + 1))
        state.recent_asr.extend([self.pad] * min(len(tokens), self.turn_pad_window + 2))

    def can_replay(self, slot: int) -> bool:
        """Whether `replay` may take the slot's next frames: past its first two (the encoder
        chunks those differently, and the speech decoder starts at the first)."""
        return self.perception.can_extend(slot) and self.state[slot].tts_kv is not None

    @torch.no_grad()
    def replay(self, slot: int, frames: list[ReplayedFrame]) -> None:
        """A restored history's next frames in one forward of each part, equal to stepping
        them one by one with their tokens and codes forced (up to float rounding): every
        input is in the records, so the perception takes the frames' audio at once, the LLM
        every position (tool-result tokens and frames) in one `extend`, the speech decoder
        every frame in one backbone call with the cache. Nothing is sampled, no head runs,
        the codec decodes nothing (the slot's decoding window is refilled)."""
        if not frames:
            return
        if not self.can_replay(slot):
            raise ValueError(f"slot {slot} is in its first two frames: step them one by one")
        state = self.state[slot]
        audio = torch.stack([frame.audio for frame in frames]).to(self.device)
        heard = self.perception.extend(slot, audio)  # [M, H]
        # the LLM's positions in order: each frame's tool-result tokens, then the frame;
        # each position reads the text and ASR tokens of the one before it
        tokens: list[int] = []
        token_at: list[int] = []  # per position: its index in `tokens`, or -1 (a frame)
        frame_at: list[int] = []  # per position: its frame, or -1 (a token)
        previous_text: list[int] = []
        previous_asr: list[int] = []
        for index, frame in enumerate(frames):
            for token in frame.injected:
                token_at.append(len(tokens))
                frame_at.append(-1)
                tokens.append(token)
                previous_text.append(state.text)
                previous_asr.append(state.asr)
                self._said(state, self.pad, self.pad)
            token_at.append(-1)
            frame_at.append(index)
            previous_text.append(state.text)
            previous_asr.append(state.asr)
            self._said(state, frame.text, frame.asr)
        users = heard
        if tokens:
            embedded = self.stt.embed_tokens(torch.tensor(tokens, device=self.device))
            rows = [
                embedded[t] if t >= 0 else heard[f] for t, f in zip(token_at, frame_at, strict=True)
            ]
            users = torch.stack(rows)
        x = users * self.user_weight
        x = x + self.stt.embed_tokens(torch.tensor(previous_text, device=self.device)) * (
            self.text_weight
        )
        if self.predict_asr:
            asr = torch.tensor(previous_asr, device=self.device)
            x = x + self.stt.embed_asr_tokens(asr) * self.asr_weight
        self.llm.extend(slot, x)
        codes = [frame.codes.to(self.device) for frame in frames]
        self._tts_extend(slot, [frame.text for frame in frames], codes)
        for code in codes:
            state.codes.append(code)
            while len(state.codes) > self.decode_window:
                state.codes.popleft()

    def _said(self, state: SlotTokens, text: int, asr: int) -> None:
        """A position's tokens into the slot's state (what the next position reads, and the
        windows forced turn taking looks back over)."""
        state.recent_text.append(text)
        state.recent_asr.append(asr)
        while len(state.recent_text) > self.turn_threshold + 1:
            state.recent_text.popleft()
        while len(state.recent_asr) > self.turn_pad_window + 2:
            state.recent_asr.popleft()
        state.text, state.asr = text, asr
        state.position += 1

    def _logits(self, hidden: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """DuplexSTTModel.forward's heads and inference boosts, on final hidden states."""
        cfg = self.stt.cfg
        text = self.stt.lm_head(hidden)
        if cfg.get("inference_pad_boost", None):
            text[:, self.pad] += cfg.inference_pad_boost
        if cfg.get("inference_bos_boost", None):
            text[:, self.bos] += cfg.inference_bos_boost
        if cfg.get("inference_eos_boost", None):
            text[:, self.eos] += cfg.inference_eos_boost
        asr = self.stt.asr_head(hidden) if self.predict_asr else None
        function = self.function_head(hidden) if self.function_head is not None else None
        return text, asr, function

    def _turn_taking(self, slot: int, text: int, asr: int) -> int:
        """`_maybe_apply_forced_turn_taking` for one slot (its windows kept as deques)."""
        state = self.state[slot]
        t = state.position
        if t < self.turn_pad_window:
            return text
        recent_asr = list(state.recent_asr)[-self.turn_pad_window :]
        pad_window = len(recent_asr) > 0 and all(a == self.pad for a in recent_asr)
        if pad_window:
            before = list(state.recent_asr)[-self.turn_pad_window - 1 :]
            start = t - self.turn_pad_window
            pad_window = start > 0 and len(before) > self.turn_pad_window and before[0] != self.pad
        agent_window = list(state.recent_text)[-self.turn_threshold :]
        if asr == self.user_eos or pad_window:
            if self.bos not in agent_window:
                return self.bos
        elif asr == self.bos and self.eos not in agent_window:
            return self.eos
        return text

    @torch.no_grad()
    def step(
        self,
        slots: list[int],
        user: Tensor,
        *,
        prompt: list[bool] | None = None,
        forced: list[dict[str, Any] | None] | None = None,
        speak: bool = True,
        decode: bool = True,
    ) -> list[PositionOut]:
        """One position for each slot in `slots`. `user` [B, H]: the user channel (the
        perception's output, or a prompt token's embedding at a prompt position: then the
        text and ASR channels are pad, as NeMo fills them). `forced[i]`: the tokens and codes
        of a replayed position (a restore): the model is fed them instead of choosing.
        `speak` False: the speech decoder does not step (prompt and tool-result positions:
        it starts at the conversation's first frame)."""
        prompt = prompt or [False] * len(slots)
        forced = forced or [None] * len(slots)
        embeds = torch.stack([self._input(s, user[i]) for i, s in enumerate(slots)])
        hidden = self.llm.step(slots, embeds)
        text_logits, asr_logits, fn_logits = self._logits(hidden)
        text_ids = text_logits.argmax(-1).tolist()
        asr_ids = (
            asr_logits.argmax(-1).tolist() if asr_logits is not None else [self.pad] * len(slots)
        )
        fn_ids = fn_logits.argmax(-1).tolist() if fn_logits is not None else None
        outs: list[PositionOut] = []
        forced_codes: list[Tensor | None] = []
        for i, slot in enumerate(slots):
            state = self.state[slot]
            text, asr = text_ids[i], asr_ids[i]
            function = fn_ids[i] if fn_ids is not None else None
            if prompt[i]:
                text, asr, function = self.pad, self.pad, None
            elif self.predict_asr and self.force_turn_taking:
                text = self._turn_taking(slot, text, asr)
            replay = forced[i]
            if replay is not None:
                text = replay.get("text", text)
                asr = replay.get("asr", asr)
                function = replay.get("function", function)
            forced_codes.append(replay.get("codes") if replay is not None else None)
            self._said(state, text, asr)
            outs.append(PositionOut(text, asr, function, None, None))
        if speak:
            codes = self._speak(slots, [o.text for o in outs], forced_codes)
            for out, code in zip(outs, codes, strict=True):
                out.codes = code
            if decode:
                self.decode(slots, outs)
        return outs

    # ------------------------------------------------------------ the speech decoder

    def _speak(
        self, slots: list[int], texts: list[int], forced: list[Tensor | None]
    ) -> list[Tensor]:
        """The speech decoder's step for these positions (offline_inference's TTS loop: the
        warm-up at a slot's first position, then one step per position with the previous
        subword), the slots that generate in one batched call; a replayed position's codes
        are given (its backbone is fed them, nothing is sampled)."""
        codes: list[Tensor | None] = [None] * len(slots)
        generate: list[int] = []
        for i, slot in enumerate(slots):
            state = self.state[slot]
            if state.tts_kv is None:
                assert self._tts_init is not None, "set_speaker first"
                kv, code, first_subword, position = self._tts_init
                state.tts_kv = [(k.clone(), v.clone()) for k, v in kv]
                state.tts_code, state.tts_prev_subword = code.clone(), first_subword.clone()
                state.tts_position = position
                codes[i] = torch.zeros(code.shape[-1], dtype=torch.long, device=self.device)
            elif forced[i] is not None:
                self._tts_run([slot], [texts[i]], generate=False)
                given = forced[i]
                assert given is not None
                state.tts_code = given.view(1, 1, -1).to(self.device)
                codes[i] = state.tts_code.view(-1)
            else:
                generate.append(i)
        if generate:
            made = self._tts_run([slots[i] for i in generate], [texts[i] for i in generate])
            for i, code in zip(generate, made, strict=True):
                codes[i] = code
        out: list[Tensor] = []
        for i, slot in enumerate(slots):
            code = codes[i]
            assert code is not None
            state = self.state[slot]
            state.codes.append(code)
            while len(state.codes) > self.decode_window:
                state.codes.popleft()
            out.append(code)
        return out

    def _tts_inputs(
        self, current: Tensor, previous: Tensor, prev_codes: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """The speech decoder's inputs besides the words (`current` [B, T]): the previous
        codes [B, T, Q] silenced where the word is EOS (NeMo's
        `inference_force_speech_silence_on_eos`), and the previous words' embeddings as
        context where the decoder takes them (else None)."""
        tts = self.tts
        if tts.cfg.get("inference_force_speech_silence_on_eos", True):
            silence = tts.codec_silence_tokens.view(1, 1, -1).expand(prev_codes.shape)
            prev_codes = torch.where(current.unsqueeze(-1) == tts.text_eos_id, silence, prev_codes)
        context = None
        if tts.cfg.tts_config.context_hidden_size is not None:
            context = tts.embed_tokens(previous)
        return prev_codes, context

    def _tts_run(self, slots: list[int], texts: list[int], generate: bool = True) -> list[Tensor]:
        """One step of the speech decoder's backbone for `slots` in one batch (their caches
        left-padded to one length, each row at its own position), generating codes (else
        fed: a replay's codes are the record's, set by the caller). Returns the codes."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicSlidingWindowLayer

        tts = self.tts
        states = [self.state[s] for s in slots]
        batch = len(slots)
        current = torch.tensor([[t] for t in texts], device=self.device)
        previous = torch.cat([st.tts_prev_subword for st in states], dim=0)  # type: ignore[misc]
        prev_codes = torch.cat([st.tts_code for st in states], dim=0)  # type: ignore[misc]
        prev_codes, context = self._tts_inputs(current, previous, prev_codes)
        # the batch's cache, every slot's keys and values left-padded per layer: a
        # full-attention layer holds a slot's every position, a sliding-window one only its
        # last window - 1 (as HF's own cache keeps them), so lengths differ per layer
        kvs = [st.tts_kv for st in states]
        assert all(kv is not None for kv in kvs)
        positions_now = [st.tts_position for st in states]
        past = max(positions_now)  # the longest slot's past: the attention mask's length
        backbone = tts.tts_model.backbone
        cache = DynamicCache(config=backbone.config)
        for layer in range(len(kvs[0])):  # type: ignore[arg-type]
            keys, values = [], []
            lengths = [kv[layer][0].shape[-2] for kv in kvs]  # type: ignore[index]
            longest = max(lengths)
            rows = kvs[0][layer][0].shape[0]  # type: ignore[index]
            for row in range(rows):  # all slots' row 0 (conditional), then row 1
                for kv, length in zip(kvs, lengths, strict=True):
                    k, v = kv[layer]  # type: ignore[index]
                    keys.append(F.pad(k[row], (0, 0, longest - length, 0)))
                    values.append(F.pad(v[row], (0, 0, longest - length, 0)))
            stored = cache.layers[layer]
            stored.update(torch.stack(keys), torch.stack(values))
            if isinstance(stored, DynamicSlidingWindowLayer):
                # a sliding layer's mask is cut from the batch's full past (HF counts it
                # from the tokens the layer has seen, which its stored tail understates)
                stored.cumulative_length = past
        attention = torch.zeros(batch, past + 1, dtype=torch.long, device=self.device)
        for b, position in enumerate(positions_now):
            attention[b, past - position :] = 1
        positions = torch.tensor([[p] for p in positions_now], device=self.device)
        outputs = tts.tts_model(
            code=prev_codes,
            context_hidden_state=context,
            subword_ids=current,
            subword_mask=torch.ones(batch, 1, dtype=torch.bool, device=self.device),
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            guidance_enabled=self.guidance,
            generation_config=self.generation if generate else None,
            ignore_eos_flag_stop=True,
        )
        new_cache = outputs.past_key_values
        codes = outputs.codes if generate else None
        for b, state in enumerate(states):
            kept = []
            for stored in new_cache.layers:
                rows = stored.keys.shape[0] // batch
                index = torch.tensor([r * batch + b for r in range(rows)], device=self.device)
                # a full layer: the slot's every position; a sliding one: at most its tail
                take = min(positions_now[b] + 1, stored.keys.shape[-2])
                kept.append(
                    (
                        stored.keys.index_select(0, index)[:, :, -take:].clone(),
                        stored.values.index_select(0, index)[:, :, -take:].clone(),
                    )
                )
            state.tts_kv = kept
            state.tts_position += 1
            state.tts_prev_subword = current[b : b + 1]
            if codes is not None:
                state.tts_code = codes[b : b + 1]
        if codes is None:
            return []
        return [codes[b].view(-1) for b in range(batch)]

    def _tts_extend(self, slot: int, texts: list[int], codes: list[Tensor]) -> None:
        """The speech decoder's backbone over a replay's M frames of one slot in one call,
        from the slot's cache: position j reads frame j's text and frame j - 1's codes (the
        previous subword and codes of `_tts_run`, all given), so the M steps are one causal
        forward of M positions."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicSlidingWindowLayer

        tts = self.tts
        state = self.state[slot]
        assert state.tts_kv is not None and state.tts_code is not None
        assert state.tts_prev_subword is not None
        length = len(texts)
        current = torch.tensor([texts], device=self.device)  # [1, M]
        previous = torch.cat([state.tts_prev_subword, current[:, :-1]], dim=1)
        given = torch.stack(codes)[None]  # [1, M, Q]
        prev_codes = torch.cat([state.tts_code, given[:, :-1]], dim=1)
        prev_codes, context = self._tts_inputs(current, previous, prev_codes)
        past = state.tts_position
        cache = DynamicCache(config=tts.tts_model.backbone.config)
        for layer, (keys, values) in enumerate(state.tts_kv):
            stored = cache.layers[layer]
            stored.update(keys, values)
            if isinstance(stored, DynamicSlidingWindowLayer):
                stored.cumulative_length = past  # its tail is shorter than its past
        outputs = tts.tts_model(
            code=prev_codes,
            context_hidden_state=context,
            subword_ids=current,
            subword_mask=torch.ones(1, length, dtype=torch.bool, device=self.device),
            attention_mask=torch.ones(1, past + length, dtype=torch.long, device=self.device),
            position_ids=torch.arange(past, past + length, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
            guidance_enabled=self.guidance,
            generation_config=None,
            ignore_eos_flag_stop=True,
        )
        kept = []
        for stored in outputs.past_key_values.layers:
            take = min(past + length, stored.keys.shape[-2])
            kept.append((stored.keys[:, :, -take:].clone(), stored.values[:, :, -take:].clone()))
        state.tts_kv = kept
        state.tts_position = past + length
        state.tts_prev_subword = current[:, -1:]
        state.tts_code = given[:, -1:]

    def decode(self, slots: list[int], outs: list[PositionOut]) -> None:
        """NeMo's incremental decoding of each slot's newest frame, batched by window length."""
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            groups.setdefault(len(self.state[slot].codes), []).append(i)
        for _, members in groups.items():
            history = torch.stack([torch.stack(list(self.state[slots[i]].codes)) for i in members])
            audio, _ = self.tts.decode_one_audio_step(
                history, number_prev_tokens=self.decode_window
            )
            for j, i in enumerate(members):
                outs[i].audio = audio[j]
