"""The session's conversation history: ordered items, by id."""

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
