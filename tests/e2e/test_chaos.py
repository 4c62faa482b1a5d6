"""Small, fast runs of bench/chaos.py: API pods killed, workers killed and rolled, under
live sessions."""

from bench.chaos import run_chaos


def assert_nothing_lost(report) -> None:
    assert report.turns > 0 and report.events > 0, report
    assert (report.lost, report.duplicated, report.mismatched, report.tracebacks) == (0, 0, 0, 0)
    assert report.closed == 0 and report.failures == [], report.failures


async def test_killing_api_pods_loses_and_duplicates_nothing():
    report = await run_chaos("api", sessions=4, seconds=8.0, kill_every=2.5)
    assert report.kills >= 1 and report.resumes >= 1, report
    assert_nothing_lost(report)


async def test_killed_workers_sessions_go_on_elsewhere_and_only_theirs_fail_a_response():
    """SIGKILL with restarts under the same id: no session closes; a response fails only
    in a session the killed worker held, and that session answers again."""
    report = await run_chaos("kill", sessions=6, seconds=16.0, kill_every=6.0)
    assert report.kills >= 1 and report.moves >= 1, report
    assert report.failed_others == 0, report
    assert report.recovery_s, report  # some victim answered again after its kill
    assert_nothing_lost(report)


async def test_a_rolling_restart_of_three_workers_closes_nothing_and_fails_nothing():
    """Each of the three workers SIGTERMed and restarted under the same id in turn, under
    12 talking sessions: every session moves, none closes, no response fails, no gap."""
    report = await run_chaos("rolling", sessions=12, seconds=12.0)
    assert report.kills >= 3 and report.moves >= 1, report
    assert (report.failed_victims, report.failed_others) == (0, 0), report
    assert report.pause_ms, report
    assert_nothing_lost(report)


async def test_native_sessions_keep_contiguous_histories_through_kill_drain_and_roll():
    """Six sessions of the echo frame model streaming in real time while the busiest worker
    is SIGKILLed, then drained, then all three rolled (bench/chaos_native.py): no event
    lost or twice, no session closed, each model history exactly the steps 1..N, and every
    move's restore read all its old owner had written."""
    report = await run_chaos("native", sessions=6, seconds=3.0, kill_every=0.5)
    assert min(report.kills, report.drains, report.rolls) >= 1, report
    assert report.moves >= 5 and len(report.restores) >= 5, report
    assert report.events > 0 and (report.lost, report.duplicated) == (0, 0), report.failures
    assert (report.closed, report.failed_others, report.tracebacks) == (0, 0, 0), report
    assert report.history_problems == 0 and report.histories_contiguous == 6, report.failures
    assert report.failures == [], report.failures
