"""`MoshiFrameModel`: Mimi + the Moshi LM + `LMGen` in batched streaming, one row per slot.

One `step` is what kyutai's server (moshi/server.py) does for its one conversation per 80 ms
frame, done for every slot at once: Mimi encodes the frame of user audio to codes, `LMGen`
steps the LM on them and returns the model's text token and audio tokens, Mimi decodes those
to 1920 samples at 24 kHz, and the text token becomes words through the checkpoint's
sentencepiece tokenizer.

Slots share one batch but never each other's state. Every moshi `StreamingModule` keeps its
state per batch row and honours an execution mask (`set_exec_mask`: a masked row's KV cache,
offsets and convolution buffers are left as they were) and a reset mask (`reset_streaming`:
only those rows start over). So an inactive slot is stepped with exec_mask False (computed,
then thrown away) and `open_slot` resets one row. `LMGen` runs with
`support_out_of_sync=True`: its usual "None until the acoustic delay has passed" counts steps
for the whole batch, while here each row has its own start; a row still in its delay gets
`ungenerated` (-2) tokens instead, and that slot outputs empty audio. Mimi's decoder runs
masked to the rows that have audio tokens, so a slot's decoder starts with its first tokens,
as kyutai's server's does.

Per slot, besides its rows of the batch (the LM's and Mimi's streaming state), the model
keeps one record (`_MoshiSlot`, None while the slot is closed): the options it was opened
with, its prompt and how far it has stepped it, its `.pt` prefix, its replay under way, and
its barge-in, encoder and speaking counters. A step builds the masks it needs over the batch
from the records (a handful of slots: cheap); `last_tokens` is the one batch array, the
last step's output tokens, kept for tests and benches.

Memory: every step's output carries the slot's record (the tokens the step fed the LM and
the barge-in's silence it stepped in: plugins/moshi/replay.py), so the session's history
rebuilds the slot elsewhere (`restore_slot`, then `replay_work(slot, frames)` between
steps: exactly the frames the stage asks for, at most `replay_chunk_frames`, a `.pt`
prefix's and the history's counted alike; the call that replays the last frame also
commits the row into the batch and warms its Mimi decoder). A barge-in
(`interrupt_slot`) does not forget: for `interrupt_frames` frames the slot's text is forced
to padding and its audio to the codes of silence (moshi has no interruption handling of
its own: this is what it would have produced had it fallen silent), and it goes on from
there with the whole conversation in its context. Each record says how much of that silence
was left as its step ran, so a slot restored from a history that ends inside it stays silent
for the rest, as the original does.

Batch invariance: with greedy decoding (temperatures 0) a slot's tokens do not depend on who
shares the batch (tests/plugins/moshi prove it on the tiny model). moshi samples with torch's global
generator over the whole batch, so sampled outputs are reproducible for a given batch but not
invariant to its other rows; the tests use greedy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import sentencepiece
import torch
from moshi.models.compression import MimiModel
from moshi.models.lm import LMGen, LMModel
from moshi.modules.streaming import StreamingModule

from plugins.moshi.checkpoint import MoshiCheckpoint
from plugins.moshi.replay import (
    TOKEN_LIMIT,
    Segment,
    SideReplay,
    check_records,
    decode_records,
    decoder_tokens,
    encode_records,
    lm_inputs,
    lmgen_columns,
    record_bytes,
)
from shared.contracts.frame_model import FrameModel, FrameOutput, FrameStepError

#: frames a slot still counts as speaking after its last word. Moshi's text stream is sparse:
#: one token per word piece at the start of the word, padding while the word is voiced and in
#: the short gaps between words. Without a hold the word's own audio (the frames after its
#: token) would be cut off at the stage, which forwards only speaking frames.
SPEAKING_HOLD_FRAMES = 2
#: frames a barge-in keeps the model silent (its text forced to padding, its audio to
#: silence) before it decides again, with the interruption in its context (about 1 s)
INTERRUPT_FRAMES = 12
#: the most frames one `replay_work` call may be asked to replay (the stage asks for what
#: fits the tick's spare time, at most this); the side replay's rings are context + this - 1
REPLAY_CHUNK_FRAMES = 64
#: a restored slot's last frames decoded (and thrown away) to warm its Mimi decoder
DECODER_WARM_FRAMES = 4
#: Mimi's modules on the way from audio to codes (`MimiModel._encode_to_unquantized_latent`)
ENCODER_PARTS = frozenset({"encoder", "encoder_transformer", "downsample"})


@dataclasses.dataclass(frozen=True)
class PromptPrefix:
    """A prompt given as the LM's input embeddings (a PersonaPlex `.pt` voice): replayed
    into the slot before anything else, then LMGen's token cache set to `columns`
    (cache position -> [K] tokens, positions frames..frames + max delay)."""

    embeddings: torch.Tensor  # [frames, dim], the LM's dtype and device
    columns: dict[int, np.ndarray]

    @property
    def frames(self) -> int:
        return int(self.embeddings.shape[0])


@dataclasses.dataclass
class _SlotReplay:
    """A slot being rebuilt: its side replay and what to set once it is done."""

    side: SideReplay
    records: np.ndarray  # [frames, K] of the history (after any prefix)
    first: int  # the step of records[0] (the prefix's frames)
    offset: int  # LMGen's offset once replayed
    columns: dict[int, np.ndarray]  # LMGen's token cache (index -> [K]) to set then


@dataclasses.dataclass(frozen=True)
class PromptFrame:
    """One frame of a prompt stepped before a slot's conversation: the user stream's codes,
    and the model's own text token and audio codes to force (None: the model's own)."""

    user_codes: tuple[int, ...]
    text_token: int | None = None
    model_codes: tuple[int, ...] | None = None


@dataclasses.dataclass
class _MoshiSlot:
    """One open slot's state outside the batch's tensors (the LM's and Mimi's streaming
    state, one row each): what it was opened with and where it is."""

    #: the session's runtime config (`open_slot`'s options)
    options: dict[str, Any]
    #: the preset's prompt (PersonaPlex: voice, persona), stepped before the conversation
    prompt: tuple[PromptFrame, ...] = ()
    #: the prompt's frames stepped so far: `prompt[prompt_at]` is the next
    prompt_at: int = 0
    #: the prompt's input-embedding prefix (a `.pt` voice), replayed before its frames
    prefix: PromptPrefix | None = None
    #: the rebuild under way (the prefix, a restored history): the slot is not stepped
    replay: _SlotReplay | None = None
    #: frames it is still kept silent after a barge-in
    silenced: int = 0
    #: its next step is its first since it started over: Mimi's encoder resets after it
    fresh: bool = True
    #: frames since its last word (past the speaking hold: not speaking)
    quiet: int = 0

    @property
    def prompting(self) -> bool:
        return self.prompt_at < len(self.prompt)

    @property
    def prompt_previous(self) -> tuple[int, ...] | None:
        """The model codes the last prompt frame stepped forced (None before the first)."""
        return self.prompt[self.prompt_at - 1].model_codes if self.prompt_at else None


@dataclasses.dataclass
class _Forcing:
    """This step's forced tokens: `text`/`audio` apply where their mask is True."""

    text_mask: torch.Tensor  # [slots] bool
    text: torch.Tensor  # [slots] long
    audio_mask: torch.Tensor  # [slots] bool
    audio: torch.Tensor  # [slots, dep_q] long


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """`LMGen`'s sampling; a temperature of 0 is greedy (argmax) for that stream."""

    temperature: float = 0.8
    temperature_text: float = 0.7
    top_k: int = 250
    top_k_text: int = 25

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.temperature_text == 0


