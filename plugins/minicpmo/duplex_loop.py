"""MiniCPM-o's duplex loop, one unit for many slots at once: hear, decide, speak.

Every unit (one second of audio, and the camera frames that came with it) each slot:

1. **Prefill.** `<unit>`, then per camera frame `<image>` + its 64 embeddings + `</image>`,
   then the unit's 10 audio embeddings are fed. The last position's logits are the unit's
   first decision.
2. **Decide** (at most 20 steps; the reference's `streaming_generate`). Step j chooses a
   token (text_sampling.py): `<|listen|>`, `<|chunk_eos|>` and `<|chunk_tts_eos|>` end the
   unit's answer; anything else is fed and the next step decides again. Rules, as the
   reference has them:
   - at step 19 `<|chunk_eos|>` is fed without asking (at most 19 chosen tokens a unit);
   - a forced listen (the first `force_listen_units` units, or a barge-in) is
     `<|listen|>` without asking; a barge-in in an open turn first feeds `<|turn_eos|>`
     (forced: the turn is closed and the speech model's memory of it dropped, as the
     reference's demo server does), so that the model does not resume the interrupted
     turn at the next unit;
   - `<|listen|>` while the turn is still open becomes `<|tts_bos|>`: the model may not fall
     silent in the middle of a turn;
   - `<|turn_eos|>` closes the turn (it is fed and the unit goes on); any other word opens
     or continues one;
   - the words of steps >= 1 (with the hidden state their feeding produced) are what the
     speech model hears; step 0's token (normally `<|speak|>`) never is.
   Then `</unit>` closes the unit (fed with the terminator, in one forward).
3. **Speak** (slots that did not listen): the unit's words condition the speech-token
   model (speech.py), which gives the unit's codec tokens; a turn's first unit and its last
   may stop early, others give 25.

All slots advance in lockstep: one forward for every slot's prefill, then one forward per
decision step for the slots still deciding (each feeds one token, or its terminator and
`</unit>`), then the speech model's steps for the speaking slots.

What a unit leaves in the slot (`UnitResult`) is exactly what its record needs to rebuild
the slot elsewhere: the fed tokens with which of them were forced or replaced, and the
codes.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

import torch

from plugins.minicpmo.decoder_stack import SlotKV
from plugins.minicpmo.language import LanguageModel
from plugins.minicpmo.records import TokenOrigin, decisions
from plugins.minicpmo.speech import TTS_STEPS_PER_UNIT, SpeechRequest, SpeechTokenModel
from plugins.minicpmo.text_sampling import TextDecider, TextHistory, TextSampling
from plugins.minicpmo.vocabulary import Vocabulary

#: decision steps a unit: the last is a forced `<|chunk_eos|>`
MAX_STEPS_PER_UNIT = 20


@dataclasses.dataclass(frozen=True)
class Prompt:
    """What a conversation starts with: the system prompt's prefix tokens, a reference
    voice's audio embeddings (optional), the suffix tokens, fed in that order (the
    reference's `prepare`)."""

    prefix: Sequence[int]
    suffix: Sequence[int] = ()
    voice: torch.Tensor | None = None

    @property
    def ids(self) -> list[int]:
        """The prompt's tokens (prefix then suffix; the voice is not tokens)."""
        return [*self.prefix, *self.suffix]


@dataclasses.dataclass
class UnitInput:
    """One slot's unit: its audio embeddings ([10, hidden]) and camera frames' embeddings
    ([64, hidden] each), and whether it must listen (a barge-in)."""

    slot: int
    audio: torch.Tensor
    images: Sequence[torch.Tensor] = ()
    force_listen: bool = False


@dataclasses.dataclass
class UnitResult:
    slot: int
    listen: bool
    #: every token fed after the prefill, in order (the terminator included, `</unit>` not)
    fed: list[int]
    origins: list[TokenOrigin]
    #: the words of the unit (special tokens left out)
    text: str
    #: the unit's last word closed the turn
    end_of_turn: bool
    #: the unit's codec tokens (empty when it listened)
    codes: list[int]
    #: the unit spoke first in its turn (the speech model's memory was empty): the vocoder
    #: flushes what it can rather than waiting for a whole second
    opens_turn: bool = False


