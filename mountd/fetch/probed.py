"""A probed job's reads: the items of its batches whose next read must miss.

A probe measures what a miss costs the job (mountd.jobs.probing), so the planner marks
its batch's items here, and the read of each then fetches it (for the cause marked)
instead of serving what is cached; the kernel's pages of them are dropped first, and
no push puts them back (``pending``)."""
from __future__ import annotations

from collections.abc import Callable

import pyfuse3
import trio

from mountd.datasets.dataset import MountedDataset
from mountd.fetch.page_push import PagePush
from quiverfs.counters import FetchCause


class ProbedReads:
    """The items whose next read is a probed job's miss: how each is fetched."""

    def __init__(self) -> None:
        # digest -> the cause its read fetches it for, and whether what it fetches is
        # kept (for PROBE: that it must be fetched even if cached)
        self._marked: dict[bytes, tuple[FetchCause, bool]] = {}
        # Dropping an inode's pages can wait in the kernel for a read of that inode,
        # whose handler needs a worker of mountd's limiter: so it never holds one.
        self._invalidations = trio.CapacityLimiter(1)
        # the native data plane's: a marked item's READs must reach the Python handlers
        self.withdraw: Callable[[bytes], None] | None = None

    async def mark(self, ds: MountedDataset, forced: list[int], uncached: list[int],
                   keep: list[bool], push: PagePush) -> None:
        """Make the next read of each item of a probed job's batch a miss, and drop the
        kernel's pages of them. ``uncached`` items were not cached when planned: a read
        that still misses fetches them as a cooperative miss (other jobs hit them next).
        ``forced`` ones, and those not kept, are read from storage even if cached.
        ``keep`` (per item, ``forced`` first) says whether what is fetched is cached."""
        must = set(forced)
        for i, k in zip(forced + uncached, keep):
            # a miss that is not kept is read again when its chunk loads: the probe's cost
            cause = FetchCause.PROBE if i in must or not k else FetchCause.COOP_MISS
            self._marked[ds.digest.hash(i)] = (cause, k)
            if self.withdraw is not None:
                self.withdraw(ds.digest.hash(i))
        inodes = [ds.entry_inode(i) for i in forced + uncached]
        push.forget(inodes)
        await trio.to_thread.run_sync(invalidate_inodes, inodes, limiter=self._invalidations)

    def pending(self, digest: bytes) -> bool:
        """Whether a probed job's read of ``digest`` is to come: the chunk loader leaves
        it to that read, whose miss is then a real one (and the only fetch of it)."""
        return digest in self._marked

    def take(self, digest: bytes) -> tuple[FetchCause, bool] | None:
        """How the read of ``digest`` now under way is to fetch it, if it was marked."""
        return self._marked.pop(digest, None)


def invalidate_inodes(inodes: list[int]) -> None:
    """Drop the kernel's pages and attributes of ``inodes`` (may wait in the kernel for a
    read of one of them: never in a worker such a read needs)."""
    for inode in inodes:
        try:
            pyfuse3.invalidate_inode(inode, attr_only=False)
        except OSError:
            pass  # the kernel holds nothing of it
