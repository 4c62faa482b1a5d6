"""The one base class of every error of ours that carries a contract error code.

A leaf module (it imports nothing) so that every package can subclass it: the Tier 1
codec (`shared.protocol.realtime`, otherwise self-contained), the Redis layer and the
admin CLI (which must not load the wire codec and its numpy), the client and the
services. The code table itself is Tier 3 (`shared.protocol.duplex.errors`) and
registers its lookup here when it is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar


class CodedError(Exception):
    """The one base of every error of ours that carries a contract error code.

    `error_type` (OpenAI's class) and `retryable` come from the code table
    (`shared.protocol.duplex.errors`), which registers its lookup here when it is imported
    (`register_code_table`): every process that renders an error to a client has loaded
    it. In a process that has not (the admin CLI), every code reads as a non-retryable
    `invalid_request_error`.
    """

    _lookup: ClassVar[Callable[[str], tuple[str, bool | None]]] = staticmethod(
        lambda code: ("invalid_request_error", None)
    )

    def __init__(
        self,
        code: str,
        message: str = "",
        *,
        param: str | None = None,
        related_event_id: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message or code
        self.param = param
        self.related_event_id = related_event_id
        self.extra = dict(extra or {})

    @property
    def error_type(self) -> str:
        return CodedError._lookup(self.code)[0]

    @property
    def retryable(self) -> bool | None:
        return CodedError._lookup(self.code)[1]


def register_code_table(lookup: Callable[[str], tuple[str, bool | None]]) -> None:
    """Called once by the code table's module: every CodedError classifies through it."""
    CodedError._lookup = staticmethod(lookup)
