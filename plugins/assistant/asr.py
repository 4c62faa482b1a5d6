"""Speech recognition with pocketsphinx and the en-us model its wheel ships.

Two modes. `grammar` decodes against a JSGF grammar of the built-in responder's commands:
fast (about 0.02 of real time here) and exact on clear speech, but it hears nothing else.
`lm` uses the bundled large-vocabulary language model: anything can be said, at about 0.2
of real time, with some words wrong. The assistant runs both (plugin.py): the language
model first, and the grammar when the language model's words make no command.

A decoder is not thread-safe and is slow to load, so each executor thread keeps its own.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np

SAMPLE_RATE_HZ = 16_000
DITHER = 0.003

GRAMMAR = """#JSGF V1.0;
grammar assistant;
public <utterance> = <greeting> | <question> | <thanks> | <bye>;
<greeting> = hello | hi | hey | hello there | good morning | good evening;
<question> = what time is it | what is the time | what day is it | what is the date
           | what is your name | who are you | how are you | can you hear me;
<thanks> = thank you | thanks;
<bye> = goodbye | bye | see you;
"""


def grammar_text() -> str:
    return GRAMMAR


class SphinxRecognizer:
    def __init__(self, mode: str = "grammar") -> None:
        if mode not in ("grammar", "lm"):
            raise ValueError(f"unknown recognition mode {mode!r}: grammar or lm")
        self.mode = mode
        self._local = threading.local()
        self._grammar_file: Path | None = None

    def _decoder(self):
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            from pocketsphinx import Decoder

            if self.mode == "grammar":
                if self._grammar_file is None:
                    fd, name = tempfile.mkstemp(suffix=".gram", prefix="duplex-assistant-")
                    with open(fd, "w") as handle:
                        handle.write(grammar_text())
                    self._grammar_file = Path(name)
                decoder = Decoder(
                    samprate=SAMPLE_RATE_HZ,
                    lm=None,
                    jsgf=str(self._grammar_file),
                    cmn="batch",
                    loglevel="FATAL",
                )
            else:
                decoder = Decoder(samprate=SAMPLE_RATE_HZ, cmn="batch", loglevel="FATAL")
            self._local.decoder = decoder
        return decoder

    def recognize(self, audio: np.ndarray, sample_rate_hz: int = SAMPLE_RATE_HZ) -> str:
        """The words heard in `audio` (mono float32 at 16 kHz), lower case; "" for none."""
        if sample_rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(f"pocketsphinx's model wants {SAMPLE_RATE_HZ} Hz")
        if audio.size == 0:
            return ""
        # digital silence (synthetic speech, a muted microphone) throws the acoustic
        # model's normalisation off: a fixed, seeded noise floor at -50 dBFS keeps results
        # deterministic and right (cmn=batch normalises each utterance on its own)
        noise = np.random.default_rng(0).normal(0.0, DITHER, audio.size).astype(np.float32)
        pcm = (np.clip(audio + noise, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        decoder = self._decoder()
        decoder.start_utt()
        decoder.process_raw(pcm, False, True)
        decoder.end_utt()
        hypothesis = decoder.hyp()
        return hypothesis.hypstr.strip().lower() if hypothesis is not None else ""
