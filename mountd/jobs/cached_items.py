"""What this node takes to be cached of one dataset, item by item, without asking the
store: the view looks for hits among these items only, and its readahead keeps their
bytes within the dataset's allotment.

Taken to be cached: the loading and loaded chunks' items (less those evicted), and what
the view fetched that its jobs still need. The store's LRU evictions reach it as news
(``evicted``, from ``ContentStore.evictions``), and a look in the store that does not
find an item forgets it too (news past the store's bound between two takes is lost).
Items the view's jobs have all had (*spent*) are the store's first to evict, yet may be
found until then: a job that starts its next pass over their pool looks for them too.
"""
from __future__ import annotations

import time

import numpy as np


class CachedItems:
    """Per item of a dataset: cached, on its way, or spent; and the cached bytes."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes
        self.cached = np.zeros(len(sizes), dtype=bool)
        self.coming = np.zeros(len(sizes), dtype=bool)  # being fetched: not in the store yet
        self.spent = np.zeros(len(sizes), dtype=bool)
        self.bytes = 0  # of the cached items
        self.evicted_at = -float("inf")  # time.monotonic() a look last found one evicted
        self.evicted_bytes = 0  # the cached bytes then

    def _set(self, items: np.ndarray, cached: bool) -> np.ndarray:
        """Set items' cached flag; the items whose flag changed."""
        changed = items[self.cached[items] != cached]
        self.cached[changed] = cached
        self.bytes += (1 if cached else -1) * int(self.sizes[changed].sum())
        return changed

    def hold(self, items: np.ndarray | list[int]) -> np.ndarray:
        """Items about to be fetched into the store; those not taken to be cached before."""
        items = np.unique(np.asarray(items, dtype=np.int64))
        self.coming[items] = True
        self.spent[items] = False
        return self._set(items, True)

    def seen(self, items: list[int], held: list[bool]) -> None:
        """What a look in the store found: items held are cached; items not held and not
        on their way were evicted."""
        items_ = np.asarray(items, dtype=np.int64)
        found = np.asarray(held, dtype=bool)
        self.coming[items_[found]] = False
        self._set(items_[found], True)
        gone = items_[~found & ~self.coming[items_]]
        self.spent[items_] = False
        self._lost(self._set(gone, False))

    def evicted(self, items: np.ndarray) -> None:
        """Items the store evicted: forgotten (the view takes the news just before it
        holds items, so that none is older than a fetch begun)."""
        self._lost(self.forget(items))

    def _lost(self, gone: np.ndarray) -> None:
        """Items taken to be cached found gone: the store evicts items still needed."""
        if len(gone):
            self.evicted_at, self.evicted_bytes = time.monotonic(), self.bytes

    def spend(self, items: list[int]) -> None:
        """Items every job here has had: no longer counted, but may still be found."""
        items_ = np.unique(np.asarray(items, dtype=np.int64))
        self._set(items_, False)
        self.spent[items_] = True

    def forget(self, items: np.ndarray) -> np.ndarray:
        """Items dropped from the store (an evicted chunk's): neither cached nor on their
        way; those taken to be cached before (each once, whatever ``items`` repeats)."""
        items = np.unique(np.asarray(items, dtype=np.int64))
        self.coming[items] = self.spent[items] = False
        return self._set(items, False)

    def findable(self, items: np.ndarray) -> np.ndarray:
        """Which of ``items`` a look in the store may find."""
        return self.cached[items] | self.spent[items]
