"""Hostile client frames for bench/fuzz.py: valid events of every client type, mutated.

Every generator takes a `random.Random` so a run is reproducible from its seed. A frame is
(`where`, payload): `where` is "session" (sent on an open session) or "first" (the first
message on a new socket, e.g. a resume with a forged token); payload is text or bytes.
"""

from __future__ import annotations

import base64
import json
import random
import string
from collections.abc import Callable
from typing import Any

AUDIO_20MS = base64.b64encode(bytes(640)).decode()

TEMPLATES: list[dict[str, Any]] = [
    {"type": "session.update", "session": {"instructions": "be brief", "turn_detection": None}},
    {"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}},
    {
        "type": "session.update",
        "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
    },
    {"type": "session.update", "session": {"extra_body": {"pace": 0}, "temperature": 0.7}},
    {"type": "input_audio_buffer.append", "audio": AUDIO_20MS},
    {"type": "input_audio_buffer.append", "audio": AUDIO_20MS, "format": "pcm16"},
    {"type": "input_audio_buffer.commit"},
    {"type": "input.commit"},
    {"type": "input_audio_buffer.clear"},
    {"type": "input.cancel"},
    {"type": "response.create", "response": {"instructions": "hi"}},
    {"type": "response.cancel"},
    {"type": "output_audio_buffer.clear"},
    {"type": "barge_in"},
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hello"}],
        },
    },
    {"type": "conversation.item.delete", "item_id": "item_nope"},
    {
        "type": "conversation.item.truncate",
        "item_id": "item_nope",
        "content_index": 0,
        "audio_end_ms": 120,
    },
    {"type": "conversation.item.retrieve", "item_id": "item_nope"},
    {"type": "input.text.append", "text": "hello there"},
    {"type": "playback.ack", "played_ms": 100, "committed_ms": 100, "response_id": "resp_x"},
    {"type": "turn.signal", "event": "speech_started", "payload": {}},
    {"type": "session.heartbeat"},
    {"type": "session.close", "reason": "fuzz"},
    {"type": "session.event_ack", "server_event_seq": 1},
    {
        "type": "session.resume",
        "session_id": "duplex-x",
        "resume_token": "t",
        "last_received_server_event_seq": 0,
    },
]

HOSTILE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**64,
    -(2**63),
    10**40,
    1e308,
    -1e308,
    0.5,
    "",
    "x" * 5000,
    "\u0000",
    "\u202e",
    "🙂" * 100,
    [],
    {},
    [1, [2, [3]]],
    {"a": {"b": {"c": None}}},
    "NaN",
    "-Infinity",
    "../../etc/passwd",
    "<script>",
    "%s%s%n",
]

BAD_AUDIO = [
    "!!!",
    "abc",
    "AAA",
    base64.b64encode(b"\x01").decode(),
    base64.b64encode(b"\x01\x02\x03").decode(),
    "",
    "====",
    "A" * 4097 + "=",
    base64.b64encode(bytes(641)).decode(),
    "\u00e9" * 8,
]


