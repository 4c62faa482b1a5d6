"""OpenAI Realtime GA as the judge of the openai surface: the installed `openai` SDK's types.

`check_ga_event(event)` validates one decoded server event against the SDK's
`RealtimeServerEvent` union in pydantic's strict mode (no coercion: an int is an int) and
refuses any key GA does not declare, at any depth (the SDK's models accept unknown keys,
so validation alone would let a key of ours through). A session object is checked against
`RealtimeSessionCreateResponse`, the object GA's server sends (the event's own type is the
request object, which has no `id`, `object` or `expires_at`)."""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Iterator
from typing import Any

import orjson
import pydantic
from openai.types.realtime import RealtimeServerEvent, RealtimeSessionCreateResponse

SERVER_EVENT = pydantic.TypeAdapter(RealtimeServerEvent)
SESSION = pydantic.TypeAdapter(RealtimeSessionCreateResponse)
#: every server event type GA defines -> its own model (for a readable error)
GA_EVENT_MODELS = {
    typing.get_args(member.model_fields["type"].annotation)[0]: pydantic.TypeAdapter(member)
    for member in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}
GA_SERVER_EVENT_TYPES = frozenset(GA_EVENT_MODELS)
#: keys of ours GA clients tolerate (the brief of the surface allows these)
TOLERATED = frozenset({"error.retryable"})


def extra_keys(value: Any, path: str = "") -> Iterator[str]:
    """Paths of the keys a validated model holds beyond its declared fields."""
    if isinstance(value, pydantic.BaseModel):
        for key in value.model_extra or {}:
            yield f"{path}{key}"
        for name in type(value).model_fields:
            yield from extra_keys(getattr(value, name), f"{path}{name}.")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from extra_keys(item, f"{path}{index}.")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from extra_keys(item, f"{path}{key}.")


def check_ga_event(event: dict[str, Any]) -> pydantic.BaseModel:
    """The event as the SDK's model; AssertionError naming what is not GA's."""
    assert event.get("type") in GA_SERVER_EVENT_TYPES, f"not a GA server event: {event}"
    GA_EVENT_MODELS[event["type"]].validate_python(event, strict=True)  # names what is wrong
    model = SERVER_EVENT.validate_python(event, strict=True)
    extras = [p for p in extra_keys(model) if p not in TOLERATED]
    if "session" in event:
        session = SESSION.validate_python(event["session"], strict=True)
        extras = [p for p in extras if not p.startswith("session.")]
        extras += [f"session.{p}" for p in extra_keys(session)]
    assert not extras, f"{event['type']}: keys GA does not have: {extras}"
    return model


async def receive_until(connection: Any, wire_type: str, seen: list[dict], timeout: float = 30):
    """Receive from an openai SDK realtime connection up to the first `wire_type`; every
    event is checked with `check_ga_event` and appended to `seen`."""
    async with asyncio.timeout(timeout):
        while True:
            event = orjson.loads(await connection.recv_bytes())
            check_ga_event(event)
            seen.append(event)
            if event["type"] == wire_type:
                return event
