"""fujielab's Moshi client as a client of duplex serve: `fujielab-moshi-client`'s MoshiClient
(fujielab/moshi/moshi_client_lib.py), unchanged, on the Moshi binary protocol of `/api/chat`.

Only its library module is imported: the package has no `__init__` and its other module (the
command-line demo) imports sounddevice, which needs PortAudio; the library needs opuslib
(the system's libopus) and janus. MoshiClient is synchronous (its socket runs on a thread of
its own, its queues are janus's), so this program is too.

Its query is its own (sampling settings, which the server ignores): it replaces the URL's
query, so the API key goes in the path (`/key/<KEY>/api/chat`). The scenario:

- `connect`: `connect()` returns once the server's handshake (`0x00`) came;
- `quiet`: for SETTLE_S after it, with nothing sent, nothing comes back;
- `speak`: a phrase is fed at the microphone's pace (80 ms every 80 ms), then nothing: the
  audio it decodes back is counted in whole frames (its `get_audio_output` hands out 1920
  samples at a time), one per frame sent at most, the server stepping the model once per
  frame of the client's audio; its text queue gets only words (no "\\x00" or blank item,
  which a keepalive message put there);
- `disconnect`: `disconnect()` returns and nothing was logged above INFO by then.

Its Ogg writer puts every Opus packet in a page of ONE segment of `min(len, 255)` bytes, so a
packet of 255 bytes or more is mis-framed (the page says 255 bytes, the rest is read as the
next page): its default encoder (VoIP, 48 kb/s, variable rate) makes such packets for speech
at a normal level. The phrase is sent quiet, at the loudest of a few levels whose packets
all stay under 255 bytes, which this finds by encoding the phrase first with an encoder set
up as the client's (libopus is deterministic: the client's packets are these).

    .venv-frameworks/bin/python tests/frameworks/clients/fujielab_client.py \\
        --url http://127.0.0.1:8000 --api-key KEY --speech long=long.wav
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
import opuslib
import soxr
from _common import RATE, Report, StepFailed, read_wav
from fujielab.moshi.moshi_client_lib import MOSHI_CHUNK_SIZE, MoshiClient

FRAMEWORK = "fujielab"
#: the levels tried, loudest first: the phrase's peak, in full scale
PEAKS = (0.03, 0.01, 0.005, 0.002, 0.001)
#: the packet size fujielab's Ogg writer frames correctly: below one full lacing value
MAX_PACKET_BYTES = 254
#: how long the audio must stay quiet, after the frames expected came, to call it all
SETTLE_S = 2.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="fujielab's Moshi client against duplex")
    parser.add_argument("--url", required=True, help="http://HOST:PORT of duplex serve")
    parser.add_argument(
        "--api-key", help="a key the server accepts (none: a server without keys, moshi.server)"
    )
    parser.add_argument(
        "--speech", required=True, metavar="NAME=WAV", help="the phrase said, a mono pcm16 WAV"
    )
    parser.add_argument("--step-timeout", type=float, default=60.0)
    args = parser.parse_args()
    args.scenario, args.model = "moshi", "moshi"  # what Report records
    return args


def phrase(path: str) -> np.ndarray:
    """The phrase as float32 at 24 kHz, its peak at 1."""
    pcm, rate = read_wav(path)
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    samples = soxr.resample(samples, rate, RATE).astype(np.float32)
    return samples / max(float(np.abs(samples).max()), 1e-9)


def packet_sizes(audio: np.ndarray) -> list[int]:
    """The sizes of the Opus packets MoshiClient's encoder makes of `audio`: its settings
    (24 kHz mono, VoIP, libopus's default rate) and its float-to-int16 conversion, on whole
    frames of 1920 samples, a fresh encoder as each connection's is."""
    encoder = opuslib.Encoder(RATE, 1, opuslib.APPLICATION_VOIP)
    sizes = []
    for start in range(0, len(audio) - MOSHI_CHUNK_SIZE + 1, MOSHI_CHUNK_SIZE):
        frame = audio[start : start + MOSHI_CHUNK_SIZE]
        sizes.append(len(encoder.encode((frame * 32767).astype(np.int16).tobytes(), len(frame))))
    return sizes


def encodable(speech: np.ndarray) -> tuple[np.ndarray, float, int]:
    """The phrase at the loudest level of PEAKS that the client's Ogg writer frames right,
    in whole frames, with that level and its largest packet."""
    whole = speech[: len(speech) // MOSHI_CHUNK_SIZE * MOSHI_CHUNK_SIZE]
    tried = {}
    for peak in PEAKS:
        audio = (peak * whole).astype(np.float32)
        tried[peak] = largest = max(packet_sizes(audio))
        if largest <= MAX_PACKET_BYTES:
            return audio, peak, largest
    raise StepFailed("input", f"no level of the phrase encodes in packets < 255 bytes: {tried}")


class Listener:
    """Drains the client's audio and text queues on a thread, as an application would."""

    def __init__(self, client: MoshiClient) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.frames = 0
        self.peak = 0.0
        self.texts: list[str] = []
        self.last_audio = time.monotonic()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Listener:
        self.thread.start()
        return self

    def _run(self) -> None:
        while self.running:
            audio = self.client.get_audio_output(timeout=0.05)
            while (text := self.client.get_text_output(timeout=0)) is not None:
                with self.lock:
                    self.texts.append(text)
            if audio is not None:
                with self.lock:
                    self.frames += 1
                    self.peak = max(self.peak, float(np.abs(audio).max()))
                    self.last_audio = time.monotonic()

    def stop(self) -> None:
        self.running = False
        self.thread.join(timeout=5)

    def snapshot(self) -> tuple[int, float]:
        with self.lock:
            return self.frames, self.last_audio


def wait(step: str, timeout: float, predicate: Any, fail: bool = True) -> Any:
    """Poll `predicate()` until it is truthy, or fail `step` (with `fail`; else return what
    it last gave). The client is threads, not asyncio: nothing here is woken."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            if not fail:
                return value
            raise StepFailed(step, f"timed out after {timeout:.0f}s")
        time.sleep(0.02)
    return value


def main(args: argparse.Namespace, report: Report) -> None:
    name, _, path = args.speech.partition("=")
    audio, peak, largest = encodable(phrase(path))
    frames = len(audio) // MOSHI_CHUNK_SIZE
    report.step("input", phrase=name, frames=frames, peak=peak, largest_packet_bytes=largest)

    base = args.url.replace("http", "ws", 1).rstrip("/")
    client = MoshiClient()
    started = time.monotonic()
    path = f"/key/{args.api_key}/api/chat" if args.api_key else "/api/chat"
    client.connect(base + path)  # returns after the handshake
    report.step(
        "connect", handshake=client.is_connected(), seconds=round(time.monotonic() - started, 2)
    )
    listener = Listener(client).start()
    try:
        # nothing while nothing is sent, from the handshake on: the model waits for audio
        time.sleep(SETTLE_S)
        with listener.lock:
            report.step("quiet", frames_back=listener.frames, texts=list(listener.texts))
        # a microphone's pace: a frame every 80 ms, on the clock (not after each send)
        due = time.monotonic()
        for index in range(frames):
            due += MOSHI_CHUNK_SIZE / RATE
            client.add_audio_input(audio[index * MOSHI_CHUNK_SIZE : (index + 1) * MOSHI_CHUNK_SIZE])
            time.sleep(max(0.0, due - time.monotonic()))
        sent_at = time.monotonic()
        # a frame back for every frame sent, less the model's acoustic delay (moshi's LMGen
        # gives nothing for its first `max_delay` steps: one, for the tiny checkpoint); the
        # test tells whether they all came (a timeout here is reported, not raised)
        arrived = wait(
            "speak", args.step_timeout, lambda: listener.snapshot()[0] >= frames - 1, fail=False
        )
        # then nothing while nothing is sent: whatever comes until the audio has been quiet
        # for SETTLE_S is counted too (a server that ran on without input would add to it)
        wait(
            "speak",
            args.step_timeout,
            lambda: time.monotonic() - max(listener.snapshot()[1], sent_at) > SETTLE_S,
        )
        back, _ = listener.snapshot()
        with listener.lock:
            texts = list(listener.texts)
        report.step(
            "speak",
            frames_sent=frames,
            frames_back=back,
            all_arrived=bool(arrived),
            audio_samples=back * MOSHI_CHUNK_SIZE,
            audio_peak=round(listener.peak, 4),
            texts=texts[:120],
            text_items=len(texts),
            bad_texts=[t for t in texts if not t.strip() or not t.isprintable()],
            connected=client.is_connected(),
        )
    finally:
        listener.stop()
        client.disconnect()
    report.step("disconnect", connected=client.is_connected(), logged=len(report.warnings.records))


def run() -> None:
    """Run the scenario and print what it saw as the last line of stdout."""
    report = Report(FRAMEWORK, parse_args())
    # the library logs every audio message at INFO on the root logger it configures: keep
    # its INFO out of stderr, its warnings and errors are what the report holds
    logging.getLogger("fujielab.moshi.moshi_client_lib").setLevel(logging.WARNING)
    try:
        main(report.args, report)
    except StepFailed as failed:
        report.failed_step = failed.step
        report.exception = str(failed)
    except BaseException as error:  # report whatever the client raised
        report.failed_step = report.failed_step or "exception"
        report.exception = "".join(traceback.format_exception(error))[-4000:]
    sys.stdout.flush()
    print(json.dumps(report.result()), flush=True)


if __name__ == "__main__":
    run()
