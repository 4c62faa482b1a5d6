"""One definition of the ids and clock readings several processes make (shared/ids.py)."""

import re
import time

from shared.ids import EXPIRED_CLOSE_REASON, new_session_id, now_ms


def test_session_ids_are_server_allocated_uuid4_hex_and_never_reused():
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"duplex-[0-9a-f]{32}", sid) for sid in ids)


def test_now_ms_is_wall_clock_milliseconds():
    before = int(time.time() * 1000)
    assert before <= now_ms() <= int(time.time() * 1000)


def test_one_expiry_reason_for_the_janitor_and_the_worker_reaper():
    import services.api.janitor as janitor
    import services.worker.control.manager as manager

    assert janitor.EXPIRED_CLOSE_REASON is manager.EXPIRED_CLOSE_REASON is EXPIRED_CLOSE_REASON