@dataclasses.dataclass
class SlotTurn:
    """A slot's decision state between units: whether its turn is closed, its history of
    decisions, its random generators (None: greedy) and how many units it has decided."""

    turn_ended: bool = True
    history: TextHistory = dataclasses.field(default_factory=TextHistory)
    #: the session's seed: each unit's draws come from generators seeded by (seed, unit),
    #: so a slot restored from its records draws what it would have drawn
    seed: int = 0
    text_generator: torch.Generator | None = None
    speech_generator: torch.Generator | None = None
    units: int = 0
    force_listen_units: int = 0
    #: the speaking units whose conditions and codes the speech model's memory holds (the
    #: open turn): what a replay feeds it again
    speech_units: list[tuple[list[int], torch.Tensor | None, list[int]]] = dataclasses.field(
        default_factory=list
    )
    speech_length: int = 0
    #: positions of the system prompt (never dropped) and of each unit the memory holds
    prompt_length: int = 0
    unit_lengths: deque[int] = dataclasses.field(default_factory=deque)

    def seed_unit(self) -> None:
        base = (self.seed * 1_000_003 + self.units * 2) % (1 << 63)
        if self.text_generator is not None:
            self.text_generator.manual_seed(base)
        if self.speech_generator is not None:
            self.speech_generator.manual_seed(base + 1)


@dataclasses.dataclass
class _Deciding:
    """A slot's unit while it decides."""

    unit: UnitInput
    logits: torch.Tensor | None = None
    step: int = 0
    fed: list[int] = dataclasses.field(default_factory=list)
    origins: list[TokenOrigin] = dataclasses.field(default_factory=list)
    words: list[int] = dataclasses.field(default_factory=list)
    hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    listen: bool = False
    end_of_turn: bool = False
    done: bool = False
    hidden_stack: torch.Tensor | None = None
    condition_length: int = 0
    barged_in: bool = False


@dataclasses.dataclass
class ReplayUnit:
    """A recorded unit, its inputs embedded again: what `DuplexLoop.replay` feeds."""

    unit: UnitInput
    fed: Sequence[int]
    origins: Sequence[TokenOrigin]
    codes: Sequence[int]

    @property
    def positions(self) -> int:
        """What the unit put in the memory: `<unit>`, the frames, the audio, what it fed,
        `</unit>`."""
        images = sum(2 + image.shape[0] for image in self.unit.images)
        return 1 + images + self.unit.audio.shape[0] + len(self.fed) + 1


@dataclasses.dataclass(frozen=True)
class ContextWindow:
    """How much of the conversation the language model keeps (positions per slot): past
    `high` after a unit, its oldest units are forgotten down to `low` (the reference's
    "basic" sliding window; vLLM-Omni's defaults 8000 / 6000). The memory is sized so that
    any unit fits above `high`."""

    high: int = 8000
    low: int = 6000
    #: camera frames a unit may carry, and the positions each takes (`<image>`, the
    #: resampler's embeddings, `</image>`)
    max_images: int = 1
    image_positions: int = 66
    audio_positions: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise ValueError(f"a context window needs 0 < low <= high, got {self.low}/{self.high}")

    def unit_positions(self, images: int) -> int:
        """The most positions a unit with `images` camera frames takes."""
        return 1 + images * self.image_positions + self.audio_positions + MAX_STEPS_PER_UNIT + 1

    @property
    def capacity(self) -> int:
        return self.high + self.unit_positions(self.max_images)


