"""`NemotronFrameModel`: Nemotron VoiceChat as a `FrameModel` (the tick-batched stage's model).

Each slot is one conversation of `StreamingVoiceChat` (streaming.py): a tick steps every
active slot's 80 ms frame in one batch and returns its speech (1764 samples at 22.05 kHz),
its words and its tool calls.

- **Prompt**: the session's system prompt (instructions and tool declarations, rendered by
  `tools.render_system_prompt`) is tokenized as NeMo's streaming inference takes a prompt
  (`[bos] + tokens + [eos]`, one position each, before the first frame) and run through the
  LLM in one forward at the slot's first `replay_work`, whatever number of frames it is
  asked for (its inputs are known in advance, and one forward of them all costs less than
  any split); the slot hears the session from the next frame (`prompt_frames_left`). The
  speech decoder starts at the first frame.
- **Turns**: the text channel's BOS opens the agent's turn and EOS closes it (NeMo's duplex
  format); a frame speaks while a turn is open or it says a word. Words are the turn's
  tokens decoded together, sent as they complete (a partial UTF-8 character waits).
- **Barge-in** (`interrupt_slot`): the next frame's text token is forced to EOS (the turn
  ends, and the speech decoder turns to silence, as NeMo does on EOS); memory stays.
- **Tool calls**: the function head's tokens (a checkpoint with `stt_model.function_head`),
  or the text channel's where the checkpoint has none, go through `ToolCallParser`: a
  `<TOOLCALL>` block becomes `FrameOutput.function_calls` and is not spoken as words.
  A client's result (`add_function_output`) is tokenized as `<TOOL_RESPONSE>...` and fed as
  positions of the user channel (like the prompt), at most `max_injected_tokens` before each
  frame, so a long result never stalls the other slots.
- **Memory**: every frame's record (records.py); `restore_slot` replays them, exactly as
  many a `replay_work` call as the stage asks for: the slot's first two frames one by one,
  then all of a call's frames in one forward of each part (`StreamingVoiceChat.replay`:
  every input is in the records, so nothing needs the frame before it to be stepped).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from plugins.nemotron.checkpoint import NemotronCheckpoint
from plugins.nemotron.defaults import MAX_INJECTED_TOKENS, REPLAY_CHUNK_FRAMES
from plugins.nemotron.records import NO_FUNCTION, FrameRecord, RecordLayout, decode, encode
from plugins.nemotron.streaming import FRAME_SAMPLES, ReplayedFrame, StreamingVoiceChat
from plugins.nemotron.tools import ToolCallParser, render_function_output
from shared.contracts.frame_model import FrameModel, FrameOutput, FrameStepError
from shared.contracts.stages import FunctionCall

log = logging.getLogger(__name__)

#: tool-result tokens a slot holds for the model at most (a longer output is refused)
MAX_RESULT_TOKENS = 2048
#: frames of codes the codec decodes each frame over (NeMo's incremental decoding window)
DECODE_WINDOW = 12


def default_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 2) - 1))


@dataclasses.dataclass
class _Pending:
    """A position still to step before the slot takes frames: a prompt token, or a record
    of a restored history."""

    prompt_token: int | None = None
    record: FrameRecord | None = None


@dataclasses.dataclass
class TokenText:
    """Tokens decoded to text as they come, at a constant cost per token (a turn can last
    minutes: decoding all of it again every frame grew with it). As incremental
    detokenizers do, each token is decoded with the few said before it, so a
    tokenizer that writes a token differently at the start of a text (a leading space)
    writes it alike both times, and a split UTF-8 character waits for its end."""

    #: the tokens not yet said, after the context they are decoded with
    tokens: list[int] = dataclasses.field(default_factory=list)
    #: tokens[:read] were said: the context of the new ones
    read: int = 0

    def add(self, token: int, decode: Callable[[list[int]], str]) -> str:
        """The text `token` adds (nothing while it completes no character)."""
        self.tokens.append(token)
        before = decode(self.tokens[: self.read])
        after = decode(self.tokens)
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""
        # only the context is kept: the turn's earlier tokens are never decoded again
        del self.tokens[: self.read]
        self.read = len(self.tokens)
        return after[len(before) :]


@dataclasses.dataclass
class SlotConversation:
    """One open conversation's bookkeeping outside the model's tensors."""

    options: dict[str, Any]
    parser: ToolCallParser
    pending: deque[_Pending] = dataclasses.field(default_factory=deque)
    prompt_left: int = 0
    injections: deque[int] = dataclasses.field(default_factory=deque)
    in_turn: bool = False
    turn_text: TokenText = dataclasses.field(default_factory=TokenText)
    function_text: TokenText = dataclasses.field(default_factory=TokenText)
    interrupt: bool = False


class NemotronFrameModel(FrameModel):
    frame_samples = FRAME_SAMPLES
    input_sample_rate_hz = 16_000
    output_sample_rate_hz = 22_050

    def __init__(
        self,
        model: Any,
        slots: int,
        *,
        replay_chunk_frames: int = REPLAY_CHUNK_FRAMES,
        max_injected_tokens: int = MAX_INJECTED_TOKENS,
        decode_window: int = DECODE_WINDOW,
        speaker_audio: torch.Tensor | None = None,
        speaker_name: str | None = None,
    ) -> None:
        self.model = model
        self.slots = slots
        self.engine = StreamingVoiceChat(model, slots, decode_window)
        self.engine.set_speaker(speaker_audio, speaker_name)
        self.tokenizer = model.stt_model.tokenizer
        self.replay_chunk_frames = replay_chunk_frames
        self.max_injected_tokens = max_injected_tokens
        quantizers = int(model.tts_model.tts_model.config.num_quantizers)
        self.layout = RecordLayout(quantizers, max_injected_tokens)
        self.state_record_bytes = self.layout.size
        self.special = {self.engine.pad, self.engine.bos, self.engine.eos}
        self._slots: list[SlotConversation | None] = [None] * slots
        self.device = self.engine.device

    @classmethod
    def load(
        cls,
        checkpoint_dir: str,
        max_sessions: int,
        device: str = "cpu",
        threads: int | None = None,
        *,
        replay_chunk_frames: int = REPLAY_CHUNK_FRAMES,
        max_injected_tokens: int = MAX_INJECTED_TOKENS,
        decode_window: int | None = None,
    ) -> NemotronFrameModel:
        """The checkpoint (checked, then its weights streamed in) on `device`."""
        if torch.device(device).type == "cpu":
            torch.set_num_threads(threads or default_threads())
        checkpoint = NemotronCheckpoint.inspect(checkpoint_dir)
        model = checkpoint.load(device)
        cfg = model.cfg
        window = decode_window or int(cfg.get("inference_codec_decoding_prev_tokens_number") or 0)
        speaker_name = cfg.get("inference_speaker_name", None)
        speaker_audio = None
        if speaker_name is None:
            speaker_audio = checkpoint.speaker_audio(model.tts_model.target_sample_rate)
        frame_model = cls(
            model,
            max_sessions,
            replay_chunk_frames=replay_chunk_frames,
            max_injected_tokens=max_injected_tokens,
            decode_window=window or DECODE_WINDOW,
            speaker_audio=speaker_audio,
            speaker_name=speaker_name,
        )
        frame_model.warm_up()
        return frame_model

    def warm_up(self, frames: int = 2) -> None:
        """A few steps on silence, then every slot closed (torch's first steps are slow)."""
        for slot in range(self.slots):
            self.open_slot(slot, {})
        zeros = np.zeros((self.slots, self.frame_samples), dtype=np.float32)
        for _ in range(frames):
            self.step(zeros, np.ones(self.slots, dtype=bool))
        for slot in range(self.slots):
            self.close_slot(slot)

    # ------------------------------------------------------------ slots

    def _slot(self, slot: int) -> SlotConversation:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is out of range (0..{self.slots - 1})")
        state = self._slots[slot]
        if state is None:
            raise ValueError(f"slot {slot} is not open")
        return state

    def prompt_tokens(self, options: Mapping[str, Any]) -> list[int]:
        """NeMo's prompt positions for the session's system prompt (none without one)."""
        text = str(options.get("system_prompt") or "")
        if not text:
            return []
        return [self.engine.bos, *self.tokenizer.text_to_ids(text), self.engine.eos]

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is out of range (0..{self.slots - 1})")
        tools = options.get("tools") or []
        names = [
            str(tool["name"]) for tool in tools if isinstance(tool, Mapping) and tool.get("name")
        ]
        state = SlotConversation(dict(options), ToolCallParser(names))
        prompt = self.prompt_tokens(options)
        state.pending.extend(_Pending(prompt_token=token) for token in prompt)
        state.prompt_left = len(prompt)
        self.engine.reset(slot)
        self._slots[slot] = state

    def close_slot(self, slot: int) -> None:
        self._slot(slot)
        self._slots[slot] = None
        self.engine.reset(slot)

    def interrupt_slot(self, slot: int) -> None:
        """Barge-in: the next frame drops any half-written tool call and, if a turn is
        open, says EOS (both in its record, so a replay does the same)."""
        self._slot(slot).interrupt = True

    @staticmethod
    def _drop_call(state: SlotConversation) -> None:
        state.parser.reset()
        state.function_text = TokenText()

    def prompt_frames_left(self, slot: int) -> int:
        return self._slot(slot).prompt_left

    def restore_slot(self, slot: int, options: Mapping[str, Any], history: bytes) -> None:
        records = decode(self.layout, history)
        self.open_slot(slot, options)
        self._slot(slot).pending.extend(_Pending(record=record) for record in records)

    def replay_pending(self, slot: int) -> int:
        return len(self._slot(slot).pending)

    @torch.no_grad()
    def replay_work(self, slot: int, frames: int) -> int:
        """The prompt, if it is next, whole in one forward (and nothing else in this call);
        otherwise exactly min(`frames`, pending) records of the history, in one forward
        (a slot's first two frames one by one before it)."""
        if not 1 <= frames <= self.replay_chunk_frames:
            raise ValueError(
                f"replay_work takes 1..{self.replay_chunk_frames} frames a call, not {frames}"
            )
        state = self._slot(slot)
        if state.pending and state.pending[0].prompt_token is not None:
            # the whole prompt in one forward (its inputs are known in advance)
            prompt = []
            while state.pending and state.pending[0].prompt_token is not None:
                token = state.pending.popleft().prompt_token
                assert token is not None
                prompt.append(token)
            self.engine.prefill_prompt(slot, prompt)
            state.prompt_left = 0
            return len(state.pending)
        records = []
        for _ in range(min(frames, len(state.pending))):
            item = state.pending.popleft()
            assert item.record is not None
            records.append(item.record)
        # a slot's first two frames one by one (the encoder chunks them differently and the
        # speech decoder starts at the first), then the rest in one forward
        while records and not self.engine.can_replay(slot):
            self._replay_frame(slot, records.pop(0))
        self.engine.replay(
            slot,
            [
                ReplayedFrame(
                    audio=torch.from_numpy(record.pcm.astype(np.float32) / 32768.0),
                    injected=record.injected,
                    text=record.text,
                    asr=record.asr,
                    codes=torch.from_numpy(record.codes.astype(np.int64)),
                )
                for record in records
            ],
        )
        for record in records:
            if record.interrupted:
                self._drop_call(state)
            self._account(
                state, record.text, None if record.function == NO_FUNCTION else record.function
            )
        return len(state.pending)

    def add_function_output(self, slot: int, call_id: str, name: str, output: str) -> None:
        state = self._slot(slot)
        tokens = self.tokenizer.text_to_ids(render_function_output(name, output))
        if len(tokens) + len(state.injections) > MAX_RESULT_TOKENS:
            # fed a token a position before the frames, a huge result would hold the
            # session's words back for minutes and grow its caches for good
            raise ValueError(
                f"the function output is {len(tokens)} tokens: at most {MAX_RESULT_TOKENS} "
                "wait to reach the model at once"
            )
        state.injections.extend(tokens)

    # ------------------------------------------------------------ positions

    def _feed_tokens(self, slot: int, tokens: list[int]) -> None:
        """Token positions on the user channel (a prompt, a tool result): NeMo's prompt
        positions, the text and ASR channels pad, the speech decoder not stepped."""
        embed = self.model.stt_model.embed_tokens
        for token in tokens:
            user = embed(torch.tensor([token], device=self.device))
            self.engine.step([slot], user, prompt=[True], speak=False)

    def _replay_frame(self, slot: int, record: FrameRecord) -> None:
        if record.interrupted:
            self._drop_call(self._slot(slot))
        self._feed_tokens(slot, record.injected)
        audio = torch.from_numpy(record.pcm.astype(np.float32) / 32768.0)[None].to(self.device)
        user = self.engine.perception.step([slot], audio)
        forced = {
            "text": record.text,
            "asr": record.asr,
            "function": None if record.function == NO_FUNCTION else record.function,
            "codes": torch.from_numpy(record.codes.astype(np.int64)),
        }
        (out,) = self.engine.step([slot], user, forced=[forced], decode=False)
        self._account(self._slot(slot), out.text, out.function)

    # ------------------------------------------------------------ the tick

    @torch.no_grad()
    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        active = self.checked_active(frames, active, images)
        slots = [int(s) for s in np.flatnonzero(active)]
        for slot in slots:
            if self._slot(slot).pending:
                raise ValueError(f"slot {slot} is still stepping its prompt or history")
        if not slots:
            return [None] * self.slots
        # the input as 16-bit samples, as the record keeps it (a replay hears the same)
        pcm = np.clip(np.round(frames[slots] * 32768.0), -32768, 32767).astype(np.int16)
        injected: dict[int, list[int]] = {}
        for slot in slots:
            state = self._slot(slot)
            take = [
                state.injections.popleft()
                for _ in range(min(len(state.injections), self.max_injected_tokens))
            ]
            injected[slot] = take
            self._feed_tokens(slot, take)
        audio = torch.from_numpy(pcm.astype(np.float32) / 32768.0).to(self.device)
        user = self.engine.perception.step(slots, audio)
        interrupted = {slot: self._slot(slot).interrupt for slot in slots}
        for slot in slots:
            if interrupted[slot]:
                self._drop_call(self._slot(slot))
        forced = [self._forced_for(slot, self._slot(slot), pcm[i]) for i, slot in enumerate(slots)]
        # the codes first, their decoding after the records: a decoding that fails leaves
        # every slot's record written (its state has advanced: FrameStepError carries them)
        outs = self.engine.step(slots, user, forced=forced, decode=False)
        records: list[bytes | None] = [None] * self.slots
        for i, slot in enumerate(slots):
            out = outs[i]
            assert out.codes is not None
            record = FrameRecord(
                pcm[i],
                out.text,
                out.asr,
                NO_FUNCTION if out.function is None else out.function,
                out.codes.cpu().numpy().astype(np.uint16),
                injected[slot],
                interrupted[slot],
            )
            records[slot] = encode(self.layout, record)
        try:
            self.engine.decode(slots, outs)
            results: list[FrameOutput | None] = [None] * self.slots
            for i, slot in enumerate(slots):
                out = outs[i]
                text, calls, error, speaking = self._account(
                    self._slot(slot), out.text, out.function
                )
                assert out.audio is not None
                results[slot] = FrameOutput(
                    audio=out.audio.float().cpu().numpy(),
                    text=text,
                    speaking=speaking,
                    record=records[slot] or b"",
                    function_calls=calls,
                    error=error,
                )
            return results
        except Exception as exc:
            raise FrameStepError(
                f"the step failed after the model advanced: {exc}", records
            ) from exc

    def _forced_for(
        self, slot: int, state: SlotConversation, pcm: np.ndarray
    ) -> dict[str, Any] | None:
        """What this frame's step is made to say instead of choosing (None: nothing): after
        a barge-in, EOS on the text channel if a turn is open."""
        interrupted, state.interrupt = state.interrupt, False
        return {"text": self.engine.eos} if interrupted and state.in_turn else None

    def _account(
        self, state: SlotConversation, text: int, function: int | None
    ) -> tuple[str, tuple[FunctionCall, ...], tuple[str, str] | None, bool]:
        """A frame's tokens into the slot's turn: its words, calls, error, and whether it
        speaks (also run for replayed frames, so a restored slot's turn is as it was)."""
        words = ""
        if text == self.engine.bos:
            state.in_turn, state.turn_text = True, TokenText()
        elif text == self.engine.eos:
            state.in_turn = False
            state.turn_text = TokenText()
        elif text not in self.special:
            words = state.turn_text.add(text, self._decode)
        # a word token is speech even before its characters complete (a split UTF-8 one)
        speaking = state.in_turn or text not in self.special
        calls: tuple[FunctionCall, ...] = ()
        error = None
        if function is None:
            # no function head: calls are in the text channel, and not said as words
            parsed = state.parser.feed(words)
            words, calls, error = parsed.text, parsed.calls, parsed.error
        elif function not in self.special:
            piece = state.function_text.add(function, self._decode)
            parsed = state.parser.feed(piece)
            calls, error = parsed.calls, parsed.error
            if calls or error:
                state.function_text = TokenText()
        return words, calls, error, speaking

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.ids_to_text(tokens, remove_special_tokens=False) if tokens else ""

    def close(self) -> None:
        self._slots = [None] * self.slots


__all__ = ["DECODE_WINDOW", "MAX_INJECTED_TOKENS", "NemotronFrameModel"]
