"""Typed wire messages: dataclasses that render themselves as compact JSON.

Every server event is a keyword-only dataclass whose fields are exactly its
wire keys besides `type` and `event_id`. Nested objects (session, response,
item, part) stay plain JSON dicts: the codec types the envelope, and the
session/item readers interpret the nested objects where they are consumed.

Rendering rule: a field whose value is None is omitted, unless it is declared
with `keep_null()` (OpenAI sends, e.g., `previous_item_id: null`). That rule is
what lets a Tier 2 extension field be absent when it does not apply.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import orjson

JSON = dict[str, Any]

_KEEP_NULL = "keep_null"


def new_event_id() -> str:
    """A server event id: `event_` + uuid4 hex (contract 1.1)."""
    return "event_" + uuid.uuid4().hex


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON (no spaces), the only serializer used on the wire."""
    return orjson.dumps(obj)


def loads(data: str | bytes) -> Any:
    return orjson.loads(data)


def keep_null(default: Any = None) -> Any:
    """Declare a field that renders as JSON null instead of being omitted."""
    return dataclasses.field(default=default, metadata={_KEEP_NULL: True})


class WireFormatError(ValueError):
    """A wire object does not have the shape its type declares."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class WireField:
    name: str
    hint: Any
    required: bool
    keep_null: bool


@functools.cache
def wire_fields(cls: type) -> tuple[WireField, ...]:
    """The wire keys of a message class, in declaration order (cached per class)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "event_id" or f.name.startswith("_"):
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(WireField(f.name, hints[f.name], required, bool(f.metadata.get(_KEEP_NULL))))
    return tuple(out)


_SCALARS: dict[Any, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str,),
}


def _matches(value: Any, hint: Any) -> Any:
    """Check (and lightly coerce) one JSON value against a field's type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arm in typing.get_args(hint):
            if arm is type(None):
                continue
            try:
                return _matches(value, arm)
            except WireFormatError:
                continue
        raise WireFormatError(f"expected {hint}, got {type(value).__name__}")
    if hint is Any:
        return value
    container = origin or hint
    if container in (dict, list) and isinstance(value, container):
        return value
    # bool is an int in Python, never in JSON
    is_bool_as_number = hint in (int, float) and isinstance(value, bool)
    if hint in _SCALARS and isinstance(value, _SCALARS[hint]) and not is_bool_as_number:
        return float(value) if hint is float else value
    raise WireFormatError(f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


@dataclasses.dataclass(kw_only=True)
class WireMessage:
    """Base of every typed message: `type` is a class constant, fields are wire keys."""

    TYPE: ClassVar[str] = ""

    @property
    def wire_type(self) -> str:
        return self.TYPE

    def wire_body(self) -> JSON:
        """The message's keys besides `type` (and the server's `event_id`)."""
        body: JSON = {}
        for f in wire_fields(type(self)):
            value = getattr(self, f.name)
            if value is None and not f.keep_null:
                continue
            body[f.name] = value
        return body

    @classmethod
    def read_fields(cls, data: Mapping[str, Any]) -> JSON:
        """Typed keyword arguments for `cls` from a wire object (unknown keys ignored)."""
        kwargs: JSON = {}
        for f in wire_fields(cls):
            if f.name not in data:
                if f.required:
                    raise WireFormatError(f"{cls.TYPE}: missing field {f.name!r}", f.name)
                continue
            try:
                kwargs[f.name] = _matches(data[f.name], f.hint)
            except WireFormatError as exc:
                raise WireFormatError(f"{cls.TYPE}: field {f.name!r}: {exc}", f.name) from None
        return kwargs


@dataclasses.dataclass(kw_only=True)
class RealtimeEvent(WireMessage):
    """A server -> client event. Renders `type`, `event_id`, then its fields."""

    event_id: str = dataclasses.field(default_factory=new_event_id)

    def to_dict(self) -> JSON:
        out: JSON = {"type": self.wire_type, "event_id": self.event_id}
        out.update(self.wire_body())
        return out

    def to_json(self) -> bytes:
        return dumps(self.to_dict())

    def payload(self) -> bytes:
        """What crosses Redis for this event (its journal record, its live message): its
        JSON, unless its protocol takes bytes (a moshi session's audio)."""
        return self.to_json()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        kwargs = cls.read_fields(data)
        event_id = data.get("event_id")
        if isinstance(event_id, str):
            kwargs["event_id"] = event_id
        return cls(**kwargs)


def build_registry(*classes: type[WireMessage]) -> dict[str, Any]:
    """type -> class, refusing duplicates so a copy-paste slip fails at import."""
    registry: dict[str, Any] = {}
    for cls in classes:
        if not cls.TYPE:
            raise TypeError(f"{cls.__name__} declares no TYPE")
        if cls.TYPE in registry:
            raise TypeError(f"duplicate wire type {cls.TYPE!r}")
        registry[cls.TYPE] = cls
    return registry
