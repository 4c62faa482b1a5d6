"""The states of an `Attachment` (services/api/attachment.py) and the transitions between
them. A transition the table below does not list is a bug and raises `AttachmentStateError`.

    NEW ──open──▶ PLACING ──open written──▶ OPENING ──session.created──▶ OPENED
                     ▲                         │                           │ on the wire
                     └── resource_exhausted ───┘                           ▼
    NEW ──resume──▶ RESUMING ──lease CAS won────────────────────────────▶ ATTACHED
    OPENED, ATTACHED ──takeover──▶ REPLACED     OPENED, ATTACHED ──closure queued──▶ ENDED
    OPENED, ATTACHED, OPENING ──socket gone──▶ DETACHING ──▶ RELEASED
    anything else ──refused, failed or socket gone──▶ RELEASED (nothing left to undo)
"""

from __future__ import annotations

import enum


class AttachmentState(enum.Enum):
    NEW = "new"  # no session yet
    PLACING = "placing"  # a session id is subscribed to; choosing the next worker
    OPENING = "opening"  # the open is in one worker's inbox; waiting for its first reply
    RESUMING = "resuming"  # subscribed; the lease CAS (lease_resume.lua) is under way
    OPENED = "opened"  # the worker admitted it; session.created is queued, not yet sent
    ATTACHED = "attached"  # the client holds the session (created sent, or resumed)
    REPLACED = "replaced"  # a newer attachment took the session over
    ENDED = "ended"  # the session's closure (session.closed / expired) is queued
    DETACHING = "detaching"  # the socket is gone: detaching the lease, or closing
    RELEASED = "released"  # nothing held: terminal


S = AttachmentState
TRANSITIONS: dict[AttachmentState, frozenset[AttachmentState]] = {
    S.NEW: frozenset({S.PLACING, S.RESUMING, S.RELEASED}),
    S.PLACING: frozenset({S.OPENING, S.RELEASED}),
    S.OPENING: frozenset({S.PLACING, S.OPENED, S.DETACHING, S.RELEASED}),
    S.RESUMING: frozenset({S.ATTACHED, S.RELEASED}),
    S.OPENED: frozenset({S.ATTACHED, S.REPLACED, S.ENDED, S.DETACHING}),
    S.ATTACHED: frozenset({S.REPLACED, S.ENDED, S.DETACHING}),
    # a takeover can land after the closure was queued: neither is released
    S.ENDED: frozenset({S.REPLACED, S.RELEASED}),
    S.REPLACED: frozenset({S.RELEASED}),
    S.DETACHING: frozenset({S.RELEASED}),
    S.RELEASED: frozenset(),
}
#: the states in which the client's commands go to the worker
LIVE = frozenset({S.OPENED, S.ATTACHED})
#: past these, a later closure or session.created on the wire changes nothing
SETTLED = frozenset({S.ENDED, S.REPLACED, S.DETACHING, S.RELEASED})


class AttachmentStateError(RuntimeError):
    """A transition the table does not allow: a bug in the caller, never the client's."""
