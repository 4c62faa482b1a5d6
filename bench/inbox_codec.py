"""The inbox codec alone: encode and decode time per message, and bytes per entry.

One realistic entry, what an API pod's writer round gives a busy worker: `--appends`
appends of 20 ms of pcm16 at 16 kHz (640 bytes of audio each) from `--sessions` sessions,
and one commit, heartbeat, playback.ack and response.cancel, every command parsed from a
client frame by `parse_client_event`, as the API pod does. Measured in the same run:

- **before**: the codec of commit c194ae6, copied below (`Before`), unchanged but for its
  names: a flat envelope per message (`[k, s, a, q, p]` headers in `m`, `b<i>` audio), the
  headers type-checked by hand, each command rebuilt by reflection (`get_type_hints`,
  `dataclasses.fields` and a wire-key table);
- **after**: `shared.redis.inbox_codec` (msgspec Structs tagged by `k`, one decoder call per
  entry that builds the typed commands).

encode: typed commands -> the entry's fields (the API pod; `before` includes building each
envelope with `command_payload`); decode: the entry's fields as XREADGROUP returns them ->
typed records with their commands (the worker); drain: a message a draining worker kept
back and then dispatched (before: decoded, re-encoded to fields for `Drain.take`, decoded
and rebuilt again; after: decoded once, so the same as decode). Best of
`--repeats` runs of `--iterations` each. Prints the figures and writes them to
docs/benchmarks.md (section `inbox_codec`).

    .venv/bin/python -m bench.inbox_codec [--appends 32] [--sessions 8] [--iterations 2000]
                                          [--section inbox_codec] [--label TEXT] [--docs DIR]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import functools
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from bench.common import add_output_arguments, commit, machine, now_utc, write_section
from shared.protocol.duplex import DUPLEX_COMMANDS, DuplexCommand, parse_client_event
from shared.redis import inbox_codec as after
from shared.redis.inbox_codec import CommandRecord

# ---------------------------------------------------------------- before (c194ae6, copied)


class Before:
    """The inbox codec as it was at c194ae6 (shared/redis/inbox_codec.py and the record
    half of shared/redis/boundary.py), copied as the baseline: envelope, pack, hand-checked
    headers, reflective rebuild."""

    PACK = "pack"
    PACK_KIND = PACK.encode()
    APPEND_TYPE = "input_audio_buffer.append"
    WIRE_KEYS: typing.ClassVar[dict[str, dict[str, str]]] = {
        "session.update": {"patch": "session"},
        "response.create": {"options": "response"},
    }

    @dataclasses.dataclass(frozen=True)
    class InboxMessage:
        kind: str
        session_id: str
        attachment: int = 0
        seq: int = 0
        payload: Any = dataclasses.field(default_factory=dict)
        audio: bytes = b""

        def to_fields(self) -> dict[str, bytes | str | int]:
            fields: dict[str, bytes | str | int] = {
                "k": self.kind,
                "s": self.session_id,
                "a": self.attachment,
                "q": self.seq,
                "p": orjson.dumps(self.payload),
            }
            if self.audio:
                fields["b"] = self.audio
            return fields

        def header(self) -> list[Any]:
            return [self.kind, self.session_id, self.attachment, self.seq, self.payload]

        @classmethod
        def from_fields(cls, fields: Mapping[bytes, bytes]) -> Before.InboxMessage:
            return cls(
                kind=fields[b"k"].decode(),
                session_id=fields[b"s"].decode(),
                attachment=int(fields.get(b"a", b"0")),
                seq=int(fields.get(b"q", b"0")),
                payload=orjson.loads(fields.get(b"p", b"{}")),
                audio=fields.get(b"b", b""),
            )

    @dataclasses.dataclass(frozen=True)
    class CommandRecord:
        session_id: str
        attachment: int
        seq: int
        command: DuplexCommand

    @staticmethod
    def command_payload(command: DuplexCommand) -> tuple[Any, bytes]:
        if command.TYPE == Before.APPEND_TYPE:
            return command.inbox_fields(), command.audio  # type: ignore[attr-defined]
        return command.to_dict(), b""

    @staticmethod
    def message(record: CommandRecord) -> Before.InboxMessage:
        payload, audio = Before.command_payload(record.command)
        return Before.InboxMessage(
            "command", record.session_id, record.attachment, record.seq, payload, audio
        )

    @staticmethod
    def pack_entry(messages: Sequence[Before.InboxMessage]) -> dict[str, bytes | str | int]:
        if len(messages) == 1:
            return messages[0].to_fields()
        fields: dict[str, bytes | str | int] = {
            "k": Before.PACK,
            "m": orjson.dumps([message.header() for message in messages]),
        }
        for index, message in enumerate(messages):
            if message.audio:
                fields[f"b{index}"] = message.audio
        return fields

    @staticmethod
    def unpack_entry(fields: Mapping[bytes, bytes]) -> list[Before.InboxMessage]:
        if fields.get(b"k") != Before.PACK_KIND:
            return [Before.InboxMessage.from_fields(fields)]
        headers = orjson.loads(fields[b"m"])
        if not isinstance(headers, list):
            raise ValueError("a pack's headers are not a list")
        messages = []
        for index, header in enumerate(headers):
            if not isinstance(header, list) or len(header) != 5:
                raise ValueError(f"header {index} of a pack is not [k, s, a, q, p]")
            kind, session_id, attachment, seq, payload = header
            if not (
                isinstance(kind, str)
                and isinstance(session_id, str)
                and type(attachment) is int
                and type(seq) is int
                and isinstance(payload, dict | list)
            ):
                raise ValueError(f"header {index} of a pack has fields of the wrong types")
            audio = fields.get(b"b%d" % index, b"")
            messages.append(Before.InboxMessage(kind, session_id, attachment, seq, payload, audio))
        return messages

    @staticmethod
    def message_fields(message: Before.InboxMessage) -> dict[bytes, bytes]:
        return {
            key.encode(): value if isinstance(value, bytes) else str(value).encode()
            for key, value in message.to_fields().items()
        }

    @staticmethod
    @functools.cache
    def constructor_fields(cls: type) -> tuple[tuple[str, str, bool], ...]:
        hints = typing.get_type_hints(cls)
        keys = Before.WIRE_KEYS.get(cls.TYPE, {})  # type: ignore[attr-defined]
        return tuple(
            (f.name, keys.get(f.name, f.name), typing.get_origin(hints[f.name]) is tuple)
            for f in dataclasses.fields(cls)
            if f.name != "audio"
        )

    @staticmethod
    def rebuild_command(payload: Any, audio: bytes = b"") -> DuplexCommand:
        if isinstance(payload, list):
            return DUPLEX_COMMANDS[Before.APPEND_TYPE].from_inbox_fields(payload, audio)  # type: ignore[attr-defined]
        cls = DUPLEX_COMMANDS[payload["type"]]
        kwargs = {
            name: tuple(payload[key]) if as_tuple else payload[key]
            for name, key, as_tuple in Before.constructor_fields(cls)
            if key in payload
        }
        if audio:
            kwargs["audio"] = audio
        return cls(**kwargs)

    @staticmethod
    def record(message: Before.InboxMessage) -> Before.CommandRecord:
        """`InboxMessage.record()` for a command (`CommandRecord.from_message`)."""
        command = Before.rebuild_command(message.payload, message.audio)
        return Before.CommandRecord(message.session_id, message.attachment, message.seq, command)


# ---------------------------------------------------------------- the entry


def frames(appends: int, sessions: int) -> list[tuple[str, dict[str, Any]]]:
    """(session, client frame): `appends` appends over `sessions` sessions, then a commit,
    a heartbeat, a playback ack and a cancel."""
    audio = base64.b64encode(bytes(range(256)) * 2 + bytes(128)).decode()  # 640 bytes
    out = [
        (
            f"duplex-{n % sessions:032x}",
            {"type": "input_audio_buffer.append", "event_id": f"evt_{n:06d}", "audio": audio},
        )
        for n in range(appends)
    ]
    last = f"duplex-{0:032x}"
    out += [
        (last, {"type": "input_audio_buffer.commit", "event_id": "evt_commit"}),
        (last, {"type": "session.heartbeat", "event_id": "evt_hb"}),
        (last, {"type": "playback.ack", "played_ms": 480, "response_id": "resp_0123456789"}),
        (last, {"type": "response.cancel", "event_id": "evt_cancel"}),
    ]
    return out


def records(appends: int, sessions: int) -> list[CommandRecord]:
    seqs: dict[str, int] = {}
    out = []
    for sid, frame in frames(appends, sessions):
        seqs[sid] = seqs.get(sid, 0) + 1
        out.append(CommandRecord(sid, 1, seqs[sid], parse_client_event(orjson.dumps(frame))))
    return out


def as_read(fields: Mapping[str, Any]) -> dict[bytes, bytes]:
    """Stream fields as XREADGROUP returns them."""
    return {
        key.encode(): value if isinstance(value, bytes) else str(value).encode()
        for key, value in fields.items()
    }


def best_us(work: Callable[[], Any], iterations: int, repeats: int) -> float:
    """Best of `repeats` runs: microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            work()
        best = min(best, (time.perf_counter() - start) / iterations)
    return best * 1e6


