"""Small, fast runs of bench/chaos.py: API pods and a worker killed under live sessions."""

from bench.chaos import run_chaos


async def test_killing_api_pods_loses_and_duplicates_nothing():
    report = await run_chaos("api", sessions=4, seconds=8.0, kill_every=2.5)
    assert report.kills >= 1 and report.resumes >= 1, report
    assert report.turns > 0 and report.events > 0, report
    assert (report.lost, report.duplicated, report.mismatched, report.tracebacks) == (0, 0, 0, 0)
    assert report.failures == [], report.failures


async def test_killing_a_worker_ends_exactly_its_sessions_with_worker_lost():
    report = await run_chaos("worker", sessions=4, seconds=12.0)
    assert report.worker_lost_expected >= 1, report
    assert report.worker_lost_seen == report.worker_lost_expected, report
    assert (report.lost, report.duplicated, report.mismatched, report.tracebacks) == (0, 0, 0, 0)
    assert report.failures == [], report.failures
