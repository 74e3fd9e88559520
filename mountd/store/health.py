"""Whether the store can write: the last failure, since when, and when to try again.

A store that cannot write (a full disk) keeps serving what it holds, stores nothing,
and tries writing again after WRITE_RETRY_INTERVAL; only a write that works clears a
failure. The caller holds the store's write lock around every change here."""
from __future__ import annotations

import dataclasses
import logging
import time

log = logging.getLogger(__name__)

WRITE_RETRY_INTERVAL = 5.0  # seconds between tries of a store that could not write or open


@dataclasses.dataclass
class StoreHealth:
    """Whether the store can write, and since when it cannot (for status and metrics)."""

    writable: bool
    write_error: str | None  # why the last write failed
    write_error_since: float | None  # Unix time of the first failure in a row
    write_failures: int  # items not stored because the store could not write


class WriteHealth:
    """The store's write failures, and the back-off after each."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.failures = 0  # items not stored because the store could not write
        self.error: str | None = None
        self.error_since: float | None = None
        self.retry_at = 0.0  # time.monotonic() of the next try after a failure

    def failed(self, reason: str, doing: str, by: str = "") -> None:
        """A write (``doing``: "write", or what else was tried) failed for ``reason``:
        wait WRITE_RETRY_INTERVAL before the next try. ``by`` names who failed, if not
        this process."""
        self.retry_later()
        if self.error is None:
            log.warning("store %s: %scannot %s (%s): reads are served uncached; trying "
                        "again every %.0f s", self.directory, by, doing, reason,
                        WRITE_RETRY_INTERVAL)
        self.note(reason if doing == "write" else f"cannot {doing}: {reason}")

    def note(self, message: str) -> None:
        """The store cannot write, for ``message``'s reason (no back-off of its own)."""
        if self.error is None:
            self.error_since = time.time()
        self.error = message

    def recovered(self) -> None:
        """A write worked: the failure is over."""
        if self.error is None:
            return
        log.info("store %s can write again (after %.0f s; %d items not stored so far)",
                 self.directory, time.time() - (self.error_since or time.time()),
                 self.failures)
        self.error = self.error_since = None

    def waiting(self) -> bool:
        """Whether a failure waits for its retry (a write now would be refused)."""
        return self.error is not None and time.monotonic() < self.retry_at

    def retry_later(self) -> None:
        """Wait WRITE_RETRY_INTERVAL before the next try."""
        self.retry_at = time.monotonic() + WRITE_RETRY_INTERVAL

    def retry_due(self) -> bool:
        return time.monotonic() >= self.retry_at

    def report(self) -> StoreHealth:
        """Whether the last write worked (only a put that works clears a failure)."""
        return StoreHealth(self.error is None, self.error, self.error_since, self.failures)
