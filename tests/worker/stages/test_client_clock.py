"""A client-clocked slot (`StagePlan.client_clock`, a session of Moshi's protocol): past its
prompt it steps once per whole frame of its client's input and only then, its state kept
while the client sends nothing; every frame it steps goes out, the model's quiet ones too;
a backlog steps again between ticks; the slots on the server's clock beside it are as
before. On the test's clock (`ManualClock`): every step is counted by the echo model."""

from __future__ import annotations

import numpy as np

from harness.frame_models import FRAME_SAMPLES, tone
from services.worker.stages.tick_batched import (
    CLIENT_BACKLOG_MS,
    CLIENT_LAG_MS,
    CLIENT_LAG_TICKS,
    MAX_CATCH_UP_STEPS,
)
from tests.worker.stages.test_tick_batched import Rig

QUIET = np.zeros(FRAME_SAMPLES, np.float32)


async def test_it_steps_only_on_its_clients_frames_and_waits_without_them():
    rig = Rig()
    try:
        await rig.open("moshi", client_clock=True)
        await rig.open("realtime")  # the server's clock
        await rig.tick(3)  # neither client sent anything
        assert rig.ready["moshi"] == 1  # no prompt: ready before any step
        assert rig.model.steps[:2] == [0, 3]  # the realtime slot steps on silence
        assert rig.port.stats()["silence_frames_by_session"] == {"moshi": 0, "realtime": 3}
        assert rig.outputs["moshi"] == []  # nothing stepped, nothing sent
        rig.port.feed("moshi", QUIET)
        await rig.tick()
        assert rig.model.steps[0] == 1
        rig.port.feed("moshi", QUIET[: FRAME_SAMPLES // 2])
        await rig.tick(2)
        assert rig.model.steps[0] == 1  # half a frame is not a tick of its clock
        rig.port.feed("moshi", QUIET[FRAME_SAMPLES // 2 :])
        await rig.tick()
        assert rig.model.steps[:2] == [2, 7]
        assert rig.port.stats()["silence_frames_by_session"]["moshi"] == 0
    finally:
        await rig.port.shutdown()


async def test_every_frame_it_steps_goes_out_the_quiet_ones_too():
    rig = Rig()
    try:
        await rig.open("moshi", client_clock=True)
        await rig.open("realtime")
        said = [QUIET, QUIET, tone(1), tone(1), QUIET, QUIET, QUIET, QUIET, QUIET, QUIET]
        for frame in said:
            rig.port.feed("moshi", frame)
            rig.port.feed("realtime", frame)
            await rig.tick()
        kinds = rig.kinds("moshi")
        # one audio out per frame in: the echo model says the tone back 2 frames later, as a
        # response that 3 quiet frames end; the frames around it are the model's quiet ones
        assert [k for k in kinds if k != "listen"] == (
            ["quiet"] * 4 + ["audio"] * 5 + ["quiet"] * 1
        )
        assert kinds.count("listen") == 1
        assert all(
            o.audio is not None and o.audio.size == FRAME_SAMPLES
            for o in rig.outputs["moshi"]
            if o.kind in ("quiet", "audio")
        )
        # the realtime slot sends a response's frames only, as before
        assert "quiet" not in rig.kinds("realtime")
        assert rig.kinds("realtime").count("audio") == 5
    finally:
        await rig.port.shutdown()


async def test_a_backlog_steps_again_between_ticks_and_the_others_do_not():
    rig = Rig()
    try:
        await rig.open("moshi", client_clock=True)
        await rig.open("realtime")
        burst = MAX_CATCH_UP_STEPS + 1 + 3  # more than one tick and its catch-up steps
        rig.port.feed("moshi", np.concatenate([QUIET] * burst))
        await rig.tick()
        await rig.clock.next_sleeper()  # the tick's catch-up steps are done
        assert rig.model.steps[:2] == [1 + MAX_CATCH_UP_STEPS, 1]
        assert rig.port.stats()["catch_up_steps"] == MAX_CATCH_UP_STEPS
        await rig.tick()
        await rig.clock.next_sleeper()
        assert rig.model.steps[:2] == [burst, 2]  # the rest, then it waits for its client
        assert len(rig.kinds("moshi")) == burst
    finally:
        await rig.port.shutdown()


async def test_its_backlog_is_bounded_oldest_cut():
    rig = Rig()
    try:
        await rig.open("moshi", client_clock=True)
        bound = CLIENT_BACKLOG_MS * 24 // FRAME_SAMPLES  # frames of 80 ms in the bound
        rig.port.feed("moshi", np.concatenate([QUIET] * (bound + 10)))
        for _ in range(bound):
            await rig.tick()
        await rig.clock.next_sleeper()
        assert rig.model.steps[0] == bound  # 10 frames were cut, never stepped
        await rig.tick(2)
        assert rig.model.steps[0] == bound
    finally:
        await rig.port.shutdown()


async def test_its_prompt_steps_on_the_servers_clock_then_it_waits_for_its_client():
    rig = Rig()
    try:
        prompt = 3
        rig.model.prompt_frames_left = lambda slot: max(0, prompt - rig.model.steps[slot])
        await rig.open("persona", client_clock=True)
        await rig.tick(prompt)
        assert rig.ready["persona"] == 1 and rig.model.steps[0] == prompt
        await rig.tick(2)
        assert rig.model.steps[0] == prompt  # past its prompt: its client's clock
        rig.port.feed("persona", QUIET)
        await rig.tick()
        assert rig.model.steps[0] == prompt + 1
    finally:
        await rig.port.shutdown()


async def test_a_worker_with_no_time_to_catch_up_cuts_a_lagging_client_back():
    """Steps that take most of the frame leave no time for catch-up steps: a client whose
    backlog stays over `CLIENT_LAG_MS` for `CLIENT_LAG_TICKS` ticks is cut back to its newest
    `CLIENT_LAG_MS`, so its model answers that late at most, not seconds late for good."""
    rig = Rig()
    try:
        rig.model.on_step = lambda: rig.clock.skew(0.05)  # a step takes 50 of the 80 ms
        await rig.open("moshi", client_clock=True)
        lag_frames = CLIENT_LAG_MS * 24 // FRAME_SAMPLES
        rig.port.feed("moshi", np.concatenate([QUIET] * 20))  # held during a stall, say
        backlog = []
        for _ in range(CLIENT_LAG_TICKS + 5):
            rig.port.feed("moshi", QUIET)  # and the client goes on in real time
            await rig.tick()
            await rig.clock.next_sleeper()
            backlog.append(rig.port._slots["moshi"].buffered // FRAME_SAMPLES)
        assert rig.port.stats()["catch_up_steps"] == 0  # never time for one
        assert backlog[CLIENT_LAG_TICKS - 2] == 20  # behind by the stall until then
        assert max(backlog[CLIENT_LAG_TICKS:]) <= lag_frames  # then cut back
        assert rig.port.stats()["dropped_input_frames"] == 20 - lag_frames
    finally:
        await rig.port.shutdown()


async def test_a_backlog_draining_slowly_is_left_to_drain():
    """A loaded worker finds time for one catch-up step a tick: a backlog longer than
    `CLIENT_LAG_TICKS` frames (audio held while the prompt was stepped, say) stays over
    `CLIENT_LAG_MS` for more than `CLIENT_LAG_TICKS` ticks, but shrinks every tick, and is
    stepped to its end: nothing the client sent is cut because the machine is slow."""
    rig = Rig()
    try:
        rig.model.on_step = lambda: rig.clock.skew(0.03)  # a step takes 30 of the 80 ms
        await rig.open("moshi", client_clock=True)
        held = 2 * CLIENT_LAG_TICKS + 10
        rig.port.feed("moshi", np.concatenate([QUIET] * held))
        backlog = []
        for _ in range(held + 5):
            rig.port.feed("moshi", QUIET)  # the client goes on in real time
            await rig.tick()
            await rig.clock.next_sleeper()
            backlog.append(rig.port._slots["moshi"].buffered // FRAME_SAMPLES)
        lag_frames = CLIENT_LAG_MS * 24 // FRAME_SAMPLES
        assert backlog[CLIENT_LAG_TICKS + 1] > lag_frames  # still behind past the old bound
        assert backlog[-1] <= 1  # drained
        assert rig.port.stats()["dropped_input_frames"] == 0
        assert rig.port.stats()["catch_up_steps"] >= held
    finally:
        await rig.port.shutdown()


async def test_a_drain_too_slow_to_end_within_a_backlogs_time_is_cut():
    """A backlog that reaches a new low every few ticks, but so slowly that it would keep
    its user seconds late for minutes, is cut once it has been behind for as many ticks as
    a whole backlog lasts (`CLIENT_BACKLOG_MS`)."""
    rig = Rig()
    try:
        await rig.open("moshi", client_clock=True)
        port = rig.port
        slot = port._slots["moshi"]
        port.feed("moshi", np.concatenate([QUIET] * 100))
        await rig.tick()  # ready, and its first steps taken
        assert not slot.announce_ready and slot.buffered > 50 * FRAME_SAMPLES
        frame = np.zeros(FRAME_SAMPLES, np.float32)
        cut_at = None
        for tick in range(2 * port.backlog_ticks):
            if tick % 3 == 0:
                slot.take_frame(frame)  # one frame stepped every third tick: new lows
            port._bound_client_lag()
            if port.stats()["dropped_input_frames"] and cut_at is None:
                cut_at = tick
        assert port.backlog_ticks == CLIENT_BACKLOG_MS * 24 // FRAME_SAMPLES
        assert cut_at == port.backlog_ticks - 1  # behind for a whole backlog's ticks
        assert slot.buffered <= CLIENT_LAG_MS * 24
    finally:
        await rig.port.shutdown()
