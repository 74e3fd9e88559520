"""Items held in memory for one coming read, misses kept for their chunk's load, and
items promised in manifests.

A substitutable job's miss outside the resident chunks, and a hit a peer owns, are
fetched when its batch is planned and kept here until the job's worker reads them once:
they never enter the store, so they cannot push the resident chunks out of it. Such a
miss (and a probe's miss that is not cached) is read from the bucket again when its
chunk loads, within the same epoch on a cold cache; its bytes are also kept here for
that load, which stores them instead.
"""
from __future__ import annotations

import collections
import time

# Bytes of staged items waiting for their read; past it the oldest are dropped (a read
# the kernel served from its page cache never takes its staged copy).
MAX_STAGED = 256 << 20
# Bytes of uncached misses kept for their chunk's load; past it the oldest are dropped
# (their load reads them from the bucket again).
MAX_FOR_LOAD = 64 << 20
# Seconds a hit planned into a manifest is kept from chunk eviction while its read is
# due (a job's workers read a few batches behind its sampler).
PLANNED_GRACE = 30.0
MAX_PLANNED = 100_000  # promised hits remembered before expired ones are swept


class _Bounded:
    """Bytes by hash, at most ``limit`` of them in all: past it the oldest are dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.nbytes = 0

    def add(self, digest: bytes, data: bytes) -> None:
        if digest in self.items:
            return
        self.items[digest] = data
        self.nbytes += len(data)
        while self.nbytes > self.limit and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.nbytes -= len(old)

    def pop(self, digest: bytes) -> bytes | None:
        data = self.items.pop(digest, None)
        if data is not None:
            self.nbytes -= len(data)
        return data


class Staging:
    """Staged bytes by hash, misses kept for their chunk's load (both bounded, oldest
    dropped first), and promised hits."""

    def __init__(self) -> None:
        self._staged = _Bounded(MAX_STAGED)
        self._for_load = _Bounded(MAX_FOR_LOAD)
        # items in manifests not read yet: how many reads are due, and when last promised
        self._planned: dict[bytes, tuple[int, float]] = {}

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._staged.items

    def keep(self, digest: bytes, data: bytes) -> None:
        """Hold ``data`` (verified) for one read of ``digest``."""
        self._staged.add(digest, data)

    def take(self, digest: bytes) -> bytes | None:
        """The staged bytes of ``digest``, given up to this read; one promise is kept."""
        due = self._planned.get(digest)
        if due is not None:
            if due[0] > 1:
                self._planned[digest] = (due[0] - 1, due[1])
            else:
                del self._planned[digest]
        return self._staged.pop(digest)

    def keep_for_load(self, digest: bytes, data: bytes) -> None:
        """Hold ``data`` (verified, and not cached) for the load of its chunk."""
        self._for_load.add(digest, data)

    def kept_for_load(self, digest: bytes) -> bool:
        return digest in self._for_load.items

    def kept_bytes(self, digest: bytes) -> bytes | None:
        """The bytes of ``digest`` kept for its chunk's load, left there for it."""
        return self._for_load.items.get(digest)

    def take_for_load(self, digest: bytes) -> bytes | None:
        """The bytes of ``digest`` kept for its chunk's load, given up to it."""
        return self._for_load.pop(digest)

    def planned(self, hashes: list[bytes]) -> None:
        """These items were promised in a manifest: keep each until read as often as
        it was promised (every job plans the same items), or PLANNED_GRACE. One promise
        per item let the first job's read free it, and a chunk evicted soon after its
        release dropped it before the other jobs' reads (read again from the bucket). A
        read the kernel's page cache serves gives none back: that item stays past its
        chunk's eviction for PLANNED_GRACE, unless the store's LRU takes it first."""
        now = time.monotonic()
        planned = self._planned
        if len(planned) > MAX_PLANNED:
            self._planned = planned = {h: d for h, d in planned.items()
                                       if now - d[1] < PLANNED_GRACE}
        for h in hashes:
            due = planned.get(h)
            planned[h] = (1 if due is None or now - due[1] >= PLANNED_GRACE else due[0] + 1,
                          now)

    def awaiting_read(self, digest: bytes) -> bool:
        """Whether a manifest promised this item and a read of it has not come yet."""
        due = self._planned.get(digest)
        return due is not None and time.monotonic() - due[1] < PLANNED_GRACE
