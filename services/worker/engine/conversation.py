"""The session's conversation history: ordered items, by id.

Function calls are items too: a `function_call` item (the model's, or one a client
created) makes its `call_id` known, a `function_call_output` item answers it. Which calls
are pending is read from the items themselves, so it travels wherever the items do (a
checkpoint, a move) and a deleted call item is simply no longer known."""

from __future__ import annotations

from typing import Any

from shared.contracts import DuplexSessionError


class Conversation:
    def __init__(self) -> None:
        self._items: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def items(self) -> list[dict[str, Any]]:
        return list(self._items)

    def last_id(self) -> str | None:
        return self._items[-1]["id"] if self._items else None

    def index_of(self, item_id: str) -> int:
        for index, item in enumerate(self._items):
            if item.get("id") == item_id:
                return index
        raise DuplexSessionError("item_not_found", f"no conversation item {item_id!r}")

    def get(self, item_id: str) -> dict[str, Any]:
        return self._items[self.index_of(item_id)]

    def add(self, item: dict[str, Any], previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (at the end when None); returns the id it follows."""
        if previous_item_id is None:
            previous = self.last_id()
            self._items.append(item)
            return previous
        index = self.index_of(previous_item_id)
        self._items.insert(index + 1, item)
        return previous_item_id

    def previous_of(self, item_id: str) -> str | None:
        index = self.index_of(item_id)
        return self._items[index - 1]["id"] if index else None

    def delete(self, item_id: str) -> dict[str, Any]:
        return self._items.pop(self.index_of(item_id))

    def discard(self, item_id: str) -> None:
        """Remove an item if present (a failed response leaves nothing in history)."""
        self._items = [item for item in self._items if item.get("id") != item_id]

    def function_call(self, call_id: str) -> dict[str, Any] | None:
        """The `function_call` item of `call_id`, if history holds one."""
        return self._find("function_call", call_id)

    def function_output(self, call_id: str) -> dict[str, Any] | None:
        """The `function_call_output` item answering `call_id`, if history holds one."""
        return self._find("function_call_output", call_id)

    def pending_call_ids(self) -> list[str]:
        """Call ids of function calls in history that no output answers yet, in order."""
        outputs = [item for item in self._items if item.get("type") == "function_call_output"]
        answered = {item.get("call_id") for item in outputs}
        return [
            item["call_id"]
            for item in self._items
            if item.get("type") == "function_call" and item.get("call_id") not in answered
        ]

    def _find(self, item_type: str, call_id: str) -> dict[str, Any] | None:
        return next(
            (
                item
                for item in self._items
                if item.get("type") == item_type and item.get("call_id") == call_id
            ),
            None,
        )
