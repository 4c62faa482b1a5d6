"""What a real-time session costs over the bare floor (bench/bare_floor.py): the CPU
ratios bench.capacity makes its headline, and where Redis's commands go.

A ratio is the API's (or the worker's) CPU per session over the bare floor's CPU per
session, both measured with the same conversations, frames and window length in the same
run: a figure that survives a shared machine's drift better than a CPU time does. The
Redis figures come from `INFO commandstats` after a `CONFIG RESETSTAT` at the start of each
window, so they say which commands the session audio-seconds cost, not only how many.
"""

from __future__ import annotations

import redis.asyncio as redis_async

TOP_IN_TABLE = 5  # the Redis commands a table row names, most called first
TOP_IN_HEADLINE = 12  # and the headline, for the level it reports
BEHIND = " (behind)"
OWN_COMMANDS = ("INFO", "CONFIG RESETSTAT")  # what the bench itself sends in a window


async def redis_commands(redis: redis_async.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, without the bench's own. Commands
    a Lua script runs count under their own names as well as the EVALSHA that ran them (as
    in total_commands_processed, the figure the earlier tables used)."""
    calls = {}
    for key, stats in (await redis.info("commandstats")).items():
        name = key.removeprefix("cmdstat_").replace("|", " ").upper()
        if name not in OWN_COMMANDS:
            calls[name] = int(stats["calls"])
    return calls


def top_rates(calls: dict[str, int], audio_s: float) -> list[tuple[str, float]]:
    """Every command, most called first, as calls per session audio-second."""
    ordered = sorted(calls.items(), key=lambda kv: -kv[1])
    return [(name, n / audio_s) for name, n in ordered]


def top_commands(row: dict, count: int = TOP_IN_TABLE) -> str:
    return ", ".join(f"{name} {rate:.0f}" for name, rate in row["redis_top"][:count])


def ratios(row: dict) -> tuple[float, float]:
    """API/floor and worker/floor: CPU per session over the floor's CPU per session (the
    same number of sessions, so the same as the ratio of cores busy)."""
    floor = row["floor"]["cpu"]["floor"] or float("nan")
    return row["cpu"]["api"] / floor, row["cpu"]["worker"] / floor


def cost_table(results: list[dict]) -> list[str]:
    rows = [
        "| sessions | API CPU | worker CPU | bare floor CPU | **API / floor** | "
        "**worker / floor** | Redis CPU | Redis commands / session audio s | top commands "
        "/ session audio s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cpu = r["cpu"]
        api_ratio, worker_ratio = ratios(r)
        # past the limit the stack falls behind its schedule and does less work than the
        # floor in the window: its ratios there understate what a session costs
        mark = BEHIND if "stopped_by" in r else ""
        rows.append(
            f"| {r['sessions']} | {cpu['api']:.2f} | {cpu['worker']:.2f} "
            f"| {r['floor']['cpu']['floor']:.2f} | **{api_ratio:.1f}x**{mark} "
            f"| **{worker_ratio:.1f}x**{mark} | {cpu['redis']:.2f} "
            f"| {r['redis_ops_per_audio_s']:.0f} | {top_commands(r)} |"
        )
    if any("stopped_by" in r for r in results):
        rows += [
            "",
            f"{BEHIND.strip()}: the level the ramp stopped at; the stack was behind its "
            "schedule, so its CPU and Redis commands per session there understate a "
            "session's cost.",
        ]
    return rows


def headline(row: dict) -> str:
    api_ratio, worker_ratio = ratios(row)
    return (
        f"At {row['sessions']} sessions: **API {api_ratio:.1f}x the bare floor's CPU per "
        f"session, worker {worker_ratio:.1f}x; {row['redis_ops_per_audio_s']:.0f} Redis "
        f"commands per session audio-second** (most: {top_commands(row, TOP_IN_HEADLINE)})."
    )
