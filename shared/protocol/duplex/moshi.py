"""Moshi's protocol where two processes meet: the worker's projection of a "moshi" session
(services/worker/engine/native_surfaces.py) and the API pod's socket
(services/api/moshi_chat.py).

The model's audio crosses Redis as its bytes: a record of type `MOSHI_AUDIO` whose data is
the frame's pcm16 (mono, little-endian, at the model's output rate), not JSON. The pod
encodes it as Ogg Opus as it comes, parsing nothing: no base64 on the worker, no JSON
parse and base64 decode on the pod, a third fewer bytes in Redis. The journal holds the
same bytes (`duplex sessions tail` prints such a record as its size).
"""

from __future__ import annotations

#: the live header's and the journal's type of a moshi session's audio record
MOSHI_AUDIO = "moshi.audio"

__all__ = ["MOSHI_AUDIO"]
