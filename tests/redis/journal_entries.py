"""The journal as it is stored: one entry per publisher round (event_publish.lua), for
tests that check what the journal holds beyond what a replay reads."""

from typing import NamedTuple

from shared.redis.keys import KeySchema
from shared.redis.live_message import LiveRecord, entry_first_seq, journal_entry_records


class JournalEntry(NamedTuple):
    first_seq: int  # the entry id's seq
    last_seq: int  # its `last` field
    size: int  # the bytes journal_bytes counts for it: its data's length
    records: list[LiveRecord]


async def journal_entries(client, sid: str, keys: KeySchema | None = None) -> list[JournalEntry]:
    stream = (keys or KeySchema()).events(sid)
    return [
        JournalEntry(
            entry_first_seq(entry_id),
            int(fields[b"last"]),
            len(fields[b"data"]),
            journal_entry_records(entry_id, fields),
        )
        for entry_id, fields in await client.xrange(stream)
    ]


async def journal_bytes_held(client, sid: str, keys: KeySchema | None = None) -> int:
    """What journal_bytes must say: the sum of the entries' data lengths."""
    return sum(entry.size for entry in await journal_entries(client, sid, keys))
