"""A model history's two layouts (shared/contracts/model_history.py): fixed records, the
records concatenated (Moshi's and Nemotron's, byte for byte what they always were), and
sized records, each after its length, for a model whose frames vary."""

from __future__ import annotations

import struct

import pytest

from shared.contracts import SIZED_RECORDS, ModelHistory, join_records, split_records
from shared.contracts.model_history import count_records


def test_fixed_records_are_the_records_concatenated():
    records = [bytes([n]) * 4 for n in range(5)]
    history = ModelHistory(4)
    for record in records:
        history.append(record)
    assert bytes(history.data) == b"".join(records)  # no prefix, no header: as before
    assert history.frames == 5 and history.meta_record_bytes == 4
    assert split_records(history.data, 4, sized=False) == records
    back = ModelHistory(4, bytes(history.data))
    assert (back.frames, back.restored_frames, back.written) == (5, 5, 20)
    with pytest.raises(ValueError, match="not 4"):
        history.append(b"abc")
    with pytest.raises(ValueError, match="not whole"):
        ModelHistory(4, b"abcdef")


def test_sized_records_each_follow_their_length():
    records = [b"", b"a", bytes(range(200)), b"xyz"]
    history = ModelHistory(256, sized=True)
    for record in records:
        history.append(record)
    data = bytes(history.data)
    # what an operator reads with GETRANGE: a little-endian uint32 length, then the bytes
    assert data[:4] == struct.pack("<I", 0) and data[4:8] == struct.pack("<I", 1)
    assert data[8:9] == b"a" and struct.unpack_from("<I", data, 9) == (200,)
    assert len(data) == 4 * 4 + sum(map(len, records))
    assert history.frames == 4 and history.meta_record_bytes == SIZED_RECORDS == 0
    assert split_records(data, 256, sized=True) == records
    assert join_records(records, 256, sized=True) == data
    back = ModelHistory(256, data, sized=True)
    assert (back.frames, back.restored_frames) == (4, 4)
    back.append(b"more")
    assert back.frames == 5 and back.unwritten() == (len(data), struct.pack("<I", 4) + b"more")
    with pytest.raises(ValueError, match="past 256"):
        history.append(bytes(257))


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 10])
def test_a_sized_history_that_ends_inside_a_record_is_refused(cut):
    data = join_records([b"first", b"second record"], 64, sized=True)
    assert count_records(data, 64, sized=True) == 2
    with pytest.raises(ValueError, match=r"not whole records|inside a record"):
        ModelHistory(64, data[:-cut], sized=True)


def test_a_sized_record_longer_than_the_model_s_most_is_refused_when_read():
    data = join_records([bytes(100)], 128, sized=True)
    with pytest.raises(ValueError, match="at most 64"):
        split_records(data, 64, sized=True)
