"""`extra_body.pace` is 0 (unpaced) or a number in 0.1-10; anything else is refused (issue 14)."""

import math

import pytest

from harness.sessions import make_harness
from plugins.assistant import AssistantPlugin
from plugins.echo import EchoPlugin
from plugins.paced import PACE_MAX, PACE_MIN, read_pace
from shared.contracts import DuplexRuntimeConfigError, DuplexSessionConfig, DuplexSessionError

ABSURD = [-1, -0.0001, math.nan, math.inf, -math.inf, 1e9, 10**400, 0.05, 10.5, True, "1", None]


@pytest.mark.parametrize("pace", ABSURD, ids=lambda pace: repr(pace)[:12])
def test_absurd_paces_are_refused_with_the_field(pace):
    with pytest.raises(DuplexRuntimeConfigError) as info:
        read_pace({"pace": pace})
    assert (info.value.code, info.value.param) == (
        "invalid_duplex_runtime_config",
        "extra_body.pace",
    )


@pytest.mark.parametrize("pace", [0, 0.0, PACE_MIN, 1, 2.5, PACE_MAX])
def test_unpaced_and_the_documented_range_are_accepted(pace):
    assert read_pace({"pace": pace}) == float(pace)
    assert (PACE_MIN, PACE_MAX) == (0.1, 10.0)


async def test_every_paced_plugin_refuses_at_open_and_update():
    for plugin in (EchoPlugin(), AssistantPlugin()):
        with pytest.raises(DuplexRuntimeConfigError):
            plugin.validate_client_extra_body({"pace": math.nan})
        with pytest.raises(DuplexRuntimeConfigError):
            await plugin.prepare_runtime_config(DuplexSessionConfig(extra_body={"pace": 1e9}))


async def test_an_infinite_pace_is_refused_at_open_and_a_huge_one_at_update():
    h = make_harness()
    try:
        with pytest.raises(DuplexSessionError) as info:
            await h.client.open({"extra_body": {"pace": math.inf}})
        assert info.value.code == "invalid_duplex_runtime_config"
        assert h.manager.table.slots_in_use == 0
        session = await h.open({"extra_body": {"pace": 0}})
        await session.send(
            {"type": "session.update", "session": {"extra_body": {"pace": 1e9}}, "event_id": "u"}
        )
        error = await session.recv()
        assert (error.code, error.related_event_id) == ("invalid_duplex_runtime_config", "u")
    finally:
        await h.manager.shutdown()
