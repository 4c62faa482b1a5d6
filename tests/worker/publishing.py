"""A publisher on a session table of its own, for tests that publish without a manager."""

from collections.abc import Callable

from services.worker.control.publish_host import PublishHost
from services.worker.control.table import SessionRecord, SessionTable
from services.worker.publisher import RedisEventPublisher
from shared.contracts import ModelHistory


class Host(PublishHost):
    """Checkpoints from `snapshot` (None: none); the sessions dropped, in order."""

    def __init__(self, snapshot: Callable[[str], bytes | None] | None = None) -> None:
        self._snapshot = snapshot
        self.dropped: list[str] = []
        #: model-native sessions' model histories, by session
        self.histories: dict[str, ModelHistory] = {}

    def snapshot(self, session_id: str) -> bytes | None:
        return self._snapshot(session_id) if self._snapshot is not None else None

    def drop(self, session_id: str, why: str) -> None:
        self.dropped.append(session_id)

    def model_history(self, session_id: str) -> ModelHistory | None:
        return self.histories.get(session_id)


def publisher_on(store, host: PublishHost | None = None) -> RedisEventPublisher:
    publisher = RedisEventPublisher(
        store, SessionTable(16), max_bytes=1 << 20, ttl_s=60, closed_ttl_s=60
    )
    if host is not None:
        publisher.serve(host)
    return publisher


def own(
    publisher: RedisEventPublisher, session_id: str, generation: int, *, openai: bool = False
) -> SessionRecord:
    """The session held here at `generation`, as a restore leaves it (no runner)."""
    record = publisher.table.reserve(session_id)
    record.serve(None, history=None, owner_generation=generation, unstamped=openai, restored=True)
    return record
