"""A Moshi slot's memory as a token history, and its rebuild by replay.

What one step feeds the LM is a pure function of 17 tokens a frame (for Moshi's 8 + 8
codebooks): the text token and the 8 audio tokens the step produced (as LMGen's hooks see
them: after any forcing, in the delayed layout LMGen caches), and the 8 user codes it was
given. The depformer keeps nothing between frames. So a slot's record per frame is those
tokens and one more field, the barge-in's, all little-endian uint16 (36 bytes for Moshi):

    text, audio[dep_q], user[K - 1 - dep_q]   the tokens (K = the LM's codebooks)
    silence                                   the frames of a barge-in's forced silence
                                              left when the step ran, this step included
                                              (0: none; a step of the prompt, which a
                                              barge-in does not cut: the silence waiting
                                              for the prompt's end)

The silence field is never fed to the LM: it is the slot's one piece of state outside the
LM that a restore needs (a history ending inside a barge-in's silence goes on silent for
the frames left, as the original does; and a step with silence > 0 outside the prompt was
a silenced one, which is what the speaking hold needs to know). A slot's whole LM state
after T steps follows from its T records (and whatever prefix its options give, a `.pt`
voice's embeddings):

- `lm_inputs` rebuilds what LMGen fed the transformer at each step (its token cache read
  at the step's offset, initial tokens while a codebook's delay has not passed);
- `SideReplay` runs those inputs through the transformer in chunks, in a *side* batch of
  one, and copies the finished row into the slot's row of the shared batch. Never in the
  shared batch itself: a forward of more than one frame there writes every row's key/value
  ring at T positions (masked rows too: moshi's `RingKVCache.complete` scatters for all
  rows, only the offsets honour the exec mask), which corrupts a neighbour whose ring has
  wrapped. Each `work(frames)` call forwards exactly the frames it is asked for (at most
  `chunk`, the model's `replay_chunk_frames`; all that are left when fewer are), across the
  end of one segment (a `.pt` voice's embeddings) into the next (the history's tokens): the
  stage sizes the calls to the tick's spare time by what a frame costs. The side ring holds
  context + chunk - 1 positions, so the first frame of any forward of at most `chunk`
  frames still sees its whole context; past the model's context, chunked forwards of any
  sizes stay exact;
- `lmgen_columns` is LMGen's token cache as the last step left it.

Not rebuilt: Mimi's encoder and decoder (the slot's are reset; the decoder is warmed on the
last frames' tokens by the frame model) and the sampler's random state (greedy decoding is
exact; sampled decoding goes on from the same context with fresh randomness).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from moshi.models.lm import LMModel
from moshi.modules.transformer import (
    RingKVCache,
    StreamingMultiheadAttention,
    _MHAState,
    _TransformerState,
)

#: a record's fields are stored as uint16: every token id (and silence) must be below this
TOKEN_LIMIT = 1 << 16


def record_fields(lm: LMModel) -> int:
    """uint16 fields of one frame's record: text, the model's audio codebooks, the user's,
    then the barge-in's silence."""
    return lm.num_codebooks + 1


def record_bytes(lm: LMModel) -> int:
    """Bytes of one frame's record."""
    return 2 * record_fields(lm)


def encode_records(tokens: np.ndarray, silence: np.ndarray | None = None) -> bytes:
    """[frames, K] int tokens and [frames] silence (None: no barge-in) -> the records'
    bytes."""
    tokens = np.asarray(tokens)
    frames = tokens.shape[0]
    silence = np.zeros(frames, np.int64) if silence is None else np.asarray(silence)
    if silence.shape != (frames,):
        raise ValueError(f"{frames} frames of tokens, silence of shape {silence.shape}")
    fields = np.concatenate([tokens.reshape(frames, -1), silence[:, None]], axis=1)
    if fields.size and (fields.min() < 0 or fields.max() >= TOKEN_LIMIT):
        raise ValueError("a record holds tokens 0..65535 only")
    return np.ascontiguousarray(fields, dtype="<u2").tobytes()


def decode_records(data: bytes, codebooks: int) -> tuple[np.ndarray, np.ndarray]:
    """The records' bytes (of an LM with `codebooks` codebooks) -> their tokens [frames, K]
    and silence [frames], int64."""
    width = 2 * (codebooks + 1)
    if len(data) % width:
        raise ValueError(f"a history of {len(data)} bytes is not whole {width}-byte records")
    fields = np.frombuffer(data, dtype="<u2").reshape(-1, codebooks + 1).astype(np.int64)
    return fields[:, :codebooks], fields[:, codebooks]


