"""MiniCPM-o 4.5 served to many slots: a unit of raw input in (one second of 16 kHz audio and
the camera frames sent with it), the model's decision, words, voice and record out.

`UnitEngine` owns what each slot holds between units besides the duplex loop's memory: its
mel stream and audio-encoder memory (audio.py), its voice stream (vocoder.py), and the
records it made. A unit of several slots is:

1. the audio quantised to pcm16 (what the record keeps, so a replay hears the same numbers),
   each slot's mel computed (numpy, per slot), then the audio encoder for all slots in one
   forward;
2. every slot's camera frames decoded, checked and embedded, all in one vision forward (a
   frame that cannot be used is reported as the unit's error; the unit goes on without it);
3. the duplex loop's unit step for all slots (duplex_loop.py);
4. each speaking slot's codes through its voice stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from plugins.minicpmo.audio import EncoderKV, MelStream, clip_mel
from plugins.minicpmo.duplex_loop import ContextWindow, DuplexLoop, Prompt, ReplayUnit, UnitInput
from plugins.minicpmo.model import MiniCPMOWeights
from plugins.minicpmo.records import UNIT_SAMPLES, TokenOrigin, UnitRecord, dequantise, quantise
from plugins.minicpmo.text_sampling import TextSampling
from plugins.minicpmo.vision import (
    DEFAULT_FRAME_BOUNDS,
    FrameBounds,
    ImageRejected,
    PreparedFrame,
    load_frame,
)
from plugins.minicpmo.vocoder import OUTPUT_RATE, CodecDecoder, SpeechStream

#: the reference voice's log-mel floor: the reference computes it with its streaming
#: processor's feature extractor, in the mode that processor left it in (see the golden
#: ref-voice scenario)
VOICE_DYNAMIC_FLOOR = True


def quantise_voice(voice: np.ndarray) -> np.ndarray:
    """A reference voice as the model hears it: 16-bit samples (as every input is)."""
    return dequantise(quantise(np.asarray(voice, dtype=np.float32)))


#: the speech model's memory per slot: a turn's conditions and codes (about 45 positions a
#: second of speech); a turn that outgrows it starts the speech model's context afresh
DEFAULT_SPEECH_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    slots: int
    #: how much of the conversation the language model keeps
    window: ContextWindow = ContextWindow()
    sampling: TextSampling = TextSampling()
    speech_greedy: bool = False
    speech_tokens: int = DEFAULT_SPEECH_TOKENS
    frame_bounds: FrameBounds = DEFAULT_FRAME_BOUNDS


@dataclasses.dataclass
class UnitRequest:
    slot: int
    audio: np.ndarray  # float32 [16000] at 16 kHz
    images: Sequence[bytes] = ()
    #: a barge-in: the model stops speaking (its open turn is closed) and listens this unit
    force_listen: bool = False


@dataclasses.dataclass
class UnitOutcome:
    slot: int
    listen: bool
    text: str
    end_of_turn: bool
    #: the voice this unit releases: float32 at 24 kHz (1 s of silence when it listened)
    audio: np.ndarray
    record: UnitRecord
    fed: list[int]
    origins: list[TokenOrigin]
    codes: list[int]
    #: (code, message) of a camera frame the unit could not use (the unit went on without it)
    error: tuple[str, str] | None = None


class _SlotInput:
    """A slot's audio front end and voice between units."""

    def __init__(self, engine: UnitEngine) -> None:
        self.mel = MelStream()
        self.encoder: EncoderKV = engine.weights.audio.new_kv()
        self.voice = SpeechStream(engine.decoder)