def dumps(value: Any) -> str:
    """The stdlib encoder: unlike orjson it writes integers past 64 bits."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def mutate_template(rng: random.Random) -> str:
    event = dict(rng.choice(TEMPLATES))
    action = rng.randrange(6)
    keys = [k for k in event if k != "type"]
    if action == 0 and keys:
        del event[rng.choice(keys)]
    elif action == 1 and keys:
        event[rng.choice(keys)] = rng.choice(HOSTILE_VALUES)
    elif action == 2:
        event[rng.choice(["zz", "session", "audio", "item", "response", "event_id", "seq"])] = (
            rng.choice(HOSTILE_VALUES)
        )
    elif action == 3:
        event["type"] = rng.choice(
            [
                event["type"].upper(),
                event["type"] + ".x",
                "",
                "session",
                "x" * 300,
                7,
                None,
                ["session.update"],
                "response.done",
                "session.created",
                "error",
            ]
        )
    elif action == 4 and "session" in event:
        inner = dict(event["session"])
        field = rng.choice(
            [
                "instructions",
                "turn_detection",
                "audio",
                "temperature",
                "max_response_output_tokens",
                "voice",
                "modalities",
                "tools",
                "input_audio_format",
                "extra_body",
                "idle_timeout_s",
            ]
        )
        inner[field] = rng.choice(HOSTILE_VALUES)
        event["session"] = inner
    else:
        event["event_id"] = rng.choice(HOSTILE_VALUES)
    return dumps(event)


def bad_audio(rng: random.Random) -> str:
    return dumps(
        {
            "type": "input_audio_buffer.append",
            "audio": rng.choice(BAD_AUDIO),
            **rng.choice(
                [
                    {},
                    {"format": "pcm16"},
                    {"format": "g711_ulaw"},
                    {"format": "mp3"},
                    {"sample_rate_hz": -5},
                ]
            ),
        }
    )


def deep(rng: random.Random) -> str:
    depth = rng.choice([50, 500, 2000, 20000])
    where = rng.choice(["session", "item", "response", "audio"])
    return '{"type":"session.update","' + where + '":' + nested(depth) + "}"


def garbage(rng: random.Random) -> str | bytes:
    choice = rng.randrange(8)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))  # binary frame
    if choice == 1:
        text = mutate_template(rng)
        return text[: rng.randrange(len(text))]  # truncated JSON
    if choice == 2:
        return rng.choice(["[]", "1", '"session.update"', "null", "true", "{}", "", " "])
    if choice == 3:
        return '{"type":"session.heartbeat","type":"response.cancel"}'  # duplicate keys
    if choice == 4:
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(1, 300)))
    if choice == 5:
        return '{"type":"session.update","session":{"instructions":"\\ud800"}}'  # lone surrogate
    if choice == 6:
        return '{"type":"input_audio_buffer.append","audio":"' + AUDIO_20MS + '"'  # unclosed
    return '{"type": NaN}'


def out_of_order(rng: random.Random) -> str:
    return rng.choice(
        [
            '{"type":"response.cancel"}',
            '{"type":"input_audio_buffer.commit"}',
            '{"type":"output_audio_buffer.clear"}',
            '{"type":"session.event_ack","server_event_seq":999999999}',
            '{"type":"session.event_ack","server_event_seq":-4}',
            '{"type":"session.event_ack","server_event_seq":"12"}',
            '{"type":"session.resume","session_id":"duplex-0","resume_token":"x",'
            '"last_received_server_event_seq":0}',
            '{"type":"playback.ack","played_ms":100,"item_id":"item_missing"}',
            '{"type":"playback.ack","played_ms":-100}',
            '{"type":"conversation.item.truncate","item_id":"item_missing","content_index":0,'
            '"audio_end_ms":10}',
            '{"type":"response.create","response":{"conversation":"none","input":[]}}',
            '{"type":"turn.signal","event":"no_such_signal"}',
        ]
    )


def oversized(rng: random.Random) -> str:
    """Past the 15 MiB event limit (event_too_large), or past the 16 MiB frame limit of the
    WebSocket server (close 1009)."""
    size = rng.choice([15 * 1024 * 1024 + 10, 17 * 1024 * 1024])
    return '{"type":"input_audio_buffer.append","audio":"' + "A" * size + '"}'


MUTATORS: list[tuple[Callable[[random.Random], str | bytes], int]] = [
    (mutate_template, 50),
    (bad_audio, 12),
    (deep, 4),
    (garbage, 20),
    (out_of_order, 14),
    (oversized, 0.2),
]


def first_message(rng: random.Random, live_session: str) -> str | bytes:
    """The first message on a new socket (resume-only mode): forged resumes and worse."""
    choice = rng.randrange(6)
    if choice == 0:  # the live control session with a forged token
        return dumps(
            {
                "type": "session.resume",
                "session_id": live_session,
                "resume_token": base64.urlsafe_b64encode(rng.randbytes(32)).decode(),
                "last_received_server_event_seq": 0,
            }
        )
    if choice == 1:  # a session that never existed
        return dumps(
            {
                "type": "session.resume",
                "session_id": f"duplex-{rng.randbytes(16).hex()}",
                "resume_token": "x",
                "last_received_server_event_seq": 0,
            }
        )
    if choice == 2:
        return dumps(
            {
                "type": "session.resume",
                "session_id": live_session,
                "resume_token": "x",
                "last_received_server_event_seq": rng.choice([-1, "0", None, 1.5, 10**30]),
            }
        )
    if choice == 3:
        return dumps({"type": "session.resume", "session_id": rng.choice(HOSTILE_VALUES)})
    if choice == 4:
        return dumps({"type": "input_audio_buffer.append", "audio": AUDIO_20MS})
    return garbage(rng)


def frames(rng: random.Random, count: int, live_session: str) -> list[tuple[str, str | bytes]]:
    generators, weights = zip(*MUTATORS, strict=True)
    out: list[tuple[str, str | bytes]] = []
    for _ in range(count):
        if rng.random() < 0.05:
            out.append(("first", first_message(rng, live_session)))
        else:
            out.append(("session", rng.choices(generators, weights)[0](rng)))
    return out