def measure(batch: list[CommandRecord], iterations: int, repeats: int) -> dict[str, Any]:
    old_records = [
        Before.CommandRecord(r.session_id, r.attachment, r.seq, r.command) for r in batch
    ]
    old_fields = as_read(Before.pack_entry([Before.message(r) for r in old_records]))
    new_fields = as_read(after.encode_entry(batch))
    # both read back what was written
    assert [Before.record(m) for m in Before.unpack_entry(old_fields)] == old_records
    assert after.decode_entry(new_fields) == batch

    def old_encode() -> Any:
        return Before.pack_entry([Before.message(r) for r in old_records])

    def old_decode() -> Any:
        return [Before.record(m) for m in Before.unpack_entry(old_fields)]

    def old_drain() -> Any:
        # a drain keeping messages back: each re-encoded to fields for `Drain.take`, decoded
        # again and rebuilt when given back (dispatched)
        return [
            Before.record(Before.InboxMessage.from_fields(Before.message_fields(m)))
            for m in Before.unpack_entry(old_fields)
        ]

    def new_encode() -> Any:
        return after.encode_entry(batch)

    def new_decode() -> Any:
        return after.decode_entry(new_fields)

    header = old_fields.get(b"m", old_fields.get(b"p", b""))
    # the budget's count as it was: the headers (`m`, or a lone message's `p`) and the audio
    old_bytes = sum(len(v) for k, v in old_fields.items() if k in (b"m", b"p") or k[:1] == b"b")
    decode_us = best_us(new_decode, iterations, repeats)
    return {
        "messages": len(batch),
        "before": {
            "encode_us": best_us(old_encode, iterations, repeats),
            "decode_us": best_us(old_decode, iterations, repeats),
            "drain_us": best_us(old_drain, iterations, repeats),
            "json_bytes": len(header),
            "entry_bytes": max(old_bytes, after.MIN_ENTRY_BYTES),
        },
        "after": {
            "encode_us": best_us(new_encode, iterations, repeats),
            "decode_us": decode_us,
            "drain_us": decode_us,  # a kept-back message is dispatched as it was decoded
            "json_bytes": len(new_fields[b"m"]),
            "entry_bytes": after.entry_bytes(new_fields),
        },
    }


