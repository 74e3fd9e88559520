"""The store's recency: hits, and entries marked spent, written in one transaction.

Eviction is least-recently-used. With diskcache's LRU policy every hit is a SQLite
write transaction, which caps hits at about a thousand a second; so hits are read
through a handle whose policy (in memory only) takes diskcache's lock-free read path,
and their recency is written in one transaction per ``record`` call (mountd calls it
every second). Entries no reader here needs again are marked spent, and are then the
first to evict until someone wants them again.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from mountd.store.index import Index, StoreIndex

MAX_SPENT_MARKS = 1_000_000  # spent marks remembered (beyond, all are left to plain LRU)


class Recency:
    """Hits and spent marks since the last ``record``, for one store's index."""

    def __init__(self, index: StoreIndex) -> None:
        self._index = index
        self._lock = threading.Lock()
        self._hits: set[bytes] = set()
        self._spent: set[bytes] = set()  # marked spent since the last record
        # Entries marked spent and not stored again since: their reads after the mark
        # leave them the first to evict.
        self._spent_marked: set[bytes] = set()
        self._unspent: set[bytes] = set()  # marked entries wanted since the last record

    def hit(self, digest: bytes) -> None:
        with self._lock:
            self._hits.add(digest)

    def record(self) -> int:
        """Write the recency of the hits since the last call, and make the entries
        marked ``spent`` the first to evict, in one transaction; how many hits (none
        while the store cannot write: those are forgotten)."""
        with self._lock:
            hits, self._hits = self._hits | self._unspent, set()
            spent, self._spent, self._unspent = self._spent, set(), set()
            if len(self._spent_marked) + len(spent) > MAX_SPENT_MARKS:
                self._spent_marked.clear()  # marks forgotten: left to plain LRU
            self._spent_marked |= spent
            spent |= hits & self._spent_marked
        if not hits and not spent:
            return 0
        return self._index.write(_touch, (hits - spent, spent), "record hits") or 0

    def spent(self, digests: Iterable[bytes]) -> None:
        """Mark entries no reader here is known to need again as the least recently
        used (from the next ``record``, until ``wanted``): the store evicts them first."""
        with self._lock:
            self._spent.update(digests)

    def pending(self) -> bool:
        """Whether entries were marked spent, or wanted again after their mark was
        written, since the last ``record``."""
        return bool(self._spent or self._unspent)

    def stored(self, digest: bytes) -> None:
        """A put of a spent entry (a fetch begun before the mark) leaves it spent."""
        with self._lock:
            if digest in self._spent_marked:
                self._spent.add(digest)

    def wanted(self, digests: Iterable[bytes]) -> None:
        """Undo ``spent`` marks: a reader here needs these entries again. Those whose
        mark was written get the current access time at the next ``record``, as a hit
        would (else the store would still evict them first)."""
        with self._lock:
            for digest in digests:
                self._spent.discard(digest)
                if digest in self._spent_marked:
                    self._spent_marked.discard(digest)
                    self._unspent.add(digest)


def _touch(index: Index, marks: tuple[set[bytes], set[bytes]]) -> int:
    """Write what diskcache's LRU ``get`` writes (``access_time``), without its read of
    each value: one statement for all the hits; spent entries get the oldest access time
    there is. Keys are bytes, so stored raw.

    diskcache has no public way to set an entry's access time (``touch`` sets its
    expiry; ``get`` reads the value and writes one row per call), so this runs SQL on
    the handle's own connection (``Cache._con``) inside its transaction.
    tests/test_content_store.py checks that diskcache still has that connection and
    those columns."""
    hits, spent = marks
    now = time.time()
    with index.cache.transact():
        index.cache._con.executemany(
            "UPDATE Cache SET access_time = ? WHERE key = ? AND raw = 1",
            [(now, digest) for digest in hits] + [(0.0, digest) for digest in spent])
    return len(hits)