class DuplexLoop:
    """The language model's and the speech model's per-slot memory, and the unit step."""

    def __init__(
        self,
        *,
        language: LanguageModel,
        speech: SpeechTokenModel,
        vocabulary: Vocabulary,
        slots: int,
        window: ContextWindow,
        speech_tokens: int,
        sampling: TextSampling,
        speech_greedy: bool,
    ) -> None:
        self.language = language
        self.speech = speech
        self.vocabulary = vocabulary
        self.special = vocabulary.special
        self.sampling = sampling
        self.speech_greedy = speech_greedy
        self.window = window
        self.memory: SlotKV = language.new_memory(slots, window.capacity)
        self.speech_memory: SlotKV = speech.new_memory(slots, speech_tokens)
        self.turns: list[SlotTurn] = [SlotTurn() for _ in range(slots)]
        self.decider = TextDecider(
            chunk_eos=self.special.chunk_eos,
            turn_eos=self.special.turn_eos,
            forbidden=vocabulary.forbidden,
            sampling=sampling,
        )

    # ------------------------------------------------------------------ slots

    def open(self, slot: int, prompt: Prompt, *, seed: int, force_listen_units: int = 0) -> None:
        """A fresh conversation in `slot`, its system prompt fed."""
        self.memory.reset(slot)
        self.speech_memory.reset(slot)
        turn = SlotTurn(seed=seed, force_listen_units=force_listen_units)
        if not self.sampling.greedy:
            turn.text_generator = torch.Generator()
        if not self.speech_greedy:
            turn.speech_generator = torch.Generator()
        self.turns[slot] = turn
        parts = [self.language.embed(prompt.prefix)] if prompt.prefix else []
        if prompt.voice is not None:
            parts.append(prompt.voice.to(self.language.llm.model.embed_tokens.weight.dtype))
        if prompt.suffix:
            parts.append(self.language.embed(prompt.suffix))
        if parts:
            self.language.forward(self.memory, [(slot, torch.cat(parts))])
        turn.prompt_length = self.memory.length(slot)

    # ------------------------------------------------------------------ a unit

    def _prefill_row(self, unit: UnitInput) -> torch.Tensor:
        special = self.special
        parts = [self.language.embed([special.unit])]
        for image in unit.images:
            parts += [
                self.language.embed([special.image]),
                image.to(parts[0].dtype),
                self.language.embed([special.image_end]),
            ]
        parts.append(unit.audio.to(parts[0].dtype))
        return torch.cat(parts, dim=0)

    def _decide(self, slot: int, state: _Deciding) -> list[int]:
        """Step `state.step` of one slot: the token(s) it feeds now."""
        special, turn = self.special, self.turns[slot]
        if state.step == MAX_STEPS_PER_UNIT - 1:
            state.fed.append(special.chunk_eos)
            state.origins.append(TokenOrigin.FORCED)
            state.done = True
            return [special.chunk_eos, special.unit_end]
        origin = TokenOrigin.CHOSEN
        if state.unit.force_listen and state.step == 0 and not turn.turn_ended:
            # a barge-in closes the open turn first (the reference's demo server does the
            # same: a forced listen alone would leave the turn open, and the next unit's
            # `<|listen|>` would become `<|tts_bos|>`: the model would talk on)
            token, origin = special.turn_eos, TokenOrigin.FORCED
            state.barged_in = True
        elif state.unit.force_listen or turn.units < turn.force_listen_units:
            token, origin = special.listen, TokenOrigin.FORCED
        else:
            assert state.logits is not None
            token = self.decider.choose(state.logits, turn.history, turn.text_generator)
            if token == special.listen and not turn.turn_ended:
                token, origin = special.tts_bos, TokenOrigin.REPLACED
        state.fed.append(token)
        state.origins.append(origin)
        state.listen = token == special.listen
        if token in special.unit_terminators:
            state.done = True
            return [token, special.unit_end]
        turn.turn_ended = False
        state.end_of_turn = token == special.turn_eos
        if state.end_of_turn:
            turn.turn_ended = True
        return [token]

    @torch.no_grad()
    def step(self, units: Sequence[UnitInput]) -> list[UnitResult]:
        """One unit of every slot in `units`; results in the same order."""
        states = {unit.slot: _Deciding(unit) for unit in units}
        before = {}
        for unit in units:
            self.turns[unit.slot].seed_unit()
            before[unit.slot] = self.memory.length(unit.slot)
            if (
                before[unit.slot] + self.window.unit_positions(len(unit.images))
                > self.memory.capacity
            ):
                raise ValueError(f"slot {unit.slot}'s memory has no room for a unit")
        hidden = self.language.forward(
            self.memory, [(unit.slot, self._prefill_row(unit)) for unit in units]
        )
        for unit, rows in zip(units, hidden, strict=True):
            states[unit.slot].logits = self.language.logits(rows[-1])
        while True:
            deciding = [(slot, state) for slot, state in states.items() if not state.done]
            if not deciding:
                break
            rows, wants = [], []
            for slot, state in deciding:
                tokens = self._decide(slot, state)
                rows.append((slot, self.language.embed(tokens)))
                wants.append((slot, state, not state.done))
            out = self.language.forward(self.memory, rows)
            for (_slot, state, goes_on), fed_hidden in zip(wants, out, strict=True):
                if goes_on:
                    state.logits = self.language.logits(fed_hidden[-1])
                    if state.step != 0:
                        state.words.append(state.fed[-1])
                        state.hidden.append(fed_hidden[-1])
                state.step += 1
        results = {
            slot: UnitResult(
                slot=slot,
                listen=state.listen,
                fed=state.fed,
                origins=state.origins,
                text=self.vocabulary.decode(state.words) if state.words else "",
                end_of_turn=state.end_of_turn,
                codes=[],
            )
            for slot, state in states.items()
        }
        self._speak([states[u.slot] for u in units if not states[u.slot].listen], results)
        for slot, state in states.items():
            if state.barged_in:
                self._end_speech(slot)
        for unit in units:
            turn = self.turns[unit.slot]
            turn.units += 1
            turn.unit_lengths.append(self.memory.length(unit.slot) - before[unit.slot])
            self._slide(unit.slot)
        return [results[unit.slot] for unit in units]

    def _slide(self, slot: int) -> None:
        """The reference's "basic" sliding window, after a unit: a memory past the high
        mark forgets its oldest whole units (never the system prompt) until it is at or
        below the low mark; the kept keys are rotated back to their new places, and the
        conversation goes on from the shorter memory."""
        length = self.memory.length(slot)
        if length <= self.window.high:
            return
        turn = self.turns[slot]
        gone = 0
        while turn.unit_lengths and length - gone > self.window.low:
            gone += turn.unit_lengths.popleft()
        start = turn.prompt_length
        self.language.stack.drop(self.memory, slot, start, start + gone)

    def _end_speech(self, slot: int) -> None:
        """The open turn's speech is over (a barge-in closed it): the speech model starts
        the next turn afresh."""
        self.speech_memory.reset(slot)
        turn = self.turns[slot]
        turn.speech_units.clear()
        turn.speech_length = 0

    def _make_room(self, slot: int, condition: int) -> None:
        """A turn longer than the speech model's memory starts its context afresh (the
        reference has no bound; its model was trained on 4096 positions): before a unit
        whose condition and 26 steps would not fit."""
        turn = self.turns[slot]
        if turn.speech_length + condition + TTS_STEPS_PER_UNIT > self.speech_memory.capacity:
            self.speech_memory.reset(slot)
            turn.speech_units.clear()
            turn.speech_length = 0

    def _spoke(
        self,
        slot: int,
        words: list[int],
        hidden: torch.Tensor | None,
        codes: list[int],
        *,
        end_of_turn: bool,
        condition: int,
    ) -> None:
        """What the speech model's memory now holds for `slot` (replays feed it again)."""
        turn = self.turns[slot]
        if end_of_turn:
            turn.speech_units.clear()
            turn.speech_length = 0
            return
        turn.speech_units.append((words, hidden, codes))
        turn.speech_length += condition + len(codes)

    def _speak(self, speaking: Sequence[_Deciding], results: dict[int, UnitResult]) -> None:
        requests = []
        for state in speaking:
            slot = state.unit.slot
            hidden = torch.stack(state.hidden) if state.hidden else None
            condition = self.speech.condition(state.words, hidden)
            self._make_room(slot, condition.shape[0])
            # a turn's first unit (the speech memory is empty) and its last may stop early
            opens_turn = self.speech_memory.length(slot) == 0
            results[slot].opens_turn = opens_turn
            state.hidden_stack = hidden
            state.condition_length = condition.shape[0]
            requests.append(
                SpeechRequest(
                    slot=slot,
                    condition=condition,
                    min_new=0 if (state.end_of_turn or opens_turn) else TTS_STEPS_PER_UNIT,
                    generator=self.turns[slot].speech_generator,
                )
            )
        if not requests:
            return
        codes = self.speech.generate(self.speech_memory, requests)
        for state in speaking:
            slot = state.unit.slot
            results[slot].codes = codes[slot]
            self._spoke(
                slot,
                state.words,
                state.hidden_stack,
                codes[slot],
                end_of_turn=state.end_of_turn,
                condition=state.condition_length,
            )
            if state.end_of_turn:
                self.speech_memory.reset(slot)

    # ------------------------------------------------------------------ replay

    @torch.no_grad()
    def replay(self, slot: int, units: Sequence[ReplayUnit]) -> None:
        """Feed recorded units to an opened slot, as they were fed when they were made:
        the units' prefills, fed tokens and `</unit>`s in one forward (one per stretch
        between two slides of the window, which happen after the same units as they did);
        the decision history, the turn state and the speech model's open turn rebuilt from
        what was fed. Call `finish_replay` after the last."""
        group: list[ReplayUnit] = []
        length = self.memory.length(slot)
        for unit in units:
            group.append(unit)
            length += unit.positions
            if length > self.window.high:
                self._replay_group(slot, group)
                self._slide(slot)
                group, length = [], self.memory.length(slot)
        if group:
            self._replay_group(slot, group)

    def _replay_group(self, slot: int, units: Sequence[ReplayUnit]) -> None:
        special = self.special
        rows, spans = [], []
        at = 0
        for unit in units:
            prefill = self._prefill_row(unit.unit)
            tokens = self.language.embed([*unit.fed, special.unit_end])
            rows.append(torch.cat([prefill, tokens]))
            spans.append(at + prefill.shape[0])
            at += prefill.shape[0] + tokens.shape[0]
        (hidden,) = self.language.forward(self.memory, [(slot, torch.cat(rows))])
        turn = self.turns[slot]
        for unit, start in zip(units, spans, strict=True):
            for token in decisions(
                unit.fed, unit.origins, listen=special.listen, chunk_eos=special.chunk_eos
            ):
                turn.history.add(token)
            end_of_turn = False
            for token in unit.fed[:-1]:  # the last fed token ends the unit
                turn.turn_ended = False
                end_of_turn = token == special.turn_eos
                turn.turn_ended = end_of_turn
            turn.units += 1
            turn.unit_lengths.append(unit.positions)
            if unit.fed[0] == special.turn_eos and unit.origins[0] == TokenOrigin.FORCED:
                turn.speech_units.clear()  # a barge-in ended the turn's speech
                turn.speech_length = 0
            if unit.fed[-1] == special.listen:
                continue
            words = list(unit.fed[1:-1])
            word_hidden = hidden[start + 1 : start + len(unit.fed) - 1] if words else None
            condition = len(words) + 1
            if turn.speech_length + condition + TTS_STEPS_PER_UNIT > self.speech_memory.capacity:
                turn.speech_units.clear()
                turn.speech_length = 0
            self._spoke(
                slot,
                words,
                word_hidden,
                list(unit.codes),
                end_of_turn=end_of_turn,
                condition=condition,
            )

    @torch.no_grad()
    def finish_replay(self, slot: int) -> None:
        """The speech model's memory of the open turn, fed again (its conditions and the
        codes it gave, in one forward)."""
        turn = self.turns[slot]
        self.speech_memory.reset(slot)
        pieces = []
        for words, hidden, codes in turn.speech_units:
            pieces.append(self.speech.condition(words, hidden))
            if codes:
                device = pieces[-1].device
                pieces.append(self.speech.emb_code[0](torch.tensor(codes, device=device)))
        if pieces:
            self.speech.stack.forward(self.speech_memory, [(slot, torch.cat(pieces))])


__all__ = [
    "MAX_STEPS_PER_UNIT",
    "ContextWindow",
    "DuplexLoop",
    "Prompt",
    "ReplayUnit",
    "SlotTurn",
    "UnitInput",
    "UnitResult",
]
