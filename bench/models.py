"""The models on this machine: the assistant's speech stages and response latency, and the
vLLM stage's start-up.

    .venv/bin/python -m bench.models [--turns 10]        (assistant, TTS, ASR)
    .venv-vllm/bin/python -m bench.models --vllm          (adds the vLLM stage; `make test-vllm`
                                                          makes that venv)

tts        espeak-ng: seconds of speech per second of synthesis (real-time factor = 1/x)
asr        pocketsphinx, grammar and lm modes: compute time / audio time, and whether the
           phrase came back
assistant  a real redis-server, `duplex worker --plugin assistant`, `duplex api`; a client
           streams a synthesized question in real time and times, from the end of its
           speech: speech_stopped (the VAD's silence_duration_ms is 500 ms of it), the
           transcript, and the first audio delta of the answer
vllm       AsyncLLM start-up on the tiny Llama of harness/tiny_llama.py (made here), then one
           request's time to first token and tokens per second
Writes docs/models.md (section models).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np

from bench.common import Stack, machine, now_utc, write_section
from harness.speech import ASSISTANT_SESSION, say, spoken
from plugins.assistant import AssistantPlugin
from plugins.assistant.tts import EspeakSynthesizer
from shared.client.duplex_client import DuplexClient

PHRASES = [
    "hello",
    "what time is it",
    "what is your name",
    "thank you",
    "good morning",
    "repeat after me one two three",
    "can you hear me",
    "goodbye",
]
SENTENCES = [
    "Hello! How can I help you?",
    "It is nine o'clock.",
    "I am the duplex serve assistant.",
    "The quick brown fox jumps over the lazy dog.",
]


def tts_speed() -> float:
    tts = EspeakSynthesizer.shared()
    tts.synthesize("warm up")
    started, audio_s = time.perf_counter(), 0.0
    for _ in range(5):
        for sentence in SENTENCES:
            audio_s += len(tts.synthesize(sentence)) / tts.sample_rate_hz
    return audio_s / (time.perf_counter() - started)


def asr_rtf(mode: str) -> tuple[float, int]:
    plugin = AssistantPlugin(asr_mode=mode)
    plugin.transcribe(spoken("hello"), 16000)  # load the decoders
    compute, audio_s, right = 0.0, 0.0, 0
    for phrase in PHRASES:
        audio = spoken(phrase)
        started = time.perf_counter()
        heard = plugin.transcribe(audio, 16000)
        compute += time.perf_counter() - started
        audio_s += len(audio) / 16000
        right += heard == phrase.replace(",", "")
    return compute / audio_s, right


async def assistant_latency(turns: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"stopped": [], "transcript": [], "first_audio": []}
    with Stack(plugin="assistant") as stack:
        client = await DuplexClient(stack.apis[0].base, heartbeat_s=None).connect(ASSISTANT_SESSION)
        for turn in range(turns):
            phrase = PHRASES[turn % len(PHRASES)]
            speech = spoken(phrase, lead_s=0.3, tail_s=0.0)
            await say(client, speech)
            end_of_speech = time.monotonic()
            silence = asyncio.create_task(say(client, np.zeros(16000 * 2, np.float32)))
            marks = {}
            while "first_audio" not in marks:
                event = await client.recv(timeout=30)
                kind = event.wire_type
                if kind == "input_audio_buffer.speech_stopped":
                    marks.setdefault("stopped", time.monotonic())
                elif kind == "conversation.item.input_audio_transcription.completed":
                    marks.setdefault("transcript", time.monotonic())
                elif kind == "response.output_audio.delta":
                    marks["first_audio"] = time.monotonic()
            await silence
            await client.until("response.done", timeout=30)
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


async def main(args: argparse.Namespace) -> None:
    tts = tts_speed()
    asr = {mode: asr_rtf(mode) for mode in ("hybrid", "lm", "grammar")}
    latency = await assistant_latency(args.turns)
    rows = [
        "| measure | value |",
        "|---|---|",
        f"| TTS (espeak-ng): seconds of speech per second of compute | {tts:.0f}x "
        f"(real-time factor {1 / tts:.4f}) |",
    ]
    for mode, (rtf, right) in asr.items():
        rows.append(
            f"| ASR (pocketsphinx, {mode}): real-time factor; phrases exactly right | "
            f"{rtf:.3f}; {right} of {len(PHRASES)} |"
        )
    labels = {
        "stopped": "end of user speech -> speech_stopped (VAD silence 500 ms)",
        "transcript": "end of user speech -> transcription completed",
        "first_audio": "end of user speech -> first audio delta of the answer",
    }
    for key, label in labels.items():
        values = sorted(latency[key])
        rows.append(
            f"| assistant: {label}, median (min-max) over {len(values)} turns | "
            f"{statistics.median(values) * 1000:.0f} ms ({values[0] * 1000:.0f}-"
            f"{values[-1] * 1000:.0f}) |"
        )
    if args.vllm:
        v = await vllm_figures()
        rows += [
            f"| vLLM stage start-up (AsyncLLM, tiny Llama, CPU build) | {v['startup_s']:.1f} s |",
            f"| vLLM stage: submit -> first token; decode rate | {v['first_token_ms']:.0f} ms; "
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
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--vllm", action="store_true", help="also the vLLM stage (.venv-vllm)")
    asyncio.run(main(parser.parse_args()))
