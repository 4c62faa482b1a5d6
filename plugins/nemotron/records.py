"""A Nemotron VoiceChat session's history: one fixed-size record per stepped frame.

The model's state after N frames is a pure function of the slot's options (its prompt) and
what its N steps were fed, so a record holds exactly that (little-endian):

    pcm16[1280]        the frame's input audio (the step itself took it quantized to 16 bits,
                       so a replay hears the same numbers)
    uint32 text        the text channel's token of the frame (sampled, or forced: a barge-in)
    uint32 asr         the user-transcript channel's token
    int32  function    the function channel's token (-1: the checkpoint has no function head)
    uint16 codes[Q]    the speech decoder's codes of the frame (Q = its quantizers, 31)
    uint16 injected    how many tool-result tokens were fed before the frame (at most K)
    uint32 tokens[K]   those tokens (the rest zero)
    uint16 flags       bit 0: a barge-in came before the frame (its half-written tool call
                       was dropped: a replay drops it too)

Nemotron's input is continuous audio features, not discrete codes like Moshi's, so the
audio itself is the record's bulk: 2,702 bytes a frame with the published checkpoint's 31
quantizers and K = 16, about 34 kB per second of conversation (a 10-minute session: 20 MB
in Redis). A restore replays the frames without sampling (the tokens and codes are given),
a call's frames in one forward of each part (see docs/models.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from plugins.nemotron.streaming import FRAME_SAMPLES

NO_FUNCTION = -1
#: flags: a barge-in came before the frame
INTERRUPTED = 1


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    quantizers: int
    max_injected: int

    @property
    def size(self) -> int:
        return FRAME_SAMPLES * 2 + 4 * 3 + 2 * self.quantizers + 2 + 4 * self.max_injected + 2

    def dtype(self) -> np.dtype:
        return np.dtype(
            [
                ("pcm", "<i2", (FRAME_SAMPLES,)),
                ("text", "<u4"),
                ("asr", "<u4"),
                ("function", "<i4"),
                ("codes", "<u2", (self.quantizers,)),
                ("injected", "<u2"),
                ("tokens", "<u4", (self.max_injected,)),
                ("flags", "<u2"),
            ]
        )


@dataclasses.dataclass
class FrameRecord:
    pcm: np.ndarray
    text: int
    asr: int
    function: int
    codes: np.ndarray
    injected: list[int]
    interrupted: bool = False


def encode(layout: RecordLayout, record: FrameRecord) -> bytes:
    if len(record.injected) > layout.max_injected:
        raise ValueError(f"{len(record.injected)} injected tokens > {layout.max_injected}")
    row = np.zeros((), dtype=layout.dtype())
    row["pcm"] = record.pcm
    row["text"], row["asr"], row["function"] = record.text, record.asr, record.function
    row["codes"] = record.codes
    row["injected"] = len(record.injected)
    row["tokens"][: len(record.injected)] = record.injected
    row["flags"] = INTERRUPTED if record.interrupted else 0
    data = row.tobytes()
    assert len(data) == layout.size
    return data


def decode(layout: RecordLayout, history: bytes) -> list[FrameRecord]:
    if len(history) % layout.size:
        raise ValueError(f"a history of {len(history)} bytes is not {layout.size}-byte records")
    rows = np.frombuffer(history, dtype=layout.dtype())
    return [
        FrameRecord(
            row["pcm"].copy(),
            int(row["text"]),
            int(row["asr"]),
            int(row["function"]),
            row["codes"].copy(),
            [int(t) for t in row["tokens"][: int(row["injected"])]],
            bool(int(row["flags"]) & INTERRUPTED),
        )
        for row in rows
    ]


__all__ = ["NO_FUNCTION", "FrameRecord", "RecordLayout", "decode", "encode"]
