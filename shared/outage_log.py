"""`OutageLog`: a run of failures of one thing, logged once rather than once per try.

When Redis fails over, every loop that writes to it fails for the seconds the promotion
takes, and retries every 0.1-2 s: a heartbeat, a publisher, a janitor. Logged per try, that
is hundreds of WARNING lines with tracebacks for one event, and the line that says what
happened is lost among them. Here the first failure of a run is logged as a WARNING with
its error, the next ones are counted, and the first success after them logs one line: how
long it failed and how many tries. A connection refused or timed out is Redis being away,
said in its message; anything else is logged with its traceback, once a run.
"""

from __future__ import annotations

import logging
import time

from redis import exceptions as redis_errors

#: errors that only say Redis is away (their traceback tells nothing more)
UNREACHABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    ConnectionError,
    TimeoutError,
)


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log = logger
        self.what = what
        self._since: float | None = None  # monotonic: when the run of failures began
        self._failures = 0
        self._kinds: set[object] = set()  # the kinds of error said in this run
        self.outages = 0  # runs of failures so far, for tests and diagnostics

    @property
    def failing(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException, *, traceback: bool | None = None) -> None:
        """One try failed: logged if it starts a run, counted otherwise. `traceback`: None
        logs it unless the error only says Redis is unreachable."""
        if traceback is None:
            traceback = not isinstance(exc, UNREACHABLE)
        self._failures += 1
        # Redis being away is one kind whatever its words (refused, reset, no master yet)
        kind: object = UNREACHABLE if isinstance(exc, UNREACHABLE) else type(exc)
        if self._since is not None:
            if kind not in self._kinds:
                # the run goes on, failing another way (Redis back, a script now refusing):
                # said once too
                self._kinds.add(kind)
                self.log.warning(
                    "%s now fails with: %s",
                    self.what,
                    str(exc) or type(exc).__name__,
                    exc_info=exc if traceback else None,
                )
            return
        self._since = time.monotonic()
        self._kinds = {kind}
        self.outages += 1
        self.log.warning(
            "%s failed: %s (retrying; logged once until it works again)",
            self.what,
            str(exc) or type(exc).__name__,
            exc_info=exc if traceback else None,
        )

    def succeeded(self, at: float | None = None) -> None:
        """One try worked (at `at`, monotonic, when that was earlier than now): the end of
        a run of failures, if there was one, is logged."""
        if self._since is None:
            return
        lasted = (time.monotonic() if at is None else at) - self._since
        tries = f"{self._failures} {'try' if self._failures == 1 else 'tries'} failed"
        self.log.warning("%s works again after %.1f s (%s)", self.what, lasted, tries)
        self._since, self._failures = None, 0
