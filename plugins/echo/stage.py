"""The echo model's one stage: replay a turn's audio at the model rate, paced.

Each submitted request runs as one asyncio task; `abort` cancels the task, so
generation stops at its next chunk and nothing of an aborted request is
emitted afterwards. A request with nothing to say aloud (a text response, or a turn
without audio) emits its transcript as one "text" output, then "done".
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from plugins.paced import split_text
from shared.contracts import OutputKind, StageOutput, StagePlan, TaskStagePort
from shared.protocol.duplex import StreamingResampler


def resample_whole(audio: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    resampler = StreamingResampler(in_rate, out_rate)
    return np.concatenate([resampler.process(audio), resampler.flush()])


class EchoStagePort(TaskStagePort):
    async def _run(self, plan: StagePlan) -> None:
        request = plan.payload
        if not request.speak or request.audio.size == 0:
            text = StageOutput(
                plan.request_id, plan.fence, OutputKind.TEXT, text=request.transcript
            )
            self._emit(text)
            self._emit(
                StageOutput(plan.request_id, plan.fence, OutputKind.DONE, text=request.transcript)
            )
            return
        try:
            audio = await asyncio.to_thread(
                resample_whole, request.audio, request.sample_rate_hz, request.output_rate_hz
            )
        except Exception as exc:
            self._fail(plan, exc)
            return
        chunk = request.output_rate_hz * request.chunk_ms // 1000
        count = max(1, -(-len(audio) // chunk))
        texts = split_text(request.transcript, count)
        started = time.monotonic()
        for index in range(count):
            if request.pace > 0:
                # real-time pacing: chunk i leaves at i chunk-durations after the first
                due = started + index * request.chunk_ms / 1000 / request.pace
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            else:
                await asyncio.sleep(0)
            piece = audio[index * chunk : (index + 1) * chunk]
            self._emit(
                StageOutput(
                    plan.request_id,
                    plan.fence,
                    OutputKind.AUDIO,
                    audio=piece,
                    sample_rate_hz=request.output_rate_hz,
                    text=texts[index],
                )
            )
        self._emit(
            StageOutput(plan.request_id, plan.fence, OutputKind.DONE, text=request.transcript)
        )
