"""Planned reads pushed into the kernel's page cache, so they never reach mountd.

When the batch planner places a job's batch, it knows which files the job's workers
open next. For each of its cached items the pusher takes the verified bytes from the
store and hands them to the kernel with FUSE's notify_store, under the item's inode:
the workers' reads then find the pages, and mountd sees only their OPEN and RELEASE.

Why this never leaves wrong bytes under an inode: inode numbers are never reused while
mountd runs (each registration gets a fresh range), an inode's content never changes,
and the store returns an item only after its CRC32C (and, once per run, its SHA-256)
matched. A push of an inode the kernel does not hold fails with ENOENT and is skipped.

Memory: the pages pushed and not yet opened are bounded by ``budget`` bytes; an OPEN of
a pushed inode returns its share, and a push not opened within UNREAD_EXPIRY seconds
(the job died, or read another way) stops counting. Planned items beyond the budget
wait in a queue of at most MAX_QUEUED, and the oldest are dropped beyond that: their
reads simply reach mountd. Pages in the page cache are the kernel's to reclaim.
"""
from __future__ import annotations

import collections
import errno
import logging
import time
from collections.abc import Callable

import pyfuse3
import trio

from mountd.content_store import ContentStore, StoreError
from mountd.dataset import MountedDataset
from mountd.read_stats import ReadStats
from mountd.staging import Staging

log = logging.getLogger(__name__)

UNREAD_EXPIRY = 60.0  # seconds a pushed item counts against the budget unopened
MAX_QUEUED = 65_536  # planned items waiting for the budget, at most
PUSH_THREADS = 2  # workers pushing at once (each copies into the kernel's pages)
PUSH_BATCH = 32  # items read and pushed per worker call