def check_records(tokens: np.ndarray, silence: np.ndarray, lm: LMModel, prompt: int) -> None:
    """ValueError unless the records could be this LM's steps (the first `prompt` of them a
    prompt's): every token within its codebook's card, and every step with silence > 0
    past the prompt a silenced one (its text forced to padding). Bytes that are not this
    layout's records (another version's, read in this one's width) fail it."""
    cards = np.full(tokens.shape[1], lm.card, dtype=np.int64)
    cards[0] = lm.text_card
    if (tokens > cards).any():
        frame = int(np.flatnonzero((tokens > cards).any(axis=1))[0])
        raise ValueError(f"not this model's records: frame {frame} has a token past its card")
    silenced = np.flatnonzero(silence[prompt:] > 0) + prompt
    if (tokens[silenced, 0] != lm.text_padding_token_id).any():
        raise ValueError("not this model's records: a silenced frame's text is not padding")


def lm_inputs(
    records: np.ndarray,
    lm: LMModel,
    start: int = 0,
    before: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """[K, T] the tokens LMGen fed the transformer at steps start..start+T-1 of a slot
    whose records are `records` (frame i of the records is step start + i).

    LMGen's cache column at offset o holds, for the text and the model's audio (k <=
    dep_q), what step o - 1 produced, and for a user codebook with delay d the codes step
    o - d was given; a codebook whose delay has not passed (o <= d) reads its initial
    token. What steps before `start` wrote (a prefix replayed from embeddings, which has
    no records) comes from `before`: cache position -> [K] tokens, as `lmgen_columns`
    gives them."""
    frames, width = records.shape
    delays = list(lm.delays)
    if width != len(delays):
        raise ValueError(f"records of {width} tokens, the model has {len(delays)} codebooks")
    initial = lm._get_initial_token()[0, :, 0].cpu().numpy()
    steps = np.arange(start, start + frames)
    out = np.empty((width, frames), dtype=np.int64)
    for k, delay in enumerate(delays):
        source = steps - 1 if k <= lm.dep_q else steps - delay
        initial_now = steps <= delay
        recorded = ~initial_now & (source >= start)
        column = np.full(frames, initial[k], dtype=np.int64)
        column[recorded] = records[source[recorded] - start, k]
        for i in np.flatnonzero(~initial_now & ~recorded):  # the first steps after a prefix
            step = int(steps[i])
            if before is None or step not in before:
                raise ValueError(f"step {step} reads a token of step {source[i]}, not given")
            column[i] = before[step][k]
        out[k] = column
    return out


def lmgen_columns(
    records: np.ndarray,
    lm: LMModel,
    offset: int,
    length: int,
    before: dict[int, np.ndarray] | None = None,
) -> dict[int, np.ndarray]:
    """LMGen's token cache for a slot whose `offset` steps made `records` (the last record
    is step offset - 1): cache index (0..length-1) -> [K] tokens, each codebook's entry
    the last value written there before step `offset`. A step s writes the text and the
    model's audio at position s + 1 and a user codebook with delay d at s + d, so the entry
    of codebook k at index c comes from the last step s < offset whose position is c
    modulo the cache's length; a step before the records (a prefix replayed from
    embeddings) takes the value from `before` (cache position -> [K] tokens), and one with
    neither (a step before the first, or a prefix's position nobody reads again) leaves
    the entry 0: LMGen reads such an entry only while the codebook's delay has not passed
    (it reads the initial token then) or after the next steps have written it."""
    delays = list(lm.delays)
    first = offset - len(records)
    columns = {index: np.zeros(len(delays), dtype=np.int64) for index in range(length)}
    for k, delay in enumerate(delays):
        lag = 1 if k <= lm.dep_q else delay  # a step s writes codebook k at s + lag
        for index in range(length):
            # the last step s < offset with (s + lag) % length == index
            step = offset - 1 - ((offset - 1 + lag - index) % length)
            if first <= step:
                columns[index][k] = records[step - first, k]
            elif before is not None and step + lag in before:
                columns[index][k] = before[step + lag][k]
    return columns


def decoder_tokens(records: np.ndarray, lm: LMModel, step: int, first: int) -> np.ndarray | None:
    """[dep_q] the audio tokens LMGen output at `step` (what Mimi decodes), from the
    records of steps first.., or None when they are not all there."""
    delays = list(lm.delays)
    max_delay = max(delays)
    out = np.empty(lm.dep_q, dtype=np.int64)
    for k in range(1, lm.dep_q + 1):
        source = step - max_delay + delays[k] - first
        if not 0 <= source < len(records):
            return None
        out[k - 1] = records[source, k]
    return out


@dataclasses.dataclass
class Segment:
    """Inputs to replay: token columns [1, K, T], or input embeddings [1, T, dim]."""

    tokens: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None

    @property
    def frames(self) -> int:
        if self.tokens is not None:
            return int(self.tokens.shape[2])
        assert self.embeddings is not None
        return int(self.embeddings.shape[1])


class SideReplay:
    """One slot's rebuild: its segments forwarded in a batch of one of its own, as many
    frames a call as asked (`work`, at most `chunk`), then its row copied into the shared
    batch (`commit`)."""

    def __init__(self, lm: LMModel, segments: Sequence[Segment], chunk: int) -> None:
        if chunk < 1:
            raise ValueError("a replay chunk is at least one frame")
        self.lm = lm
        self.segments = [s for s in segments if s.frames]
        self.chunk = chunk
        self.total = sum(s.frames for s in self.segments)
        self.done = 0
        self._segment = 0
        self._within = 0
        self._side: dict[str, object] | None = None

    @property
    def left(self) -> int:
        return self.total - self.done

    def work(self, frames: int) -> int:
        """Forward the next min(`frames`, left) frames, the end of one segment and the start
        of the next in one call if they fall in it (a forward each); returns the frames
        left. `frames` is 1..`chunk` (what the side ring is sized for), else ValueError."""
        if not 1 <= frames <= self.chunk:
            raise ValueError(f"a replay call takes 1..{self.chunk} frames, not {frames}")
        take = min(frames, self.left)
        if not take:
            return 0
        lm = self.lm
        main = lm.get_streaming_state()
        if self._side is None:
            self._side = self._side_state(main)
        lm.set_streaming_state(self._side)
        try:
            while take:
                segment = self.segments[self._segment]
                end = min(self._within + take, segment.frames)
                if segment.tokens is not None:
                    lm.forward_text(segment.tokens[:, :, self._within : end])
                else:
                    assert segment.embeddings is not None
                    lm.transformer(segment.embeddings[:, self._within : end])
                take -= end - self._within
                self.done += end - self._within
                self._within = end
                if end == segment.frames:
                    self._segment, self._within = self._segment + 1, 0
        finally:
            lm.set_streaming_state(main)
        return self.left

    def _side_state(self, main: dict[str, object]) -> dict[str, object]:
        """A batch of one, its rings context + chunk - 1 long (a forward of at most `chunk`
        frames sees each frame's whole context); the shared batch's state is
        put back as it was (the same objects: CUDA graphs captured on them stay valid)."""
        lm = self.lm
        lm.set_streaming_state({name: None for name in main})
        try:
            lm.streaming(1)  # never exited: dropped with the replay
            side = lm.get_streaming_state()
        finally:
            # whatever happened (an allocation that failed), the shared batch goes on
            lm.set_streaming_state(main)
        modules = dict(lm.named_modules())
        for name, state in side.items():
            module = modules[name]
            if isinstance(state, _MHAState) and state.kv_cache is not None:
                assert isinstance(module, StreamingMultiheadAttention)
                ring = state.kv_cache
                context = module.context or ring.capacity
                state.kv_cache = RingKVCache(
                    1,
                    ring.cache.shape[2],
                    ring.cache.shape[4],
                    context + self.chunk - 1,
                    respect_exec_mask=True,
                    device=ring.cache.device,
                    dtype=ring.cache.dtype,
                )
        return side

    def commit(self, slot: int) -> None:
        """The replayed row into `slot`'s row of the shared batch: each attention layer's
        last `capacity` keys and values at their ring positions, its end offset and
        offset, and the transformer's offsets. The slot's row was reset before."""
        assert not self.left
        lm, frames = self.lm, self.total
        main = lm.get_streaming_state()
        side = self._side or {}
        for name, state in side.items():
            target = main[name]
            if isinstance(state, _MHAState) and isinstance(target, _MHAState):
                target.offset[slot] = state.offset[0]
                ring, into = state.kv_cache, target.kv_cache
                if ring is None or into is None:
                    continue
                kept = min(frames, into.capacity)
                positions = torch.arange(frames - kept, frames, device=ring.cache.device)
                into.cache[:, slot, :, positions % into.capacity] = ring.cache[
                    :, 0, :, positions % ring.capacity
                ]
                into.end_offset[slot] = frames
            elif isinstance(state, _TransformerState) and isinstance(target, _TransformerState):
                target.offsets[slot] = state.offsets[0]
        self._side = None
