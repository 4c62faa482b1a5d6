"""Pipecat's own VAD over the phrases pipecat_client.py's manual scenarios say, at every place
the microphone can put them.

In those scenarios Pipecat's Silero VAD (SileroVADAnalyzer with its defaults, in the user
aggregator) makes the turns: each phrase must start exactly one turn, or the scenario waits for
a turn that never comes. Whether it does depends on the silence before the phrase (how long the
server took to answer the one before), which moves the phrase against the VAD's 32 ms windows
and changes the model's state. So this says each scenario's phrases as the scenario does, with
the silence before one of them swept over 48 lengths in 20 ms microphone chunks (every one of
the 8 alignments to the VAD's windows, 6 times), and prints one JSON line:

    {"framework": "pipecat", "phrases": {"thanks": {"offsets": 48, "missed": 0, "split": 0}, ...}}

`missed`: offsets at which the phrase started no turn; `split`: at which it started several.

    .venv-frameworks/bin/python tests/frameworks/clients/pipecat_vad.py \
        --speech hello=hello.wav --speech long=long.wav --speech thanks=thanks.wav ...
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import speech
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADState

#: pipecat_client.py's microphone rate and chunk (20 ms)
MIC_RATE = 16000
CHUNK_BYTES = 2 * MIC_RATE // 50
#: the phrases each manual scenario says in order (the tool scenario's greeting is asked for
#: with LLMRunFrame, not said)
SCENARIOS = {"manual_turns": ["hello", "long", "thanks"], "manual_tool": ["weather"]}
#: the silence before each phrase when it is not the one swept: the microphone's idle
#: silence while the server answers
NOMINAL_GAP_BYTES = 2 * MIC_RATE
SWEPT_GAPS = 48


def turns_started(vad: SileroVADAnalyzer, parts: list[bytes]) -> list[int]:
    """How many times the VAD went from quiet to speaking in each part, fed in 20 ms chunks."""
    starts = [0] * len(parts)
    speaking = False
    for index, pcm in enumerate(parts):
        for offset in range(0, len(pcm), CHUNK_BYTES):
            state = vad._run_analyzer(pcm[offset : offset + CHUNK_BYTES])
            # a turn starts when the VAD says SPEAKING after QUIET/STARTING (as the user
            # aggregator's VADUserStartedSpeakingFrame), and ends when it says QUIET again
            if state == VADState.SPEAKING and not speaking:
                starts[index] += 1
            speaking = state in (VADState.SPEAKING, VADState.STOPPING)
    return starts


def sweep(phrases: dict[str, bytes]) -> dict[str, Any]:
    results: dict[str, dict[str, int]] = {}
    for said in SCENARIOS.values():
        for swept, name in enumerate(said):
            tally = results.setdefault(name, {"offsets": 0, "missed": 0, "split": 0})
            for chunks in range(SWEPT_GAPS):
                parts: list[bytes] = []
                # what comes after the swept phrase cannot change how it was heard
                for index, other in enumerate(said[: swept + 1]):
                    before = chunks * CHUNK_BYTES if index == swept else NOMINAL_GAP_BYTES
                    parts += [bytes(before), phrases[other]]
                # a fresh analyzer per run, as each client program makes its own
                vad = SileroVADAnalyzer(sample_rate=MIC_RATE)
                vad.set_sample_rate(MIC_RATE)
                count = turns_started(vad, parts)[-1]
                tally["offsets"] += 1
                tally["missed"] += int(count == 0)
                tally["split"] += int(count > 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speech", action="append", default=[], metavar="NAME=WAV")
    phrases = speech(parser.parse_args(), MIC_RATE)
    print(json.dumps({"framework": "pipecat", "phrases": sweep(phrases)}), flush=True)


if __name__ == "__main__":
    main()
