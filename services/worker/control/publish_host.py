"""`PublishHost`: what the Redis publisher (`services/worker/publisher.py`) asks of the
sessions it publishes for: a checkpoint now, a model-native session's model history, and
forgetting a session another worker owns now. The manager's moves (`moves.py`) implement
it.

Its own module, low in the control plane, so that the publisher and the moves both import
it and neither the other: the publisher stands on the session table and this, not on the
moves, the builder and the whole session engine under them.
"""

from __future__ import annotations

import abc

from shared.contracts import ModelHistory

#: `drop`'s reason when a publish was refused: another worker holds the session now
FENCED_OUT = "fenced out: another worker owns the session now"
#: `drop`'s reason when the session's hash was gone from Redis (lost in a failover, or
#: with a Redis that restarted empty): nothing of it can be journaled any more
LOST = "lost: its hash is gone from Redis"


class PublishHost(abc.ABC):
    """What the Redis publisher asks of the sessions it publishes for."""

    @abc.abstractmethod
    def snapshot(self, session_id: str) -> bytes | None:
        """The session's checkpoint as it is now (None: not a live session here)."""

    @abc.abstractmethod
    def drop(self, session_id: str, why: str) -> None:
        """Another worker owns the session, or Redis lost it: forget it here without an
        event."""

    @abc.abstractmethod
    def model_history(self, session_id: str) -> ModelHistory | None:
        """A model-native session's model history (None: the session has none here)."""
