"""The coordinator's clock for silences: seconds it has run, not seconds gone by.

A node is dead after ``--heartbeat-timeout`` seconds without a heartbeat, and forgotten
after ``--forget-after``. Those silences only mean something while the coordinator
could hear the node: while it is stopped (SIGSTOP, a frozen VM), down, or its loop
stalls, no heartbeat can arrive, and counting that time would declare every node dead
at once. No system clock leaves that time out (CLOCK_MONOTONIC goes on while a process
is stopped; a process's CPU time stops while it merely waits), so the coordinator reads
this clock at least every ``max_gap / 4`` seconds (its own timer, or the heartbeats of
the lone node in mountd), and a gap between two readings longer than ``max_gap`` is
time it did not run: it is left out.
"""
from __future__ import annotations

import time

MAX_GAP = 1.0  # seconds between two readings beyond which the coordinator did not run


class RunClock:
    """Seconds run since the start (``time.monotonic()`` less the gaps between
    readings longer than ``max_gap``)."""

    def __init__(self, max_gap: float = MAX_GAP) -> None:
        self.max_gap = max_gap
        self.seconds = 0.0  # counted
        self.left_out = 0.0  # seconds in gaps longer than max_gap
        self._read_at = time.monotonic()

    def read(self) -> tuple[float, float]:
        """The seconds run, and the gap since the last reading if it was left out
        (else 0)."""
        now = time.monotonic()
        gap, self._read_at = now - self._read_at, now
        if gap > self.max_gap:
            self.left_out += gap
            return self.seconds, gap
        self.seconds += gap
        return self.seconds, 0.0
