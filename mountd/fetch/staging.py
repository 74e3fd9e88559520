"""Items held in memory for one coming read, misses kept for their chunk's load, and
hits promised in manifests.

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
        self._planned: dict[bytes, float] = {}  # hits in manifests, not read yet: when

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._staged.items

    def keep(self, digest: bytes, data: bytes) -> None:
        """Hold ``data`` (verified) for one read of ``digest``."""
        self._staged.add(digest, data)

    def take(self, digest: bytes) -> bytes | None:
        """The staged bytes of ``digest``, given up to this read; the promise is kept."""
        self._planned.pop(digest, None)
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
        """These hits were promised in a manifest: keep them until read (or a while)."""
        now = time.monotonic()
        if len(self._planned) > MAX_PLANNED:
            self._planned = {h: t for h, t in self._planned.items()
                             if now - t < PLANNED_GRACE}
        self._planned.update(dict.fromkeys(hashes, now))

    def awaiting_read(self, digest: bytes) -> bool:
        """Whether a manifest promised this hit and its read has not come yet."""
        t = self._planned.get(digest)
        return t is not None and time.monotonic() - t < PLANNED_GRACE
