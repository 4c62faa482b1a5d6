"""A small run of bench/exhaustion.py: each resource exhaustion attack of issue 14 is
refused, costs bounded memory, and spares a control session on the same worker."""

from bench.exhaustion import control_ok, run_exhaustion


async def test_no_single_client_exhausts_redis_a_worker_an_api_pod_or_its_sockets():
    cases, control = await run_exhaustion(scale=0.2)
    assert [c.name for c in cases] == [
        "inbox_flood",
        "wav_bomb",
        "chat_stream",
        "stall",
        "idle_sockets",
        "bad_key",
    ]
    failed = [(c.name, c.outcome, c.memory) for c in cases if not c.ok]
    assert failed == []
    assert control_ok(control), control
