"""The vLLM stage on the CPU build of vLLM, with the tiny random Llama of conftest.py."""

import asyncio
import time

import pytest

from services.worker.stages.vllm import VllmStagePort
from shared.contracts import DuplexFence, StagePlan, TextRequest, parse_stage_request_id

pytestmark = pytest.mark.asyncio(loop_scope="session")


class Collector:
    def __init__(self) -> None:
        self.outputs = []
        self.times = []
        self.done = asyncio.Event()

    def __call__(self, output) -> None:
        self.outputs.append(output)
        self.times.append(time.monotonic())
        if output.kind in ("done", "error"):
            self.done.set()

    def text(self) -> str:
        return "".join(o.text for o in self.outputs if o.kind == "text")


async def start(port, session_id: str, prompt: str, epoch: int = 1, **sampling):
    fence = DuplexFence(session_id, epoch, 1)
    collector = Collector()
    port.bind(session_id, collector)
    request_id = await port.ensure(fence, "llm")
    await port.submit_initial(StagePlan(request_id, fence, "llm", TextRequest(prompt, sampling)))
    return request_id, collector


async def test_a_turn_generates_tokens_through_the_engine(engine):
    port = VllmStagePort(engine, {"temperature": 0.0})
    request_id, out = await start(port, "duplex-a", "hello world", max_tokens=12, ignore_eos=True)
    assert parse_stage_request_id(request_id) == ("duplex-a", 1, "llm")
    await asyncio.wait_for(out.done.wait(), 60)
    kinds = [o.kind for o in out.outputs]
    assert kinds[-1] == "done", out.outputs[-1].message
    assert kinds.count("text") >= 1
    assert out.outputs[-1].text == out.text() != ""
    assert port.finish_reasons[request_id] == "length"  # 12 tokens, eos ignored
    assert port.running_requests() == []
    # a session's prompt grows turn by turn: the engine reuses the earlier turns' KV blocks
    assert engine.vllm_config.cache_config.enable_prefix_caching


async def test_greedy_decoding_is_reproducible_and_uses_the_plugin_defaults(engine):
    port = VllmStagePort(engine, {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True})
    texts = []
    for epoch in (1, 2):
        _, out = await start(port, "duplex-b", "the quick brown fox", epoch=epoch)
        await asyncio.wait_for(out.done.wait(), 60)
        texts.append(out.text())
    assert texts[0] == texts[1] != ""


async def test_cancel_aborts_the_request_inside_the_engine(engine):
    port = VllmStagePort(engine, {"temperature": 0.0})
    request_id, out = await start(port, "duplex-c", "hello", max_tokens=200, ignore_eos=True)
    while not out.outputs:
        await asyncio.sleep(0.005)
    await port.abort([request_id])
    seen = len(out.outputs)
    assert port.finish_reasons[request_id] == "abort"  # vLLM's own final word on it
    assert request_id not in engine.output_processor.external_req_ids  # the engine forgot it
    assert not engine.output_processor.has_unfinished_requests()
    await asyncio.sleep(0.5)  # time itself is tested: the engine had time to send more
    assert len(out.outputs) == seen  # nothing after the abort reached the session
    assert all(o.kind == "text" for o in out.outputs)  # and no done: it was cut off
    assert len(out.text()) < 200


async def test_two_sessions_generate_at_once_in_one_engine(engine):
    port = VllmStagePort(engine, {"temperature": 0.0, "ignore_eos": True})
    (_, first), (_, second) = [
        await start(port, sid, "what time is it", max_tokens=48) for sid in ("duplex-d", "duplex-e")
    ]
    await asyncio.wait_for(asyncio.gather(first.done.wait(), second.done.wait()), 60)
    # batched: each produced output before the other had finished
    assert first.times[0] < second.times[-1] and second.times[0] < first.times[-1]
    assert first.text() and second.text()


async def test_cleanup_of_a_session_aborts_its_requests_only(engine):
    port = VllmStagePort(engine, {"temperature": 0.0, "ignore_eos": True})
    gone, gone_out = await start(port, "duplex-f", "hello", max_tokens=200)
    kept, kept_out = await start(port, "duplex-g", "hello", max_tokens=24)
    while not gone_out.outputs:
        await asyncio.sleep(0.005)
    await port.cleanup("duplex-f")
    await asyncio.wait_for(kept_out.done.wait(), 60)
    assert port.finish_reasons[gone] == "abort" and port.finish_reasons[kept] == "length"
