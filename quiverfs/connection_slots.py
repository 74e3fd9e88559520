"""Open connections counted by who holds them, so that no one source can take them all."""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Hashable, Iterator


class ConnectionSlots:
    """At most ``per_key`` connections for one key (a uid, a source address) and
    ``total`` for all keys together."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self._held: collections.Counter[Hashable] = collections.Counter()

    @contextlib.contextmanager
    def hold(self, key: Hashable, capped: bool = True) -> Iterator[bool]:
        """Take a slot for the ``with`` block; yields False (and takes none) when the
        caps are reached. ``capped=False`` lifts the per-key cap (root's uid)."""
        if sum(self._held.values()) >= self.total or (
                capped and self._held[key] >= self.per_key):
            yield False
            return
        self._held[key] += 1
        try:
            yield True
        finally:
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
