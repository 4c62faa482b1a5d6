"""The assistant with an LLM: a session's turn goes through the real vLLM engine, and the
generated text is what the assistant says."""

import pytest

from harness.sessions import make_harness
from plugins.assistant import AssistantPlugin
from services.worker.plugins import load_plugin
from services.worker.stages.vllm import VllmStagePort

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_turn_is_answered_by_the_llm_and_spoken(engine):
    stage = VllmStagePort(engine)
    plugin = AssistantPlugin(text_stage=stage)
    plugin.sampling_defaults = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    h = make_harness(plugin=plugin)
    try:
        session = await h.open({"turn_detection": None, "extra_body": {"pace": 0}})
        await session.send({"type": "input.text.append", "text": "hello there"})
        await session.send({"type": "input.commit"})
        events = await session.until("response.done", timeout=60)
        done = events[-1]
        assert done.response["status"] == "completed", done.response
        spoken = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
        generated = [rid for rid, reason in stage.finish_reasons.items() if reason == "length"]
        assert len(generated) == 1 and parse_role(generated[0]) == "llm"
        assert spoken.transcript.strip()  # the LLM's words, spoken by espeak-ng
    finally:
        await h.manager.shutdown()


def parse_role(request_id: str) -> str:
    from shared.contracts import parse_stage_request_id

    return parse_stage_request_id(request_id)[2]


def test_the_worker_builds_the_vllm_stage_for_llm_model(monkeypatch, tiny_llama):
    built = {}

    def fake_for_model(model, *, max_num_seqs):
        built.update(model=model, max_num_seqs=max_num_seqs)
        return VllmStagePort(engine=None)

    monkeypatch.setattr(VllmStagePort, "for_model", staticmethod(fake_for_model))
    plugin = load_plugin("assistant", {"llm_model": tiny_llama, "asr": "grammar"}, max_sessions=8)
    assert built == {"model": tiny_llama, "max_num_seqs": 8}
    assert isinstance(plugin.text_stage, VllmStagePort)
