"""`CommandSender` while Redis is away (a failover): a client's appends that cannot be written
are told once per turn, not once per append; a write that succeeds or the next turn's
command ends the run (the next failure is told again); a full inbox is still told for every
append it drops. The pod-wide log of the outage is the inbox writer's (test_inbox_packs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.exceptions import ConnectionError as RedisConnectionError

from services.api.command_sender import CommandSender
from services.api.inbox_writer import InboxFull
from shared.protocol.duplex import AppendAudio, Commit, DuplexErrorEvent


class Workers:
    """The inbox's side: each command settles as `outcome` says (None: written)."""

    def __init__(self) -> None:
        self.outcome: BaseException | None = None

    def send_command(self, worker_id, session_id, attachment, seqs, command) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.outcome is None:
            future.set_result(None)
        else:
            future.set_exception(self.outcome)
        return future


def append(n: int) -> AppendAudio:
    return AppendAudio(audio=b"\x00" * 64, event_id=f"a{n}")


async def sent(sender: CommandSender, command) -> None:
    written = await sender.send("w", "duplex-s", 1, command)
    if written is not None:  # not an append: the caller awaits it
        with contextlib.suppress(Exception):
            await written


async def test_redis_away_is_told_once_per_turn_not_once_per_append(caplog):
    workers = Workers()
    sender = CommandSender(workers, clock=lambda: 0.0)  # type: ignore[arg-type]
    heard: list[DuplexErrorEvent] = []
    sender.report = heard.append
    workers.outcome = RedisConnectionError("the primary is gone")
    # at DEBUG: the pod's inbox writer logs the outage itself, once a run
    with caplog.at_level(logging.DEBUG, logger="services.api.command_sender"):
        for n in range(27):  # 27 appends 20 ms apart: half a second of a failover
            await sent(sender, append(n))
        assert [(e.code, e.related_event_id) for e in heard] == [("internal_error", "a0")]
        await sent(sender, Commit(event_id="c1"))  # the next turn
        for n in range(27, 30):
            await sent(sender, append(n))
        # the next turn's first failure is told again
        assert [e.related_event_id for e in heard] == ["a0", "a27"]
        workers.outcome = None
        await sent(sender, append(30))  # written: Redis is back
        workers.outcome = RedisConnectionError("again")
        await sent(sender, append(31))
    assert [e.related_event_id for e in heard] == ["a0", "a27", "a31"]
    assert all(e.to_dict()["error"]["retryable"] and e.code == "internal_error" for e in heard)
    lines = [r.getMessage() for r in caplog.records]
    # three runs told (one line each) and two counted (26 after a0, 2 after a27)
    assert sum("was not written" in line for line in lines) == 3
    assert any("26 more appends were not written" in line for line in lines)
    assert any("2 more appends were not written" in line for line in lines)
    assert len(lines) == 5


async def test_a_full_inbox_is_told_for_every_append_it_drops():
    workers = Workers()
    sender = CommandSender(workers)  # type: ignore[arg-type]
    heard: list[DuplexErrorEvent] = []
    sender.report = heard.append
    workers.outcome = InboxFull("full")
    for n in range(3):
        await sent(sender, append(n))
    assert [(e.code, e.related_event_id) for e in heard] == [
        ("input_backpressure", "a0"),
        ("input_backpressure", "a1"),
        ("input_backpressure", "a2"),
    ]


async def test_a_stream_of_appends_alone_is_told_again_while_the_outage_lasts():
    """A native client sends nothing but appends (the model finds its turns): no commit
    ends its run, so a long outage is told again every `RETELL_S`, not once for all of it,
    and an utterance spoken late in it is not lost untold."""
    from services.api.command_sender import RETELL_S

    now = [100.0]
    workers = Workers()
    sender = CommandSender(workers, clock=lambda: now[0])  # type: ignore[arg-type]
    heard: list[DuplexErrorEvent] = []
    sender.report = heard.append
    workers.outcome = RedisConnectionError("the primary is gone")
    for n in range(200):  # 20 ms appends: 4 s of a failover
        await sent(sender, append(n))
        now[0] += 0.02
    told = [e.related_event_id for e in heard]
    # told at the start and once each RETELL_S after it: a handful, not 200
    assert told[0] == "a0" and 1 < len(told) <= int(4.0 / RETELL_S) + 1, told
    assert all(e.code == "internal_error" for e in heard)
