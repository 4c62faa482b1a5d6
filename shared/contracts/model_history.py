"""`ModelHistory`: a model-native session's model state as its model's frame records, and
the two layouts those records lie in (in memory and in Redis, `duplex:session:{SID}:model`,
docs/redis-keys.md).

A frame-clocked model that exports its state gives a record with every frame it steps
(`FrameOutput.record`), such that its slot's state after N frames is a pure function of its
options and its N records. A model declares how they lie (`FrameModel.state_record_bytes`,
`state_records_sized`):

- **fixed**: every record is `record_bytes` long and the history is the records one after
  another: frame i is bytes [i x record_bytes, (i+1) x record_bytes). Moshi (36 bytes a
  frame) and Nemotron VoiceChat (2,702). The session hash's `model_record_bytes` says the
  size.
- **sized**: each record has its own length, at most `record_bytes`, and the history is,
  for each record, its length as a 4-byte little-endian unsigned integer, then its bytes.
  A model whose frame holds what varies: a 1 s unit's audio, the tokens it said, the
  camera frames it saw (MiniCPM-o 4.5). The session hash's `model_record_bytes` is 0
  (`SIZED_RECORDS`): no fixed size.

A history is read back whole records only (`split_records`: a history that ends inside a
record is refused, never replayed misaligned); a model's `restore_slot` gets the bytes in
its own layout and splits them the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

#: a sized record's length prefix: an unsigned 32-bit integer, little-endian
RECORD_LENGTH = struct.Struct("<I")
#: the session hash's `model_record_bytes` for a history of sized records
SIZED_RECORDS = 0


def split_records(data: bytes | bytearray, record_bytes: int, *, sized: bool) -> list[bytes]:
    """The records of a history in its layout (module head), in frame order; ValueError
    when it is not whole records (or a sized record is longer than `record_bytes`)."""
    view = memoryview(data)
    return [bytes(view[start:end]) for start, end in _spans(data, record_bytes, sized)]


def count_records(data: bytes | bytearray, record_bytes: int, *, sized: bool) -> int:
    """How many records a history holds (ValueError as `split_records`), without copying
    them."""
    spans = _spans(data, record_bytes, sized)
    if not sized:
        next(spans, None)  # the checks: the records' size, and whole records
        return len(data) // record_bytes
    return sum(1 for _ in spans)


def _spans(data: bytes | bytearray, record_bytes: int, sized: bool) -> Iterator[tuple[int, int]]:
    """(start, end) of each record's bytes in `data`."""
    if record_bytes < 1:
        raise ValueError(f"records of {record_bytes} bytes")
    if not sized:
        if len(data) % record_bytes:
            raise ValueError(
                f"a history of {len(data)} bytes is not whole {record_bytes}-byte records"
            )
        for start in range(0, len(data), record_bytes):
            yield start, start + record_bytes
        return
    offset = 0
    while offset < len(data):
        if offset + RECORD_LENGTH.size > len(data):
            raise ValueError(f"a history of {len(data)} bytes ends inside a record's length")
        (length,) = RECORD_LENGTH.unpack_from(data, offset)
        start = offset + RECORD_LENGTH.size
        if length > record_bytes or start + length > len(data):
            raise ValueError(
                f"a history of {len(data)} bytes is not whole records: a record of {length} "
                f"bytes at byte {offset} (at most {record_bytes})"
            )
        yield start, start + length
        offset = start + length


def join_records(records: list[bytes], record_bytes: int, *, sized: bool) -> bytes:
    """A history of `records` in its layout (what `split_records` reads back)."""
    history = ModelHistory(record_bytes, sized=sized)
    for record in records:
        history.append(record)
    return bytes(history.data)


class ModelHistory:
    """A model-native session's model state, as the model's records of its frames
    (`FrameOutput.record`), appended frame by frame in the model's layout (module head);
    how much of it is in Redis already (`written`, in bytes: the publisher appends the
    rest, about once a second); and how many frames the session came back with at its
    last restore. One per session, owned by its stream (`NativeStream`), so it outlives
    the stage's slot."""

    def __init__(self, record_bytes: int, data: bytes = b"", *, sized: bool = False) -> None:
        """`record_bytes`: every record's size, or the most a sized one holds (`sized`).
        `data`: what the session came back with (whole records, ValueError otherwise)."""
        self.record_bytes = record_bytes
        self.sized = sized
        self._frames = count_records(data, record_bytes, sized=sized)
        self.data = bytearray(data)
        self.written = len(data)  # what it came back with is in Redis already
        self.restored_frames = self._frames

    @property
    def frames(self) -> int:
        return self._frames

    @property
    def meta_record_bytes(self) -> int:
        """Its layout as the session hash's `model_record_bytes` says it: the size of
        every record, or `SIZED_RECORDS` (0) for sized records."""
        return SIZED_RECORDS if self.sized else self.record_bytes

    def append(self, record: bytes) -> None:
        if self.sized:
            if len(record) > self.record_bytes:
                raise ValueError(f"a record of {len(record)} bytes, past {self.record_bytes}")
            self.data += RECORD_LENGTH.pack(len(record))
        elif len(record) != self.record_bytes:
            raise ValueError(f"a record of {len(record)} bytes, not {self.record_bytes}")
        self.data += record
        self._frames += 1

    @property
    def behind(self) -> bool:
        """Frames not in Redis yet."""
        return self.written < len(self.data)

    def unwritten(self) -> tuple[int, bytes] | None:
        """(offset, bytes) not in Redis yet, or None."""
        if not self.behind:
            return None
        return self.written, bytes(self.data[self.written :])

    def mark_written(self, upto: int) -> None:
        self.written = max(self.written, upto)


__all__ = [
    "RECORD_LENGTH",
    "SIZED_RECORDS",
    "ModelHistory",
    "count_records",
    "join_records",
    "split_records",
]
