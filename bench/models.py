"""The models on this machine: the assistant's speech stages and response latency, and the
vLLM stage's start-up.

    .venv/bin/python -m bench.models [--turns 12]        (assistant, TTS, ASR)
    .venv-vllm/bin/python -m bench.models --vllm          (adds the vLLM stage; `make test-vllm`
                                                          makes that venv)

tts        espeak-ng: seconds of speech per second of synthesis (real-time factor = 1/x)
asr        each recogniser (Whisper tiny.en; pocketsphinx hybrid, lm, grammar) on the same
           phrases said by espeak-ng: phrases exactly right and word error rate (words
           compared lower case, without punctuation, numbers as words), compute time /
           audio time, the final transcript's compute per turn; for Whisper also its
           partial decodes (one per 500 ms of speech, as the worker runs them)
assistant  a real redis-server, `duplex worker --plugin assistant` with each recogniser
           (DUPLEX_ASSISTANT_ASR), `duplex api`; a client streams a synthesized question in
           real time and times, from the end of its speech: speech_stopped (the VAD's
           silence_duration_ms is 500 ms of it), the transcript, and the first audio delta
           of the answer
vllm       AsyncLLM start-up on the tiny Llama of harness/tiny_llama.py (made here), then one
           request's time to first token and tokens per second
Writes docs/models.md (section models).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time

import numpy as np

from bench.common import Stack, machine, now_utc, write_section
from harness.speech import ASSISTANT_SESSION, say, spoken
from plugins.assistant import AssistantPlugin
from plugins.assistant.tts import EspeakSynthesizer
from shared.client.duplex_client import DuplexClient

#: the responder's commands (the assistant's turns say these), then everyday sentences
COMMANDS = [
    "hello",
    "what time is it",
    "what is your name",
    "thank you",
    "good morning",
    "repeat after me one two three",
    "can you hear me",
    "goodbye",
]
PHRASES = [
    *COMMANDS,
    "hello there",
    "good evening",
    "what is the date",
    "what day is it",
    "who are you",
    "how are you",
    "see you",
    "repeat after me the quick brown fox",
    "the quick brown fox jumps over the lazy dog",
    "please turn on the lights in the kitchen",
    "set a timer for ten minutes",
    "what is the weather like today",
    "call my mother tomorrow morning",
    "i would like a cup of coffee",
    "how far is the nearest train station",
    "play some music",
    "remind me to buy milk",
    "the meeting starts at three o'clock",
]
SENTENCES = [
    "Hello! How can I help you?",
    "It is nine o'clock.",
    "I am the duplex serve assistant.",
    "The quick brown fox jumps over the lazy dog.",
]
RECOGNISERS = ("whisper", "hybrid", "lm", "grammar")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
CADENCE_S = 0.5  # the worker's partial cadence (services/worker/engine/transcription.py)


def tts_speed() -> float:
    tts = EspeakSynthesizer.shared()
    tts.synthesize("warm up")
    started, audio_s = time.perf_counter(), 0.0
    for _ in range(5):
        for sentence in SENTENCES:
            audio_s += len(tts.synthesize(sentence)) / tts.sample_rate_hz
    return audio_s / (time.perf_counter() - started)


def words(text: str) -> list[str]:
    """Lower case, no punctuation, numbers as words: Whisper writes "10 minutes"."""
    return [
        NUMBERS[int(w)] if w.isdigit() and int(w) < len(NUMBERS) else w
        for w in re.findall(r"[a-z0-9']+", text.lower())
    ]


def word_errors(heard: list[str], said: list[str]) -> int:
    """Substitutions + insertions + deletions (Levenshtein distance over words)."""
    row = list(range(len(heard) + 1))
    for i, word in enumerate(said, 1):
        previous, row[0] = row[0], i
        for j, other in enumerate(heard, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != other))
    return row[-1]


def asr_figures(mode: str, audios: list[tuple[str, np.ndarray]]) -> dict[str, float]:
    plugin = AssistantPlugin(asr_mode=mode)
    plugin.transcribe(audios[0][1], 16000)  # load the model / the decoders
    exact, errors, total, audio_s = 0, 0, 0, 0.0
    finals: list[float] = []
    partials: list[float] = []
    for phrase, audio in audios:
        started = time.perf_counter()
        heard = plugin.transcribe(audio, 16000) or ""
        finals.append(time.perf_counter() - started)
        audio_s += len(audio) / 16000
        exact += words(heard) == words(phrase)
        errors += word_errors(words(heard), words(phrase))
        total += len(words(phrase))
        if words(heard) != words(phrase):
            print(f"  {mode}: {phrase!r} heard as {heard!r}")
        if plugin.transcribes_partials:
            speech_end = len(audio) - 16000  # spoken(): 1 s of silence after the speech
            for end in range(int(CADENCE_S * 16000), speech_end, int(CADENCE_S * 16000)):
                started = time.perf_counter()
                plugin.transcribe_partial(audio[:end], 16000)
                partials.append(time.perf_counter() - started)
    figures = {
        "exact": exact,
        "wer": errors / total,
        "rtf": sum(finals) / audio_s,
        "final_ms": statistics.median(finals) * 1000,
        "final_max_ms": max(finals) * 1000,
    }
    if partials:
        figures["partial_ms"] = statistics.median(partials) * 1000
        figures["partial_share"] = statistics.mean(partials) / CADENCE_S
    return figures


async def assistant_latency(turns: int, asr: str) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {
        "stopped": [],
        "transcript": [],
        "first_audio": [],
        "deltas": [],
    }
    # the session asks for input transcription, so partials run while the user speaks
    # (with Whisper), as they would for a client that shows them
    audio = {"input": {**ASSISTANT_SESSION["audio"]["input"], "transcription": {}}}
    session = {**ASSISTANT_SESSION, "audio": audio}
    with Stack(plugin="assistant", worker_env={"DUPLEX_ASSISTANT_ASR": asr}) as stack:
        client = await DuplexClient(stack.apis[0].base, heartbeat_s=None).connect(session)
        for turn in range(turns):
            phrase = COMMANDS[turn % len(COMMANDS)]
            speech = spoken(phrase, lead_s=0.3, tail_s=0.0)
            await say(client, speech)
            end_of_speech = time.monotonic()
            silence = asyncio.create_task(say(client, np.zeros(16000 * 2, np.float32)))
            marks, deltas = {}, 0
            while "first_audio" not in marks:
                event = await client.recv(timeout=30)
                kind = event.wire_type
                if kind == "input_audio_buffer.speech_stopped":
                    marks.setdefault("stopped", time.monotonic())
                elif kind == "conversation.item.input_audio_transcription.delta":
                    deltas += 1
                elif kind == "conversation.item.input_audio_transcription.completed":
                    marks.setdefault("transcript", time.monotonic())
                elif kind == "response.output_audio.delta":
                    marks["first_audio"] = time.monotonic()
            await silence
            await client.until("response.done", timeout=30)
            figures["deltas"].append(deltas)
            for key, at in marks.items():
                figures[key].append(at - end_of_speech)
        await client.close()
    return figures


async def vllm_figures() -> dict[str, float]:
    from harness.tiny_llama import TINY_ENGINE, make_tiny_llama
    from services.worker.stages.vllm import EngineSettings, VllmStagePort, build_engine
    from shared.contracts import DuplexFence, StagePlan, TextRequest

    path = tempfile.mkdtemp(prefix="tiny-llama-")
    make_tiny_llama(path)
    started = time.perf_counter()
    engine = build_engine(EngineSettings(path, **TINY_ENGINE))
    startup = time.perf_counter() - started
    port = VllmStagePort(engine, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 64})
    arrivals: list[float] = []
    done = asyncio.Event()

    def sink(output) -> None:
        arrivals.append(time.perf_counter())
        if output.kind != "text":
            done.set()

    fence = DuplexFence("duplex-bench", 1, 1)
    port.bind(fence.session_id, sink)
    request_id = await port.ensure(fence, "llm")
    started = time.perf_counter()
    await port.submit_initial(StagePlan(request_id, fence, "llm", TextRequest("hello world")))
    await done.wait()
    first = arrivals[0] - started
    rate = 64 / (arrivals[-1] - started)
    await port.shutdown()
    return {"startup_s": startup, "first_token_ms": first * 1000, "tokens_per_s": rate}


LABELS = {
    "whisper": "Whisper tiny.en (int8, 2 threads)",
    "hybrid": "pocketsphinx hybrid",
    "lm": "pocketsphinx lm",
    "grammar": "pocketsphinx grammar",
}


def spread(values: list[float]) -> str:
    values = sorted(values)
    return (
        f"{statistics.median(values) * 1000:.0f} ms "
        f"({values[0] * 1000:.0f}-{values[-1] * 1000:.0f})"
    )


async def main(args: argparse.Namespace) -> None:
    tts = tts_speed()
    audios = [(phrase, spoken(phrase)) for phrase in PHRASES]
    asr = {mode: asr_figures(mode, audios) for mode in RECOGNISERS}
    latency = {mode: await assistant_latency(args.turns, mode) for mode in ("whisper", "hybrid")}
    rows = [
        f"Speech stages, on {len(PHRASES)} phrases said by espeak-ng (the responder's commands "
        "and everyday sentences; 0.4 s of silence before, 1 s after):",
        "",
        "| recogniser | exactly right | word error rate | real-time factor "
        "| final transcript: compute per turn, median (max) "
        "| partial (every 500 ms of speech): compute, median; share of a core while speaking |",
        "|---|---|---|---|---|---|",
    ]
    for mode, f in asr.items():
        partial = (
            f"{f['partial_ms']:.0f} ms; {f['partial_share']:.0%}" if "partial_ms" in f else "-"
        )
        rows.append(
            f"| {LABELS[mode]} | {f['exact']} of {len(PHRASES)} | {f['wer']:.1%} | "
            f"{f['rtf']:.3f} | {f['final_ms']:.0f} ms ({f['final_max_ms']:.0f}) | {partial} |"
        )
    rows += [
        "",
        f"TTS (espeak-ng): {tts:.0f} seconds of speech per second of compute "
        f"(real-time factor {1 / tts:.4f}).",
        "",
        f"The assistant through `duplex worker` and `duplex api`, {args.turns} spoken turns "
        "each (the commands above, streamed in real time), from the end of the user's speech; "
        "median (min-max):",
        "",
        "| measure | Whisper (default) | pocketsphinx hybrid |",
        "|---|---|---|",
    ]
    labels = {
        "stopped": "-> speech_stopped (VAD silence 500 ms)",
        "transcript": "-> transcription completed (the final transcript)",
        "first_audio": "-> first audio delta of the answer",
    }
    for key, label in labels.items():
        rows.append(
            f"| {label} | {spread(latency['whisper'][key])} | {spread(latency['hybrid'][key])} |"
        )
    rows.append(
        "| partial transcripts (`...transcription.delta` events) per turn, median | "
        f"{statistics.median(latency['whisper']['deltas']):.0f} | "
        f"{statistics.median(latency['hybrid']['deltas']):.0f} |"
    )
    if args.vllm:
        v = await vllm_figures()
        rows += [
            "",
            "| vLLM stage (tiny Llama, CPU build) | value |",
            "|---|---|",
            f"| start-up (AsyncLLM) | {v['startup_s']:.1f} s |",
            f"| submit -> first token; decode rate | {v['first_token_ms']:.0f} ms; "
            f"{v['tokens_per_s']:.0f} tokens/s |",
        ]
    command = "python -m bench.models" + (" --vllm" if args.vllm else "")
    table = "\n".join(
        [f"Measured {now_utc()} on {machine()}: `{command} --turns {args.turns}`.", "", *rows]
    )
    print(table)
    write_section("models.md", "models", table, "Measured on this machine (`bench/models.py`)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--vllm", action="store_true", help="also the vLLM stage (.venv-vllm)")
    asyncio.run(main(parser.parse_args()))