class PagePush:
    """Pushes planned cached items into the page cache, within ``budget`` bytes."""

    def __init__(self, store: ContentStore, limiter: trio.CapacityLimiter, stats: ReadStats,
                 staging: Staging, budget: int,
                 skip: Callable[[MountedDataset, bytes], bool]) -> None:
        self.store = store
        self.limiter = limiter  # the store's readers (a read of a file not in memory)
        self.stats = stats
        self.staging = staging
        self.budget = budget
        self.skip = skip  # items left to their reads (a probe's, a peer's, a suspended one)
        self._queue: collections.deque[tuple[MountedDataset, int]] = collections.deque(
            maxlen=MAX_QUEUED)
        self._pushed: dict[int, tuple[MountedDataset, int, float]] = {}  # inode -> ds, bytes, when
        self.held = 0  # bytes pushed and not yet opened
        self._changed = trio.Event()
        # notify_store waits for a page another request holds locked: never with a
        # worker the read path needs
        self._push_limiter = trio.CapacityLimiter(PUSH_THREADS)

    def enqueue(self, ds: MountedDataset, indices: list[int]) -> None:
        """Push these entries of ``ds`` (those in the store) ahead of their reads."""
        if self.budget <= 0 or not indices:
            return
        self._queue.extend((ds, i) for i in indices)
        self._changed.set()

    def opened(self, inode: int) -> bool:
        """An OPEN of ``inode``: whether its item was pushed. Its pages then serve the
        reads, which count as local hits here; the push no longer counts."""
        pushed = self._pushed.pop(inode, None)
        if pushed is None:
            return False
        ds, n, _ = pushed
        self.held -= n
        # the pages hold the hit a manifest promised: its chunk need not wait for a READ
        self.staging.take(ds.digest.hash(ds.tree.entry_index(inode - ds.inode_base)))
        self.stats.count(ds, "pushed_opens")
        self.stats.count(ds, "local_hits")
        self.stats.count(ds, "local_bytes", n)
        self._changed.set()
        return True

    def forget(self, inodes: list[int]) -> None:
        """These inodes' pages are being dropped: their pushes no longer count."""
        for inode in inodes:
            pushed = self._pushed.pop(inode, None)
            if pushed is not None:
                self.held -= pushed[1]

    def _expire(self, now: float) -> None:
        for inode, (ds, n, when) in list(self._pushed.items()):
            if now - when < UNREAD_EXPIRY:
                break  # pushed in order: the rest are younger
            del self._pushed[inode]
            self.held -= n
            self.stats.count(ds, "pushed_unopened")

    async def _wait(self) -> None:
        self._changed = trio.Event()
        with trio.move_on_after(1.0):  # expiry frees budget without any event
            await self._changed.wait()

    def _take(self) -> list[tuple[MountedDataset, int, int]]:
        """Up to PUSH_BATCH queued entries (ds, index, inode) that fit the budget."""
        batch: list[tuple[MountedDataset, int, int]] = []
        room = self.budget - self.held
        while self._queue and len(batch) < PUSH_BATCH:
            ds, index = self._queue.popleft()
            size = ds.digest.sizes[index]
            inode = ds.entry_inode(index)
            if inode in self._pushed or size > self.budget:
                continue  # pushed already, or never fits
            if size > room:
                self._queue.appendleft((ds, index))
                break
            room -= size
            batch.append((ds, index, inode))
        return batch

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._expire(time.monotonic())
            batch = self._take()
            if not batch:
                await self._wait()
                continue
            try:
                await self._push(batch)
            except Exception:  # a push is an optimisation: its failure costs READs
                log.exception("pushing %d planned items failed", len(batch))

    async def _push(self, batch: list[tuple[MountedDataset, int, int]]) -> None:
        """Read the batch's items from the store (those whose pages are in memory right
        here, the others in one worker call) and push them in one worker call: the
        worker hops, not the copies, are what a push costs on this loop."""
        found: list[tuple[MountedDataset, int, int, bytes]] = []
        slow: list[tuple[MountedDataset, int, int]] = []
        for ds, index, inode in batch:
            digest = ds.digest.hash(index)
            if self.skip(ds, digest):
                continue
            data = self.store.get_nowait(digest, ds.digest.sizes[index])
            if data is None:
                slow.append((ds, index, inode))
            else:
                found.append((ds, index, inode, data))
        if slow:
            read = await trio.to_thread.run_sync(self._read_stored, slow, limiter=self.limiter)
            # an entry whose content is not its size is left to its read, which fails
            found += [(ds, index, inode, data) for (ds, index, inode), data in zip(slow, read)
                      if data is not None and len(data) == ds.digest.sizes[index]]
        if not found:
            return
        pushed = await trio.to_thread.run_sync(_notify_store, found,
                                               limiter=self._push_limiter)
        now = time.monotonic()
        for (ds, _, inode, data), ok in zip(found, pushed):
            if ok:
                self._pushed[inode] = (ds, len(data), now)
                self.held += len(data)
                self.stats.count(ds, "pushed")
                self.stats.count(ds, "pushed_bytes", len(data))

    def _read_stored(self, items: list[tuple[MountedDataset, int, int]]
                     ) -> list[bytes | None]:
        """The stored content of each item: None where it is not stored, or the store
        fails (the read meets, and counts, the same error)."""
        out: list[bytes | None] = []
        for ds, index, _ in items:
            try:
                out.append(self.store.get(ds.digest.hash(index)))
            except StoreError:
                out.append(None)
        return out


def _notify_store(items: list[tuple[MountedDataset, int, int, bytes]]) -> list[bool]:
    """Hand each item's bytes to the kernel under its inode (in a worker thread: the
    kernel may wait for a page another request holds); whether each one went."""
    out = []
    for ds, index, inode, data in items:
        try:
            pyfuse3.notify_store(inode, 0, data)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the kernel does not hold the inode
                log.warning("notify_store of %s failed: %s", ds.digest.path(index), exc)
            out.append(False)
        else:
            out.append(True)
    return out
