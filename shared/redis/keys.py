"""Every Redis key duplex-serve uses, built here and nowhere else.

Each key of one session carries the session id as the Redis Cluster hash tag
(`{SID}`), so a session's scripts touch one slot. Documented for operators in
docs/redis-keys.md.
"""

from __future__ import annotations

import dataclasses

DEFAULT_PREFIX = "duplex"
#: consumer group of every worker inbox
INBOX_GROUP = "runners"


@dataclasses.dataclass(frozen=True)
class KeySchema:
    prefix: str = DEFAULT_PREFIX

    # -- one session (hash tag = session id)
    def session(self, session_id: str) -> str:
        """hash: state, worker, generations, token digest, journal counters, session object."""
        return f"{self.prefix}:session:{{{session_id}}}"

    def events(self, session_id: str) -> str:
        """stream: the event journal, one entry per publisher round: id <first seq>-1, fields
        last + data (the round's framed records, shared/redis/live_message.py)."""
        return f"{self.prefix}:session:{{{session_id}}}:events"

    def checkpoint(self, session_id: str) -> str:
        """string: the session's checkpoint JSON, written by its owning worker (restore)."""
        return f"{self.prefix}:session:{{{session_id}}}:checkpoint"

    def model_history(self, session_id: str) -> str:
        """string: a model-native session's model history (its frames' records, appended
        by its owning worker; `STRLEN` / the model's record bytes = frames)."""
        return f"{self.prefix}:session:{{{session_id}}}:model"

    def live(self, session_id: str) -> str:
        """channel: live delivery of the session's events and takeover notices."""
        return f"{self.prefix}:session:{{{session_id}}}:live"

    # -- workers
    def inbox(self, worker_id: str, stripe: int = 0) -> str:
        """stream: commands for the sessions pinned to the worker (group `runners`); on a
        Redis Cluster one stripe per master, each session's on its own keys' master
        (shared/redis/inbox_stripes.py); stripe 0 is the worker's own tag, the only one
        on a single Redis."""
        return f"{self.prefix}:worker:{{{_stripe_tag(worker_id, stripe)}}}:inbox"

    def inbox_bytes(self, worker_id: str, stripe: int = 0) -> str:
        """string: bytes of the inbox (stripe's) entries the worker has not handled yet
        (its budget)."""
        return f"{self.prefix}:worker:{{{_stripe_tag(worker_id, stripe)}}}:inbox_bytes"

    def worker(self, worker_id: str) -> str:
        """hash: model, max_sessions, active sessions, capabilities JSON, version, started_at."""
        return f"{self.prefix}:worker:{{{worker_id}}}"

    def inbox_stripes(self, worker_id: str) -> str:
        """string: the worker's inbox stripes on a Redis Cluster (JSON, stripe -> slot
        ranges), chosen once for its id and kept when it leaves (a week past its last beat)."""
        return f"{self.prefix}:worker:{{{worker_id}}}:stripes"

    def worker_sessions(self, worker_id: str) -> str:
        """set: sessions the worker holds (for the dead-worker sweep)."""
        return f"{self.prefix}:worker:{{{worker_id}}}:sessions"

    def workers(self) -> str:
        """zset: worker id -> last heartbeat (ms)."""
        return f"{self.prefix}:workers"

    # -- API pods
    def api(self, pod_id: str) -> str:
        """hash: an API pod's address and start time."""
        return f"{self.prefix}:api:{{{pod_id}}}"

    def apis(self) -> str:
        """zset: API pod id -> last heartbeat (ms)."""
        return f"{self.prefix}:apis"

    def api_sessions(self, pod_id: str) -> str:
        """set: sessions attached through this API pod (for the dead-pod sweep)."""
        return f"{self.prefix}:api:{{{pod_id}}}:sessions"

    # -- leases and replies
    def leases(self) -> str:
        """zset: session id -> next lease deadline (ms): disconnect grace."""
        return f"{self.prefix}:leases"

    def arq_queue(self) -> str:
        """arq's queue of the janitor jobs (arq adds its own keys beside it)."""
        return f"{self.prefix}:janitor"

    def reply(self, request_id: str) -> str:
        """list: the one reply to a request an API pod made of a worker (chat)."""
        return f"{self.prefix}:reply:{{{request_id}}}"


def _stripe_tag(worker_id: str, stripe: int) -> str:
    """The hash tag of a worker's inbox stripe: the worker's id for stripe 0, else
    `<id>:s<k>` (a tag chosen because it hashes to a slot of another master)."""
    return worker_id if stripe == 0 else f"{worker_id}:s{stripe}"