def render(name: str, result: dict[str, Any]) -> str:
    n = result["messages"]
    lines = [
        f"{name}: {n} messages",
        f"{'':8} {'encode µs/msg':>14} {'decode µs/msg':>14} {'drain µs/msg':>13} "
        f"{'JSON B':>8} {'entry B':>8} {'JSON B/msg':>11}",
    ]
    for side in ("before", "after"):
        r = result[side]
        lines.append(
            f"{side:8} {r['encode_us'] / n:>14.2f} {r['decode_us'] / n:>14.2f} "
            f"{r['drain_us'] / n:>13.2f} {r['json_bytes']:>8} {r['entry_bytes']:>8} "
            f"{r['json_bytes'] / n:>11.1f}"
        )
    b, a = result["before"], result["after"]
    lines.append(
        f"after/before: encode {a['encode_us'] / b['encode_us']:.2f}x, "
        f"decode {a['decode_us'] / b['decode_us']:.2f}x, "
        f"drain {a['drain_us'] / b['drain_us']:.2f}x, "
        f"entry bytes {a['entry_bytes'] / b['entry_bytes']:.3f}x"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    print(f"bench.inbox_codec on {machine()}")
    batch = records(args.appends, args.sessions)
    cases = [
        (
            f"a writer round's entry ({args.appends} appends of 640 B + 4 commands)",
            measure(batch, args.iterations, args.repeats),
        ),
        ("a lone heartbeat", measure(batch[-3:-2], args.iterations * 10, args.repeats)),
        ("a lone append", measure(batch[:1], args.iterations * 10, args.repeats)),
    ]
    tables = "\n\n".join(render(name, result) for name, result in cases)
    print(tables)
    command = (
        f"python -m bench.inbox_codec --appends {args.appends} --sessions {args.sessions} "
        f"--iterations {args.iterations} --repeats {args.repeats}"
    )
    body = (
        f"Measured {now_utc()} on {machine()}, code at commit {commit()}:\n`{command}`\n\n"
        f"```text\n{tables}\n```"
    )
    heading = "The inbox codec alone (`bench/inbox_codec.py`)"
    if args.label:
        heading += f", {args.label}"
    write_section("benchmarks.md", args.section, body, heading, args.docs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    add_output_arguments(parser, "inbox_codec")
    main(parser.parse_args())
