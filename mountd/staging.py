"""Items held in memory for one coming read, and hits promised in manifests.

A substitutable job's miss outside the resident chunks, and a hit a peer owns, are
fetched when its batch is planned and kept here until the job's worker reads them once:
they never enter the store, so they cannot push the resident chunks out of it.
"""
from __future__ import annotations

import collections
import time

# Bytes of staged items waiting for their read; past it the oldest are dropped (a read
# the kernel served from its page cache never takes its staged copy).
MAX_STAGED = 256 << 20
# Seconds a hit planned into a manifest is kept from chunk eviction while its read is
# due (a job's workers read a few batches behind its sampler).
PLANNED_GRACE = 30.0
MAX_PLANNED = 100_000  # promised hits remembered before expired ones are swept


class Staging:
    """Staged bytes by hash (bounded, oldest dropped first), and promised hits."""

    def __init__(self) -> None:
        self._staged: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._staged_bytes = 0
        self._planned: dict[bytes, float] = {}  # hits in manifests, not read yet: when

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._staged

    def keep(self, digest: bytes, data: bytes) -> None:
        """Hold ``data`` (verified) for one read of ``digest``."""
        if digest in self._staged:
            return
        self._staged[digest] = data
        self._staged_bytes += len(data)
        while self._staged_bytes > MAX_STAGED and len(self._staged) > 1:
            _, old = self._staged.popitem(last=False)
            self._staged_bytes -= len(old)

    def take(self, digest: bytes) -> bytes | None:
        """The staged bytes of ``digest``, given up to this read; the promise is kept."""
        self._planned.pop(digest, None)
        data = self._staged.pop(digest, None)
        if data is not None:
            self._staged_bytes -= len(data)
        return data

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
