"""A small, fast run of bench/fuzz.py: hostile frames against real processes."""

from bench.fuzz import run_fuzz


async def test_hostile_frames_get_contract_errors_and_spare_the_control_session():
    report = await run_fuzz(frame_count=800, connections=4, seed=7)
    assert report.frames == 800
    assert report.failures == [], report.failures[:10]
    assert report.tracebacks == 0 and report.processes_alive
    assert report.control_turns > 0 and report.control_problems == 0
    assert report.outcomes["error"] > 100  # most hostile frames are refused with a code
    assert {"invalid_json", "bad_event", "bad_audio"} <= set(report.codes)
