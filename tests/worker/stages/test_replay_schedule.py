"""The tick stage's replay, scheduled by the time it has (`TickBatchedStagePort._replay`):
a restore's frames are sized to each tick's spare time by their measured cost, at least one
frame a tick whatever the time, several restores share the time, the progress is visible,
and a release is never held up by a caller's cancellation.

On a clock the tests move (`ManualClock`): a replayed frame "costs" what the test says by
moving the clock while the model thread replays it, so the figures are exact and no test
depends on the machine's speed."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
from prometheus_client import generate_latest

from harness.frame_models import tone
from services.worker.stages.slots import ReplayCost
from services.worker.stages.tick_batched import REPLAY_COST_WEIGHT, REPLAY_MARGIN
from shared.contracts import DuplexFence, StagePlan
from tests.worker.stages.test_tick_batched import Rig, open_with_history, steps_history

FRAME_S = 0.08
#: the spare time of a tick whose step costs nothing on the manual clock
SPARE_S = FRAME_S * (1 - REPLAY_MARGIN)


def costed(
    rig: Rig, frame_s: float, step_s: float = 0.0, call_s: float = 0.0
) -> list[tuple[int, int, int]]:
    """Replayed frames cost `frame_s` each, a `replay_work` call `call_s` more, and every
    step `step_s`, on the rig's clock; returns the list the replay calls are logged to:
    (tick, frames, slot)."""
    calls: list[tuple[int, int, int]] = []
    real_work = rig.model.replay_work

    def replay_work(slot: int, frames: int) -> int:
        left = real_work(slot, frames)
        done = rig.model.replay_calls[-1]
        rig.clock.skew(call_s + frame_s * done)
        calls.append((rig.port.ticks, done, slot))
        return left

    rig.model.replay_work = replay_work
    if step_s:
        rig.model.on_step = lambda: rig.clock.skew(step_s)
    return calls


#: a model that replays a call's frames in one forward (Nemotron's, Moshi's): each call
#: costs CALL_S whatever its frames, plus PER_FRAME_S a frame
CALL_S, PER_FRAME_S = 0.02, 0.001


def one_forward(rig: Rig) -> list[tuple[int, int, int]]:
    """The rig's model costs as one that replays a call in one forward, 64 frames a call
    at most; returns the calls' log (`costed`)."""
    rig.model.replay_chunk_frames = 64
    return costed(rig, frame_s=PER_FRAME_S, call_s=CALL_S)


def calls_cost(frames: list[int]) -> float:
    """What calls of these frames cost such a model."""
    return sum(frames) * PER_FRAME_S + len(frames) * CALL_S


async def replay_until_done(rig: Rig, session_id: str, limit: int = 400) -> int:
    """Ticks until the session's slot steps again (its replay done)."""
    for ticks in range(limit + 1):
        if not any(p.session_id == session_id and not p.done for p in rig.port.restore_progress()):
            return ticks
        await rig.tick()
        await rig.clock.next_sleeper()  # the tick's replay has run
    raise AssertionError(f"{session_id} still replaying after {limit} ticks")


@pytest.fixture
async def rig():
    made = Rig()
    yield made
    await made.port.shutdown()


@pytest.fixture
async def big_chunk_rig():
    """A model whose preferred chunk (16) never fits a tick at 13 ms a frame, as
    Nemotron's on a 2-core CPU: the case a fixed chunk and a starvation wait got wrong."""
    made = Rig()
    made.model.replay_chunk_frames = 16
    yield made
    await made.port.shutdown()