def default_threads() -> int:
    """CPU threads for torch: the worker's event loop and the stage's model thread share the
    machine, so not all cores (and at most 8: more does not help a one-frame step)."""
    return max(1, min(8, (os.cpu_count() or 2) - 1))


class MoshiFrameModel(FrameModel):
    input_sample_rate_hz = 24_000
    output_sample_rate_hz = 24_000

    def __init__(
        self,
        lm: LMModel,
        mimi: MimiModel,
        tokenizer: sentencepiece.SentencePieceProcessor,
        slots: int,
        sampling: SamplingSettings = SamplingSettings(),
        speaking_hold_frames: int = SPEAKING_HOLD_FRAMES,
        interrupt_frames: int = INTERRUPT_FRAMES,
        replay_chunk_frames: int = REPLAY_CHUNK_FRAMES,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if int(mimi.sample_rate) != self.input_sample_rate_hz:
            raise ValueError(f"Mimi runs at {mimi.sample_rate} Hz, not 24000")
        if not 0 <= interrupt_frames < TOKEN_LIMIT:  # a record's silence field is a uint16
            raise ValueError(f"interrupt_frames is 0..{TOKEN_LIMIT - 1}, not {interrupt_frames}")
        self.lm, self.mimi, self.tokenizer = lm, mimi, tokenizer
        self.slots = slots
        self.device = lm.device
        self.frame_samples = int(mimi.sample_rate / mimi.frame_rate)
        self.sampling = sampling
        self.speaking_hold_frames = speaking_hold_frames
        self.interrupt_frames = interrupt_frames
        self.replay_chunk_frames = replay_chunk_frames
        self.state_record_bytes = record_bytes(lm)
        self.user_codebooks = lm.num_codebooks - lm.dep_q - 1
        self.silence_codes = self._silence_codes()
        self.lm_gen = LMGen(
            lm,
            use_sampling=not sampling.greedy,
            temp=sampling.temperature,
            temp_text=sampling.temperature_text,
            top_k=sampling.top_k,
            top_k_text=sampling.top_k_text,
            support_out_of_sync=True,
            on_text_hook=self._force_text,
            on_audio_hook=self._force_audio,
        )
        #: a preset's prompt for a slot's options (PersonaPlex: voice, persona), stepped
        #: before the conversation one frame per tick alongside the others' steps (never a
        #: stall of the batch): meanwhile the slot's user stream is the prompt's, its text
        #: and audio tokens are forced, and it outputs no audio
        self.prompt_builder: Callable[[Mapping[str, Any]], list[PromptFrame]] | None = None
        #: a preset's prompt given as input embeddings (PersonaPlex `.pt` voices), replayed
        #: before the prompt frames
        self.prefix_builder: Callable[[Mapping[str, Any]], PromptPrefix | None] | None = None
        #: one record per slot, None while it is closed
        self._slots: list[_MoshiSlot | None] = [None] * slots
        #: this step's text and audio tokens as LMGen's hooks saw them (after forcing)
        self._step_text: torch.Tensor | None = None
        self._step_audio: torch.Tensor | None = None
        self._forcing: _Forcing | None = None
        self._silent_ids = {lm.text_padding_token_id, lm.end_of_text_padding_id}
        self._vocab = tokenizer.vocab_size()
        self.mimi.streaming_forever(slots)
        self.lm_gen.streaming_forever(slots)
        #: the last step's output tokens, [slots, 1 + dep_q] (text, then audio; -2: none
        #: yet), a row per slot of the batch (an inactive slot's row is what the step
        #: computed and threw away). Not slot state: the step's output as one array, which
        #: tests and benches read (`last_tokens[slot]`)
        self.last_tokens = np.full((slots, 1 + lm.dep_q), -2, dtype=np.int64)

    @classmethod
    def load(
        cls,
        checkpoint: MoshiCheckpoint,
        slots: int,
        device: str = "cpu",
        sampling: SamplingSettings | None = None,
        threads: int | None = None,
        *,
        interrupt_frames: int = INTERRUPT_FRAMES,
        replay_chunk_frames: int = REPLAY_CHUNK_FRAMES,
    ) -> MoshiFrameModel:
        """The checkpoint's LM, Mimi and tokenizer on `device` (bf16 LM on CUDA, float32 on
        CPU, where bf16 matmuls are slow), with `slots` rows."""
        torch_device = torch.device(device)
        if torch_device.type == "cpu":
            torch.set_num_threads(threads or default_threads())
        dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
        lm = checkpoint.load_lm(torch_device, dtype)
        mimi = checkpoint.load_mimi(torch_device)
        tokenizer = checkpoint.load_tokenizer()
        if sampling is None:
            sampling = sampling_from_config(checkpoint.info.lm_gen_config)
        model = cls(
            lm,
            mimi,
            tokenizer,
            slots,
            sampling,
            interrupt_frames=interrupt_frames,
            replay_chunk_frames=replay_chunk_frames,
        )
        model.warm_up()
        return model

    def warm_up(self, frames: int = 3) -> None:
        """A few steps on silence in every slot, then every slot's rows reset and the slot
        closed: torch's first steps are slow (lazy kernels, allocations), and the first tick
        would be late."""
        zeros = np.zeros((self.slots, self.frame_samples), dtype=np.float32)
        for slot in range(self.slots):
            self.open_slot(slot, {})
        for _ in range(frames):
            self.step(zeros, np.ones(self.slots, dtype=bool))
        for slot in range(self.slots):
            self._restart(slot)
            self.close_slot(slot)

    # ------------------------------------------------------------ slots

    def _mask(self, slot: int) -> torch.Tensor:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
        mask = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
        mask[slot] = True
        return mask

    def _slot(self, slot: int) -> _MoshiSlot:
        """The open slot's record (IndexError out of range, ValueError closed)."""
        state = self._slots[self._check(slot)]
        if state is None:
            raise ValueError(f"slot {slot} is not open")
        return state

    def is_stepping(self, slot: int) -> bool:
        """Whether `slot` is open and done replaying: a step may have it active."""
        state = self._slots[self._check(slot)]
        return state is not None and state.replay is None

    def _restart(self, slot: int) -> None:
        """The open slot starts over as its open left it: its rows of the batch reset, its
        prefix (if any) to replay and its prompt to step again."""
        state = self._slot(slot)
        mask = self._mask(slot)
        self.lm_gen.reset_streaming(mask)
        self.mimi.reset_streaming(mask)
        state.prompt_at = 0
        state.silenced = 0
        state.fresh = True
        state.quiet = self.speaking_hold_frames + 1
        state.replay = None
        prefix = state.prefix
        if prefix is not None:
            segment = Segment(embeddings=prefix.embeddings[None])
            side = SideReplay(self.lm, [segment], self.replay_chunk_frames)
            empty = np.zeros((0, self.lm.num_codebooks), dtype=np.int64)
            columns = lmgen_columns(
                empty, self.lm, prefix.frames, self._cache_length(), prefix.columns
            )
            state.replay = _SlotReplay(side, empty, prefix.frames, prefix.frames, columns)

    def _cache_length(self) -> int:
        """LMGen's token cache's length (its ring of columns)."""
        state = self.lm_gen._streaming_state
        assert state is not None
        return int(state.cache.shape[2])

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        self._check(slot)
        # the preset's builders first: one that refuses the options leaves the slot as it was
        prompt = tuple(self.prompt_builder(options)) if self.prompt_builder else ()
        prefix = self.prefix_builder(options) if self.prefix_builder else None
        self._slots[slot] = _MoshiSlot(dict(options), prompt=prompt, prefix=prefix)
        self._restart(slot)

    def restore_slot(self, slot: int, options: Mapping[str, Any], history: bytes) -> None:
        """Open the slot, then replay its history: its prefix (if any), then its records'
        LM inputs, as many frames a `replay_work` call as asked; a history shorter than the
        prompt leaves the rest of the prompt to step. A history ending inside a barge-in's
        silence goes on silent for the frames left (its last record says how many)."""
        tokens, silence = decode_records(history, self.lm.num_codebooks)
        self.open_slot(slot, options)
        frames = len(tokens)
        if not frames:
            return
        state = self._slot(slot)
        try:
            check_records(tokens, silence, self.lm, len(state.prompt))
        except ValueError:
            self.close_slot(slot)
            raise
        state.prompt_at = min(frames, len(state.prompt))
        prefix = state.prefix
        first = prefix.frames if prefix is not None else 0
        before = dict(prefix.columns) if prefix is not None else None
        inputs = lm_inputs(tokens, self.lm, start=first, before=before)
        segments = [Segment(tokens=torch.from_numpy(inputs)[None].to(self.device))]
        if prefix is not None:
            segments.insert(0, Segment(embeddings=prefix.embeddings[None]))
        offset = first + frames
        state.replay = _SlotReplay(
            SideReplay(self.lm, segments, self.replay_chunk_frames),
            tokens,
            first,
            offset,
            lmgen_columns(tokens, self.lm, offset, self._cache_length(), before),
        )
        # the barge-in's silence left: the last step's, less that step if it was silenced
        # (a step of the prompt waits for the prompt's end)
        last = int(silence[-1])
        state.silenced = last - 1 if last and frames > len(state.prompt) else last
        state.quiet = self._restored_quiet(state, tokens, silence, first)

    def _restored_quiet(
        self, state: _MoshiSlot, tokens: np.ndarray, silence: np.ndarray, first: int
    ) -> int:
        """The speaking hold's count (`_MoshiSlot.quiet`: frames since the last word) a slot
        whose steps made `tokens` and `silence` ended with, as far as it matters (a count
        past the hold is past it): a step counts only once the slot outputs audio (its
        prompt done, LMGen's acoustic delay over); its words are the text token the step
        `max_delay` before produced (LMGen's output lags its cache); a silenced step (silence
        > 0 outside the prompt) came after a barge-in, which put the count past the hold."""
        hold = self.speaking_hold_frames
        lag = self.lm_gen.max_delay - int(self.lm.delays[0])
        after = 0  # steps counted after the one that decides
        for index in range(len(tokens) - 1, -1, -1):
            if index < len(state.prompt) or first + index < self.lm_gen.max_delay:
                break  # no audio yet: the count is still the open's
            if silence[index]:
                return hold + 2 + after
            source = index - lag  # before the records (a prefix's: in its prompt) no word
            if source >= 0 and self.words(int(tokens[source, 0])):
                return after
            after += 1
            if after > hold:
                return after
        return hold + 1 + after

    def replay_pending(self, slot: int) -> int:
        state = self._slots[self._check(slot)]
        return state.replay.side.left if state is not None and state.replay is not None else 0

    @torch.no_grad()
    def replay_work(self, slot: int, frames: int) -> int:
        """Replay exactly min(`frames`, pending) frames of the slot's prefix and history
        (ValueError unless 1 <= `frames` <= `replay_chunk_frames`); the call that replays
        the last one also commits the row into the batch and warms its Mimi decoder."""
        if not 1 <= frames <= self.replay_chunk_frames:
            raise ValueError(
                f"replay_work takes 1..{self.replay_chunk_frames} frames a call, not {frames}"
            )
        state = self._slots[self._check(slot)]
        if state is None or state.replay is None:
            return 0
        left = state.replay.side.work(frames)
        if not left:
            self._finish_replay(slot, state)
        return left

    def _finish_replay(self, slot: int, state: _MoshiSlot) -> None:
        """The replayed row into the batch, LMGen's offset and token cache as the last step
        left them, and Mimi's decoder warmed on the last frames (its encoder starts fresh,
        as at an open)."""
        replay = state.replay
        assert replay is not None
        state.replay = None
        replay.side.commit(slot)
        lm_state = self.lm_gen._streaming_state
        assert lm_state is not None
        for index, column in replay.columns.items():
            lm_state.cache[slot, :, index] = torch.from_numpy(column).to(self.device)
        lm_state.offsets[slot] = replay.offset
        mask = self._mask(slot)
        tokens = torch.zeros(self.slots, self.lm.dep_q, 1, dtype=torch.long, device=self.device)
        warm_from = max(replay.first, replay.offset - DECODER_WARM_FRAMES)
        for step in range(warm_from, replay.offset):
            frame = decoder_tokens(replay.records, self.lm, step, replay.first)
            if frame is None:
                continue
            tokens[slot, :, 0] = torch.from_numpy(frame).to(self.device)
            self.mimi.set_exec_mask(mask)
            self.mimi.decode(tokens)

    def interrupt_slot(self, slot: int) -> None:
        """Barge-in: the slot is silent for `interrupt_frames` frames (text forced to
        padding, audio to the codes of silence) and keeps its context; a slot still in its
        prompt finishes the prompt."""
        state = self._slot(slot)
        state.silenced = self.interrupt_frames
        state.quiet = self.speaking_hold_frames + 1

    def close_slot(self, slot: int) -> None:
        self._slots[self._check(slot)] = None

    def _check(self, slot: int) -> int:
        self._mask(slot)
        return slot

    def _reset_encoder(self, mask: torch.Tensor) -> None:
        """Mimi's encoder side alone starts over for the rows of `mask` (kyutai's server
        resets after a fresh stream's first frame, whose left padding would otherwise
        linger); the decoder keeps its state, which a restored slot's warm-up gave it."""
        for name, module in self.mimi.named_children():
            streaming = isinstance(module, StreamingModule) and module.is_streaming
            if name in ENCODER_PARTS and streaming:
                module.reset_streaming(mask)

    @torch.no_grad()
    def _silence_codes(self) -> tuple[int, ...]:
        """The model's audio codes for silence: what Mimi makes of a few silent frames."""
        with self.mimi.streaming(1):
            zeros = torch.zeros(1, 1, 4 * self.frame_samples, device=self.device)
            codes = self.mimi.encode(zeros)
        return tuple(int(c) for c in codes[0, : self.lm.dep_q, -1].tolist())

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        active = self.checked_active(frames, active, images)
        # the step's slot records (None: inactive), and its views over the batch from them
        on = active.tolist()
        stepped = [state if on[slot] else None for slot, state in enumerate(self._slots)]
        closed = [slot for slot in range(self.slots) if on[slot] and stepped[slot] is None]
        if closed:
            raise ValueError(f"slots {closed} are not open")
        replaying = [slot for slot in range(self.slots) if on[slot] and not self.is_stepping(slot)]
        if replaying:
            raise ValueError(f"slots {replaying} are still replaying their history")
        if not active.any():
            return [None] * self.slots
        fresh = np.array([s is not None and s.fresh for s in stepped])
        prompting = np.array([s is not None and s.prompting for s in stepped])
        silencing = np.array([s is not None and s.silenced > 0 for s in stepped]) & ~prompting
        mask = torch.from_numpy(active).to(self.device)
        audio_in = torch.from_numpy(np.ascontiguousarray(frames, dtype=np.float32))
        audio_in = audio_in.to(self.device)[:, None, :]

        self.mimi.set_exec_mask(mask)
        codes = self.mimi.encode(audio_in)  # [slots, codebooks, 1]
        if fresh.any():
            # a fresh slot's first encoded frame carries Mimi's left padding: kyutai's
            # server resets the encoder after it so the next frame is padded again
            self._reset_encoder(torch.from_numpy(fresh).to(self.device))
            for slot in np.flatnonzero(fresh):
                self._slot(slot).fresh = False

        user_codes = codes[:, : self.user_codebooks, :1]
        if prompting.any() or silencing.any():
            user_codes, self._forcing = self._forced(user_codes, prompting, silencing)
        self.lm_gen.set_exec_mask(mask)
        try:
            tokens = self.lm_gen.step(user_codes)  # [slots, 1 + dep_q, 1]
        finally:
            self._forcing = None
        assert tokens is not None  # support_out_of_sync: never None
        assert self._step_text is not None and self._step_audio is not None
        # the barge-in's silence left as each slot stepped, this step included (a slot in
        # its prompt: the silence waiting for its end), for its record
        silence = np.array([s.silenced if s is not None else 0 for s in stepped])
        for slot in np.flatnonzero(silencing):
            self._slot(slot).silenced -= 1
        # one copy to the host, at once: the LM has advanced, so whatever fails from here
        # on, its records go with the failure (FrameStepError), or the session's history
        # would lack a frame its model holds. Output tokens, then each slot's record (what
        # the step fed the LM: its text and audio tokens after forcing, the user's codes;
        # then the silence it stepped in)
        fed = torch.cat(
            [tokens[:, :, 0], self._step_text[:, None], self._step_audio, user_codes[:, :, 0]],
            dim=1,
        )
        host = fed.cpu().numpy()
        width = 1 + self.lm.dep_q
        records = [
            encode_records(host[slot : slot + 1, width:], silence[slot : slot + 1])
            if active[slot]
            else None
            for slot in range(self.slots)
        ]
        try:
            return self._outputs(
                tokens, host[:, :width], records, active, mask, prompting, silencing
            )
        except Exception as exc:
            raise FrameStepError(
                f"the step failed after the model advanced: {exc}", records
            ) from exc

    def _outputs(
        self,
        tokens: torch.Tensor,
        last_tokens: np.ndarray,
        records: list[bytes | None],
        active: np.ndarray,
        mask: torch.Tensor,
        prompting: np.ndarray,
        silencing: np.ndarray,
    ) -> list[FrameOutput | None]:
        """The step's outputs: Mimi decodes the audio of the slots past their acoustic
        delay and prompt; the text token becomes words."""
        audio_tokens = tokens[:, 1:, :]
        # a slot speaks once its acoustic delay is over and its prompt (if any) is done
        ready = (audio_tokens >= 0).all(dim=2).all(dim=1) & mask
        ready &= ~torch.from_numpy(prompting).to(self.device)
        pcm: np.ndarray | None = None
        if ready.any():
            self.mimi.set_exec_mask(ready)
            decoded = self.mimi.decode(torch.where(audio_tokens >= 0, audio_tokens, 0))
            pcm = decoded[:, 0, :].float().cpu().numpy()
        ready_np = ready.cpu().numpy()
        self.last_tokens = last_tokens
        text_ids = last_tokens[:, 0].tolist()
        outputs: list[FrameOutput | None] = []
        for slot in range(self.slots):
            record = records[slot]
            if record is None:
                outputs.append(None)
                continue
            if not ready_np[slot] or pcm is None:
                # the model's acoustic delay: nothing generated for this slot yet
                outputs.append(FrameOutput(audio=np.zeros(0, dtype=np.float32), record=record))
                continue
            state = self._slot(slot)
            words = "" if silencing[slot] else self.words(text_ids[slot])
            state.quiet = 0 if words else state.quiet + 1
            speaking = state.quiet <= self.speaking_hold_frames
            outputs.append(
                FrameOutput(audio=pcm[slot].copy(), text=words, speaking=speaking, record=record)
            )
        return outputs

    # ------------------------------------------------------------ prompts

    def prompt_frames_left(self, slot: int) -> int:
        state = self._slots[self._check(slot)]
        return len(state.prompt) - state.prompt_at if state is not None else 0

    def _forced(
        self, user_codes: torch.Tensor, prompting: np.ndarray, silencing: np.ndarray
    ) -> tuple[torch.Tensor, _Forcing]:
        """This step's user codes and forced tokens: the prompt's for the slots still in
        their prompt, padding and silence for the slots a barge-in silenced. Forced audio
        goes into LMGen's cache in its delayed layout: codebook k of this step is frame
        t - delays[k] of the prompt's audio (kyutai's delays are 0 or 1)."""
        user_codes = user_codes.clone()
        slots, dep_q = self.slots, self.lm.dep_q
        text_mask = torch.zeros(slots, dtype=torch.bool)
        text = torch.zeros(slots, dtype=torch.long)
        audio_mask = torch.zeros(slots, dtype=torch.bool)
        audio = torch.zeros(slots, dep_q, dtype=torch.long)
        delays = self.lm.delays[1 : 1 + dep_q]
        for slot in np.flatnonzero(prompting):
            state = self._slot(slot)
            frame = state.prompt[state.prompt_at]
            previous = state.prompt_previous or frame.model_codes
            state.prompt_at += 1
            needed = user_codes.shape[1]
            user_codes[slot, :, 0] = torch.tensor(frame.user_codes[:needed], device=self.device)
            if frame.text_token is not None:
                text_mask[slot], text[slot] = True, frame.text_token
            if frame.model_codes is not None:
                assert previous is not None
                audio_mask[slot] = True
                for k in range(dep_q):
                    audio[slot, k] = (frame.model_codes if delays[k] == 0 else previous)[k]
        for slot in np.flatnonzero(silencing):
            text_mask[slot], text[slot] = True, self.lm.text_padding_token_id
            audio_mask[slot] = True
            audio[slot] = torch.tensor(self.silence_codes, dtype=torch.long)
        device = self.device
        forcing = _Forcing(
            text_mask.to(device), text.to(device), audio_mask.to(device), audio.to(device)
        )
        return user_codes, forcing

    def _force_text(self, text_token: torch.Tensor) -> None:
        """LMGen's text hook gets the sampled tokens [slots] before they are fed to the
        depformer and written to its cache: forcing in place forces both. The tokens are
        kept (after forcing) for the step's records."""
        if (forcing := self._forcing) is not None:
            text_token.copy_(torch.where(forcing.text_mask, forcing.text, text_token))
        self._step_text = text_token

    def _force_audio(self, audio_tokens: torch.Tensor) -> None:
        """LMGen's audio hook gets the depformer's tokens [slots, dep_q] before the cache."""
        if (forcing := self._forcing) is not None:
            audio_tokens.copy_(
                torch.where(forcing.audio_mask[:, None], forcing.audio, audio_tokens)
            )
        self._step_audio = audio_tokens

    # ------------------------------------------------------------ text

    def words(self, token: int) -> str:
        """The text a text token adds: "" for padding and the tokenizer's control pieces."""
        if token in self._silent_ids or not 0 <= token < self._vocab:
            return ""
        if self.tokenizer.is_control(token) or self.tokenizer.is_unknown(token):
            return ""
        return self.tokenizer.id_to_piece(token).replace("\u2581", " ")

    def close(self) -> None:
        self._slots = [None] * self.slots


def sampling_from_config(lm_gen_config: Mapping[str, Any]) -> SamplingSettings:
    """A checkpoint's `lm_gen_config` (LMGen kwargs: temp, temp_text, top_k, top_k_text)."""
    defaults = SamplingSettings()
    return SamplingSettings(
        temperature=float(lm_gen_config.get("temp", defaults.temperature)),
        temperature_text=float(lm_gen_config.get("temp_text", defaults.temperature_text)),
        top_k=int(lm_gen_config.get("top_k", defaults.top_k)),
        top_k_text=int(lm_gen_config.get("top_k_text", defaults.top_k_text)),
    )


__all__ = [
    "INTERRUPT_FRAMES",
    "REPLAY_CHUNK_FRAMES",
    "SPEAKING_HOLD_FRAMES",
    "MoshiFrameModel",
    "PromptFrame",
    "PromptPrefix",
    "SamplingSettings",
    "default_threads",
    "sampling_from_config",
]
