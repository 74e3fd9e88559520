"""Faults of a step that repeats (a heartbeat, a readahead round, a restart, an item of
a prefetch), logged with their traceback once per run of failures in a row: the next
ones at debug, until the step works again. A step retried every fraction of a second
would otherwise fill the log with one traceback."""
from __future__ import annotations

import logging
from collections.abc import Hashable


class FailureRuns:
    """The steps, by key, whose last try failed; logs to the caller's ``logger``."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self._failing: set[Hashable] = set()

    def failed(self, message: str, *args: object, key: Hashable = None) -> None:
        """Step ``key`` failed (called in its ``except``): ``message`` with the traceback
        if it worked last time, else at debug."""
        if key in self._failing:
            self.log.debug(message, *args, exc_info=True)
        else:
            self._failing.add(key)
            self.log.exception(message, *args)

    def succeeded(self, key: Hashable = None) -> bool:
        """Step ``key`` worked: whether it had failed last time."""
        if key not in self._failing:
            return False
        self._failing.discard(key)
        return True