async def test_a_restore_takes_as_many_frames_as_the_spare_time_holds(big_chunk_rig):
    rig = big_chunk_rig
    calls = costed(rig, frame_s=0.013)
    await rig.open("b")
    await rig.tick()
    await open_with_history(rig, "a", steps_history(240))
    ticks = await replay_until_done(rig, "a")
    per_tick: dict[int, int] = {}
    for tick, frames, _ in calls:
        per_tick[tick] = per_tick.get(tick, 0) + frames
    fits = int(SPARE_S / 0.013)  # 5 frames of 13 ms in 72 ms
    assert sum(per_tick.values()) == 240
    assert max(per_tick.values()) == fits  # never more than fits: no deadline risked
    assert all(frames <= 16 for _, frames, _ in calls)
    # the first tick starts with one frame (nothing measured yet), doubles after it, and
    # fills the rest of the tick (13 + 26 + 26 ms of 72)
    assert [frames for tick, frames, _ in calls if tick == calls[0][0]] == [1, 2, 2]
    # the ceiling is `fits` frames a tick: a tick of ramp-up, then every tick at it
    assert ticks <= -(-240 // fits) + 2
    stats = rig.port.stats()
    assert stats["deadline_misses"] == 0
    assert stats["restores"] == 1 and stats["restored_frames"] == 240
    # one round after each step (and one in the wait the restore began in, if it began
    # while the tick waited rather than while it replayed after its step)
    assert ticks <= stats["replay_rounds"] <= ticks + 1
    await rig.tick()
    assert rig.model.batches[-1] == 2  # a steps again, beside b


async def test_a_call_that_costs_more_than_its_frames_is_made_once_a_tick_and_full(rig):
    """A model whose call costs 20 ms whatever its frames, plus 1 ms a frame (one forward
    for all of them, as Nemotron's and Moshi's replays): the stage fits that cost, so once
    it has measured calls of two sizes each tick is one call of all the frames that fit
    (52 in 72 ms), not many small ones each paying the 20 ms again."""
    calls = one_forward(rig)
    await rig.open("b")
    await rig.tick()
    await open_with_history(rig, "a", steps_history(600))
    await replay_until_done(rig, "a")
    per_tick: dict[int, list[int]] = {}
    for tick, frames, _ in calls:
        per_tick.setdefault(tick, []).append(frames)
    fits = int((SPARE_S - CALL_S) / PER_FRAME_S + 1e-9)  # 52
    ticks = sorted(per_tick)
    # the ramp: a probe, then twice its frames; once a call's fixed part is known, as many
    # frames as twice the last call's time holds (9 is all the first tick has left, then
    # 38 in 58 ms), not twice the frames (1, 2, 4, 8, 16, 32: seven ticks to reach 52)
    assert [per_tick[tick] for tick in ticks[:2]] == [[1, 2, 9], [38]]
    steady = [per_tick[tick] for tick in ticks[3:-1]]  # after the ramp, before the rest
    assert steady and all(made == [fits] for made in steady), per_tick
    assert all(calls_cost(made) <= SPARE_S + 1e-9 for made in per_tick.values())
    assert rig.port.stats()["deadline_misses"] == 0


async def test_a_prompt_taken_whole_is_not_a_frames_cost(rig):
    """A prompt replayed at an open is one forward of all its positions (200 here, in one
    20 ms call, though 1 was asked): counted as 200 frames it would say a frame costs
    0.1 ms, and the next restore's first call would ask for 64 frames that cost 84 ms (20
    ms a call, 1 ms a frame). Left out of the fit, the restore probes its cost."""
    calls = one_forward(rig)
    costed_work = rig.model.replay_work
    prompts: set[int] = set()

    def replay_work(slot: int, frames: int) -> int:
        if slot in prompts:  # the prompt, whole, whatever was asked
            prompts.discard(slot)
            pending = rig.model._replay_left[slot]
            rig.model._replay_left[slot] = 0
            rig.clock.skew(CALL_S)
            rig.model.replay_calls.append(pending)
            return 0
        return costed_work(slot, frames)

    rig.model.replay_work = replay_work

    def with_prompt(slot: int, options: object) -> None:
        prompts.add(slot)
        rig.model._replay_left[slot] = 200

    rig.model.on_open = with_prompt
    await rig.open("b")
    while rig.model.replay_pending(0):
        await rig.tick()
    assert rig.model.replay_calls == [200]  # the prompt, in one call
    rig.model.on_open = None
    await open_with_history(rig, "a", steps_history(300))
    await replay_until_done(rig, "a")
    assert calls[0][1] == 1  # a probe: nothing measured said what a frame costs
    per_tick: dict[int, list[int]] = {}
    for tick, frames, _ in calls:
        per_tick.setdefault(tick, []).append(frames)
    assert all(calls_cost(made) <= SPARE_S + 1e-9 for made in per_tick.values())
    assert rig.port.stats()["deadline_misses"] == 0


async def test_restores_whose_shares_cannot_pay_a_call_take_the_spare_in_turn(rig):
    """Four restores at once (a failover), 20 ms a call and 1 ms a frame, 72 ms spare: a
    quarter of it (18 ms) pays no call, so equal shares would be a frame each (4 a tick).
    Each tick one of them takes the spare instead, a different one each tick."""
    calls = one_forward(rig)
    await rig.open("z")
    await rig.tick()
    # the model's cost known from an earlier restore
    await open_with_history(rig, "w", steps_history(200))
    await replay_until_done(rig, "w")
    await rig.port.cleanup("w")
    calls.clear()
    for name in ("a", "b", "c"):
        await open_with_history(rig, name, steps_history(300))
    ticks = await replay_until_done(rig, "c", limit=100)
    for name in ("a", "b"):
        await replay_until_done(rig, name, limit=100)
    per_tick: dict[int, list[tuple[int, int]]] = {}
    for tick, frames, slot in calls:
        per_tick.setdefault(tick, []).append((slot, frames))
    assert sum(frames for _, frames, _ in calls) == 900
    # a frame each per tick would take 300 ticks; taking the spare in turn, about 18
    assert ticks <= 30, per_tick
    full = [made for made in per_tick.values() if max(frames for _, frames in made) >= 40]
    assert len({made[0][0] for made in full}) == 3  # each took the spare in its turn
    assert rig.port.stats()["deadline_misses"] == 0


def test_a_fit_keeps_its_fixed_part_when_its_calls_are_all_one_size():
    """Full calls of one size for a long time: the fit cannot tell the fixed part from the
    frames' any more, and keeps the one it found (counted all per frame instead, a smaller
    call later, when another restore halves the share, would be asked for too many)."""
    cost = ReplayCost(REPLAY_COST_WEIGHT)
    for frames in (1, 2, 9, 38):
        cost.add(frames, 0.02 + 0.001 * frames)
    for _ in range(200):
        cost.add(52, 0.02 + 0.001 * 52)
    assert cost.fixed_s == pytest.approx(0.02) and cost.frame_s == pytest.approx(0.001)
    assert cost.seconds(cost.fits(0.036)) <= 0.036 + 1e-9


def test_a_replays_cost_is_fitted_as_a_fixed_part_and_a_part_per_frame():
    cost = ReplayCost(REPLAY_COST_WEIGHT)
    cost.add(4, 0.024)
    # one size of call: all of it counted per frame (never more frames than fit)
    assert (cost.fixed_s, cost.frame_s) == (0.0, pytest.approx(0.006))
    for frames in (8, 16, 5, 32):
        cost.add(frames, 0.02 + 0.001 * frames)
    assert cost.fixed_s == pytest.approx(0.02) and cost.frame_s == pytest.approx(0.001)
    assert cost.fits(0.072) == 52 and cost.fits(0.02) == 0 and cost.fits(0.0215) == 1
    # the costs drift (a longer history): the newest calls count most
    for frames in (10, 20, 30, 40, 50, 60) * 4:
        cost.add(frames, 0.01 + 0.002 * frames)
    assert cost.fixed_s == pytest.approx(0.01, rel=0.05)
    assert cost.frame_s == pytest.approx(0.002, rel=0.05)
    # noise that makes larger calls cheaper in total: no negative cost per frame
    noisy = ReplayCost(REPLAY_COST_WEIGHT)
    noisy.add(10, 0.03)
    noisy.add(20, 0.02)
    assert noisy.fixed_s == 0.0 and noisy.frame_s > 0


async def test_the_next_restore_starts_at_the_cost_the_last_one_measured(big_chunk_rig):
    rig = big_chunk_rig
    calls = costed(rig, frame_s=0.013)
    await rig.open("b")
    await rig.tick()
    await open_with_history(rig, "a", steps_history(40))
    await replay_until_done(rig, "a")
    calls.clear()
    await rig.port.cleanup("a")
    await open_with_history(rig, "c", steps_history(40))
    await replay_until_done(rig, "c")
    assert calls[0][1] == int(SPARE_S / 0.013)  # no probe: the model's cost is known
    assert rig.port.stats()["deadline_misses"] == 0


async def test_a_frame_is_replayed_every_tick_when_the_steps_leave_no_time(rig):
    """The live slots' step takes nearly the whole frame (the machine is full): the
    restore still replays a frame every tick, and ends; the live slots give way by it (the
    tick after it starts late, and a tick that ends past its frame skips a grid point,
    whose spare time the replay then takes)."""
    calls = costed(rig, frame_s=0.01, step_s=0.075)
    await rig.open("b")
    await rig.tick()
    first = rig.port.ticks + 1
    await open_with_history(rig, "a", steps_history(40))
    ticks = await replay_until_done(rig, "a", limit=60)
    per_tick: dict[int, int] = {}
    for tick, frames, _ in calls:
        per_tick[tick] = per_tick.get(tick, 0) + frames
    assert sorted(per_tick) == list(range(first, max(per_tick) + 1))  # every tick replayed
    assert ticks <= len(per_tick)
    assert sum(per_tick.values()) == 40
    assert rig.port.stats()["deadline_misses"] > 0  # the live slots gave way
    assert rig.port.stats()["restores"] == 1


async def test_several_restores_share_the_spare_time_in_equal_shares(rig):
    calls = costed(rig, frame_s=0.004)
    sessions = ("a", "b", "c")
    for session_id in sessions:
        await open_with_history(rig, session_id, steps_history(120))
    shared_from = len(calls)  # (each began alone in the wait it was restored in)
    got: dict[str, int] = {}
    for _ in range(100):
        await rig.tick()
        await rig.clock.next_sleeper()
        got = {p.session_id: p.replayed for p in rig.port.restore_progress()}
        # at every tick the three are within one tick's spare time of each other (the
        # first restore's first tick ramps up from a frame; the others start at its cost)
        assert max(got.values()) - min(got.values()) <= int(SPARE_S / 0.004)
        if all(p.done for p in rig.port.restore_progress()):
            break
    assert got == {"a": 120, "b": 120, "c": 120}
    # each tick's spare time went to all three: no tick replayed one restore alone
    ticks_of = {}
    for tick, _, slot in calls[shared_from:]:
        ticks_of.setdefault(tick, set()).add(slot)
    last = max(ticks_of)
    assert all(len(slots) == 3 for tick, slots in ticks_of.items() if tick != last)
    assert rig.port.stats()["restores"] == 3
    assert rig.port.stats()["deadline_misses"] == 0


async def test_restores_take_turns_at_the_one_frame_of_a_full_tick(rig):
    """No spare time at all (a step of 79 ms, a frame replayed in 1): each tick's one
    frame goes to each restore in turn, and no tick is late."""
    calls = costed(rig, frame_s=0.001, step_s=0.079)
    await rig.open("live")
    await rig.tick()
    await open_with_history(rig, "a", steps_history(4))
    await open_with_history(rig, "b", steps_history(4))
    while any(not p.done for p in rig.port.restore_progress()):
        await rig.tick()
        await rig.clock.next_sleeper()
    assert [frames for _, frames, _ in calls] == [1] * 8
    assert [tick for tick, _, _ in calls] == sorted({tick for tick, _, _ in calls})  # one a tick
    slots = [slot for _, _, slot in calls]
    assert all(a != b for a, b in itertools.pairwise(slots))  # in turn
    progress = {p.session_id: p for p in rig.port.restore_progress()}
    assert progress["a"].replayed == progress["b"].replayed == 4
    assert rig.port.stats()["deadline_misses"] == 0


async def test_a_restores_progress_is_visible_while_it_replays_and_after(big_chunk_rig):
    rig = big_chunk_rig
    costed(rig, frame_s=0.013)
    await open_with_history(rig, "a", steps_history(100))
    await rig.clock.next_sleeper()
    (progress,) = rig.port.restore_progress()
    assert (progress.session_id, progress.frames, progress.done) == ("a", 100, False)
    await rig.tick(3)
    await rig.clock.next_sleeper()
    (progress,) = rig.port.restore_progress()
    assert 0 < progress.replayed < 100 and not progress.done
    assert progress.pace == pytest.approx(progress.replayed * FRAME_S / progress.seconds)
    text = generate_latest(rig.registry).decode()
    assert 'duplex_native_restores_in_progress{model="frame_echo"} 1.0' in text
    left = 100 - progress.replayed
    assert f'duplex_native_replay_frames_left{{model="frame_echo"}} {left}.0' in text
    await replay_until_done(rig, "a")
    (progress,) = rig.port.restore_progress()
    assert progress.done and progress.replayed == progress.frames == 100
    assert progress.to_json_dict()["pace"] == round(progress.pace, 2)
    assert progress.pace > 1  # faster than the conversation was spoken
    text = generate_latest(rig.registry).decode()
    assert 'duplex_native_restores_in_progress{model="frame_echo"} 0.0' in text
    assert 'duplex_native_restore_pace_count{model="frame_echo"} 1.0' in text
    assert 'duplex_native_restored_frames_total{model="frame_echo"} 100.0' in text
    assert 'duplex_native_restore_seconds_count{model="frame_echo"} 1.0' in text


async def test_a_prompt_replayed_at_an_open_is_not_a_restore(rig):
    """A model may replay at an open too (a PersonaPlex `.pt` voice's embeddings): the slot
    waits for it like a restore; the restore metrics and progress do not count it."""
    costed(rig, frame_s=0.03)  # 16 frames of 30 ms: a few ticks' spare time
    pending_at_step: list[int] = []  # the frames the replay had left at each step
    rig.model.on_step = lambda: pending_at_step.append(rig.model.replay_pending(0))
    rig.model.on_open = lambda slot, options: rig.model._replay_left.__setitem__(slot, 16)
    await rig.open("a")
    while rig.model.replay_pending(0):
        await rig.tick()
    await rig.tick()
    steps = list(zip(pending_at_step, rig.model.batches, strict=True))
    assert any(left for left, _ in steps)  # it did step while the prompt replayed...
    assert all(active == 0 for left, active in steps if left)  # ...without the slot
    assert rig.model.batches[-1] == 1  # which steps once its replay is done
    stats = rig.port.stats()
    assert stats["restores"] == 0 and stats["restored_frames"] == 0
    assert stats["replayed_frames"] == 16
    assert rig.port.restore_progress() == []
    text = generate_latest(rig.registry)
    assert b'duplex_native_restored_frames_total{model="frame_echo"}' not in text


async def test_input_that_arrived_during_a_restore_is_cut_to_the_newest(rig):
    costed(rig, frame_s=0.01)  # 20 frames of 10 ms: the restore spans ticks
    await open_with_history(rig, "a", steps_history(20))
    # one 30-frame append is a burst: the jitter buffer holds 3 frames before it takes any
    rig.port.feed("a", tone(30))
    await replay_until_done(rig, "a")
    await rig.tick()
    assert rig.model.steps[rig.port.slot_of("a")] == 21  # counts on from its history
    assert rig.port.stats()["dropped_input_frames"] == 27


async def test_a_cancelled_cleanup_is_cancelled_and_still_frees_the_slot(rig):
    """A caller cancelled while the slot's open is still on the model thread (a timeout
    around the close) is cancelled as it asked, not left running; the slot is freed once
    the open ends, and closed in the model."""
    gate = threading.Event()
    rig.model.on_open = lambda slot, options: gate.wait(10)
    fence = DuplexFence("a", 0, 0)
    rig.port.bind("a", lambda output: None)
    request_id = await rig.port.ensure(fence, "stage0")
    opening = asyncio.create_task(
        rig.port.submit_initial(StagePlan(request_id, fence, "stage0", {}))
    )
    await asyncio.sleep(0.01)
    assert rig.port.free_slots == rig.model.slots - 1
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await rig.port.cleanup("a")
    assert asyncio.current_task().cancelling() == 0  # the timeout took its cancellation back
    gate.set()
    await asyncio.gather(opening, return_exceptions=True)
    for _ in range(200):
        if rig.port.free_slots == rig.model.slots:
            break
        await asyncio.sleep(0.01)
    assert rig.port.free_slots == rig.model.slots
    assert rig.model.opened == [False] * rig.model.slots  # closed in the model too


async def test_a_replay_that_makes_no_progress_does_not_hold_the_tick(rig):
    """A model whose `replay_work` takes no frame (a bug) is asked once a tick, and the
    other sessions go on being stepped on time: the tick never loops on it."""
    asked: list[int] = []

    def stuck(slot: int, frames: int) -> int:
        asked.append(rig.port.ticks)
        return rig.model.replay_pending(slot)

    rig.model.replay_work = stuck
    await rig.open("b")
    await open_with_history(rig, "a", steps_history(8))
    await rig.tick(5)
    await rig.clock.next_sleeper()
    assert asked == sorted(set(asked)) and len(asked) >= 4  # once a tick
    assert rig.model.batches[-5:] == [1] * 5  # b stepped every tick
    assert rig.port.stats()["deadline_misses"] == 0


async def test_a_restore_begins_at_once_in_the_ticks_wait(rig):
    """A session restored while the tick waits for its next frame is replayed in that
    wait, not after the next step: a short history is back before the next frame."""
    calls = costed(rig, frame_s=0.002)
    await rig.open("b")
    await rig.tick()
    await rig.clock.next_sleeper()
    ticks = rig.port.ticks
    await open_with_history(rig, "a", steps_history(20))
    async with asyncio.timeout(10):  # the clock stands still: only the wait can replay it
        while not all(p.done for p in rig.port.restore_progress()):
            await asyncio.sleep(0.001)
    (progress,) = rig.port.restore_progress()
    assert progress.replayed == 20
    assert rig.port.ticks == ticks  # no step ran meanwhile
    assert {tick for tick, _, _ in calls} == {ticks}
    await rig.tick()
    assert rig.model.batches[-1] == 2  # a steps with b at the very next frame
    assert rig.port.stats()["deadline_misses"] == 0
