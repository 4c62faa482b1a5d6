"""`CommandOrder` (one per session record): redeliveries dropped, a restored session's
commands held for their gaps."""

from services.worker.control.command_order import CommandOrder, Released


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def marks(released: list[Released]) -> list[tuple[tuple[int, int], int]]:
    return [(r.mark, r.lost) for r in released]


def test_a_session_opened_here_drops_redeliveries_and_applies_the_rest_at_once():
    order = CommandOrder(clock=Clock())
    assert marks(order.offer((1, 1), "a")) == [((1, 1), 0)]
    assert order.offer((1, 1), "a") == []  # redelivered
    assert marks(order.offer((1, 3), "c")) == [((1, 3), 0)]  # no holding: today's rule
    assert order.offer((1, 2), "b") == []  # older than the last applied
    assert marks(order.offer((2, 1), "d")) == [((2, 1), 0)]
    assert order.deadline() is None


def test_a_restored_session_drops_what_the_checkpoint_applied():
    order = CommandOrder(clock=Clock())
    order.restored((3, 7))
    assert order.offer((3, 6), "old") == []
    assert order.offer((3, 7), "old") == []
    assert order.offer((2, 9), "older attachment") == []
    [released] = order.offer((3, 8), "next")
    assert released == Released((3, 8), "next", 0)


def test_a_command_past_a_gap_is_held_and_released_in_order_when_the_gap_fills():
    clock = Clock()
    order = CommandOrder(clock=clock)
    order.restored((1, 4))
    assert order.offer((1, 7), "g") == []
    assert order.offer((1, 6), "f") == []
    assert order.offer((1, 7), "g") == []  # a second copy of a held one
    assert order.held == 2
    assert order.deadline() == 101.0
    clock.now = 100.5
    released = order.offer((1, 5), "e")  # the forwarded one arrives: all three go
    assert [(r.mark, r.command, r.lost) for r in released] == [
        ((1, 5), "e", 0),
        ((1, 6), "f", 0),
        ((1, 7), "g", 0),
    ]
    assert order.held == 0 and order.deadline() is None
    assert order.last == (1, 7)


def test_a_hold_that_expires_releases_in_order_and_reports_each_gap_once():
    clock = Clock()
    order = CommandOrder(hold_s=1.0, clock=clock)
    order.restored((1, 4))
    order.offer((1, 7), "g")
    clock.now = 100.4
    order.offer((1, 10), "j")
    assert order.expired() == []  # the window is not over yet
    clock.now = 101.0
    released = order.expired()
    assert marks(released) == [((1, 7), 2), ((1, 10), 2)]
    assert order.expired() == [] and order.deadline() is None  # reported once
    # the missing ones coming late are older than what was applied: dropped
    assert order.offer((1, 5), "e") == []
    assert marks(order.offer((1, 11), "k")) == [((1, 11), 0)]


def test_a_newer_attachment_applies_at_once_and_ends_the_old_holds():
    clock = Clock()
    order = CommandOrder(clock=clock)
    order.restored((1, 4))
    order.offer((1, 6), "f")
    released = order.offer((2, 1), "resumed")
    assert marks(released) == [((1, 6), 1), ((2, 1), 0)]
    assert order.held == 0 and order.last == (2, 1)
    # the new attachment is held for its own gaps
    assert order.offer((2, 3), "c") == []
    assert marks(order.offer((2, 2), "b")) == [((2, 2), 0), ((2, 3), 0)]


def test_a_restored_session_without_commands_starts_at_the_first_seq():
    order = CommandOrder(clock=Clock())
    order.restored((0, 0))
    assert order.offer((1, 2), "second") == []  # seq 1 is still on its way
    assert marks(order.offer((1, 1), "first")) == [((1, 1), 0), ((1, 2), 0)]


def test_release_applies_every_held_command_now_with_its_gap():
    order = CommandOrder(clock=Clock())
    order.restored((1, 1))
    order.offer((1, 3), "c")
    assert marks(order.release()) == [((1, 3), 1)]
    assert order.held == 0 and order.last == (1, 3)
