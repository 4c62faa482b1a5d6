"""The dead-worker sweep splits an API pod's entries: each session's commands go to its new
worker, in order, as they were read (issue 18)."""

from services.api.failover import WorkerLoss
from shared.protocol.duplex import AppendAudio, Commit
from shared.redis.boundary import FORWARDED_KINDS, CommandRecord, encode_entry


def as_read(fields: dict) -> dict[bytes, bytes]:
    return {
        key.encode(): value if isinstance(value, bytes) else str(value).encode()
        for key, value in fields.items()
    }


def test_a_dead_workers_packs_are_split_by_session_in_order():
    messages = [
        CommandRecord("duplex-a", 1, 1, AppendAudio(audio=b"\x01\x00" * 320, event_id="a1")),
        CommandRecord("duplex-b", 1, 1, AppendAudio(audio=b"\x02\x00" * 320, event_id="b1")),
        CommandRecord("duplex-a", 1, 2, Commit(event_id="c1")),
    ]
    pack = as_read(encode_entry(messages))
    garbage = {b"m": b"not json"}
    loss = WorkerLoss("dead")
    loss.take(0, [(b"1-0", pack), (b"2-0", garbage)])
    assert loss.last_ids == {0: "2-0"}
    assert sorted(loss.entries) == ["duplex-a", "duplex-b"]
    for sid in ("duplex-a", "duplex-b"):
        forwarded = loss.entries[sid]
        assert all(isinstance(message, FORWARDED_KINDS) for message in forwarded)
        assert forwarded == [record for record in messages if record.session_id == sid]