class UnitEngine:
    def __init__(
        self, weights: MiniCPMOWeights, decoder: CodecDecoder, settings: EngineSettings
    ) -> None:
        self.weights = weights
        self.decoder = decoder
        self.settings = settings
        self.loop = DuplexLoop(
            language=weights.language,
            speech=weights.speech,
            vocabulary=weights.vocabulary,
            slots=settings.slots,
            window=settings.window,
            speech_tokens=settings.speech_tokens,
            sampling=settings.sampling,
            speech_greedy=settings.speech_greedy,
        )
        self.inputs: list[_SlotInput | None] = [None] * settings.slots
        #: the records each restoring slot has still to replay
        self.restoring: dict[int, list[UnitRecord]] = {}

    def prompt(self, prefix: str, suffix: str, voice: np.ndarray | None = None) -> Prompt:
        """A conversation's start: the system prompt's prefix and suffix encoded apart, as
        the reference feeds them (a merge across their boundary would change the ids), and
        a reference voice (16 kHz float32, at most 30 s) between them: its whole clip
        through the audio encoder, as the reference's `prepare` does."""
        vocabulary = self.weights.vocabulary
        embedded = None
        if voice is not None:
            mel = clip_mel(quantise_voice(voice), dynamic_floor=VOICE_DYNAMIC_FLOOR)
            embedded = self.weights.audio.encode_clip(mel)
        return Prompt(vocabulary.encode(prefix), vocabulary.encode(suffix), embedded)

    def open(self, slot: int, prompt: Prompt, *, seed: int) -> None:
        self.inputs[slot] = _SlotInput(self)
        self.loop.open(slot, prompt, seed=seed)

    def close(self, slot: int) -> None:
        self.inputs[slot] = None
        self.restoring.pop(slot, None)

    # ------------------------------------------------------------------ restore

    def begin_restore(
        self, slot: int, prompt: Prompt, *, seed: int, records: Sequence[UnitRecord]
    ) -> None:
        """Open `slot` as the session whose units made `records`; `replay` then feeds them
        (in as many calls as the caller likes) until none is left."""
        self.open(slot, prompt, seed=seed)
        self.restoring[slot] = list(records)

    def replay_left(self, slot: int) -> int:
        return len(self.restoring.get(slot, ()))

    @torch.no_grad()
    def replay(self, slot: int, units: int) -> int:
        """Replay the slot's next `units` recorded units (at least one); returns how many
        are left. Each unit is heard again from its recorded audio (mel, then the audio
        encoder over the units in one forward), its camera frames embedded again, and the
        language model fed the units in one forward; after the last, the speech model's
        open turn and the voice stream (its codes rendered again)."""
        if slot not in self.restoring:
            return 0  # nothing left: nothing taken
        pending = self.restoring[slot]
        slot_input = self.inputs[slot]
        assert slot_input is not None
        batch, self.restoring[slot] = pending[:units], pending[units:]
        mels = [slot_input.mel.push(dequantise(record.audio)) for record in batch]
        embeds = self.weights.audio.replay(mels, slot_input.encoder)
        frames = [
            [
                load_frame(data, self.weights.vision.config, self.settings.frame_bounds)
                for data in record.images
            ]
            for record in batch
        ]
        flat = [frame for unit_frames in frames for frame in unit_frames]
        embedded = iter(self.weights.vision.embed_frames(flat) if flat else [])
        self.loop.replay(
            slot,
            [
                ReplayUnit(
                    unit=UnitInput(
                        slot=slot,
                        audio=embeds[index],
                        images=[next(embedded) for _ in frames[index]],
                    ),
                    fed=record.fed,
                    origins=record.origins,
                    codes=record.codes,
                )
                for index, record in enumerate(batch)
            ],
        )
        if self.restoring[slot]:
            return len(self.restoring[slot])
        del self.restoring[slot]
        self.loop.finish_replay(slot)
        # the voice stream as it was: the open turn's codes rendered again, the audio
        # thrown away (the vocoder's state is a function of them; a turn is bounded by the
        # speech model's memory)
        slot_input.voice.drop()
        for index, (_, _, codes) in enumerate(self.loop.turns[slot].speech_units):
            slot_input.voice.push(list(codes), first_unit=index == 0, end_of_turn=False)
        return 0

    def _frames(
        self, requests: Sequence[UnitRequest]
    ) -> tuple[dict[int, list[tuple[bytes, PreparedFrame]]], dict[int, tuple[str, str]]]:
        prepared: dict[int, list[tuple[bytes, PreparedFrame]]] = {}
        errors: dict[int, tuple[str, str]] = {}
        for request in requests:
            kept = []
            for data in request.images:
                try:
                    frame = load_frame(data, self.weights.vision.config, self.settings.frame_bounds)
                except ImageRejected as exc:
                    errors[request.slot] = (exc.code, exc.message)
                    continue
                kept.append((data, frame))
            prepared[request.slot] = kept
        return prepared, errors

    @torch.no_grad()
    def step(self, requests: Sequence[UnitRequest]) -> list[UnitOutcome]:
        """One unit of every slot in `requests` (each opened, each once)."""
        if not requests:
            return []
        weights = self.weights
        # what can fail on the input (a slot not open, a wrong length, a camera frame that
        # does not decode) is settled before any slot's state moves
        for request in requests:
            if self.inputs[request.slot] is None:
                raise ValueError(f"slot {request.slot} is not open")
            if request.audio.shape != (UNIT_SAMPLES,):
                raise ValueError(f"a unit is {UNIT_SAMPLES} samples, got {request.audio.shape}")
        prepared, errors = self._frames(requests)
        heard: dict[int, np.ndarray] = {}
        mels, kvs = [], []
        for request in requests:
            slot_input = self.inputs[request.slot]
            assert slot_input is not None
            heard[request.slot] = quantise(request.audio)
            mels.append(slot_input.mel.push(dequantise(heard[request.slot])))
            kvs.append(slot_input.encoder)
        audio_embeds = weights.audio.step(mels, kvs)
        flat = [frame for request in requests for _, frame in prepared[request.slot]]
        embedded = iter(weights.vision.embed_frames(flat) if flat else [])
        units = [
            UnitInput(
                slot=request.slot,
                audio=audio_embeds[index],
                images=[next(embedded) for _ in prepared[request.slot]],
                force_listen=request.force_listen,
            )
            for index, request in enumerate(requests)
        ]
        outcomes = []
        for request, result in zip(requests, self.loop.step(units), strict=True):
            slot_input = self.inputs[request.slot]
            assert slot_input is not None
            if request.force_listen or result.opens_turn:
                # a barge-in drops what the turn had still to say; a unit that opens the
                # speech model's context (a turn, or a turn longer than its memory) opens a
                # new stream: a replay rebuilds the stream from the same point
                slot_input.voice.drop()
            if result.listen:
                voice = np.zeros(OUTPUT_RATE, np.float32)
            else:
                voice = slot_input.voice.push(
                    result.codes, first_unit=result.opens_turn, end_of_turn=result.end_of_turn
                )
            outcomes.append(
                UnitOutcome(
                    slot=request.slot,
                    listen=result.listen,
                    text=result.text,
                    end_of_turn=result.end_of_turn,
                    audio=voice,
                    record=UnitRecord(
                        audio=heard[request.slot],
                        fed=tuple(result.fed),
                        origins=tuple(result.origins),
                        codes=tuple(result.codes),
                        images=tuple(data for data, _ in prepared[request.slot]),
                    ),
                    fed=result.fed,
                    origins=result.origins,
                    codes=result.codes,
                    error=errors.get(request.slot),
                )
            )
        return outcomes


__all__ = ["EngineSettings", "UnitEngine", "UnitOutcome", "UnitRequest"]
