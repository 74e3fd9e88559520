"""Planned reads pushed into the kernel's page cache, so they never reach mountd.

When the batch planner places a job's batch, it knows which files the job's workers
open next. For each of its cached items the pusher takes the verified bytes from the
store and hands them to the kernel with FUSE's notify_store, under the item's inode:
the workers' reads then find the pages, and mountd sees only their OPEN and RELEASE.

Why this never leaves wrong bytes under an inode: inode numbers are never reused while
mountd runs (each registration gets a fresh range), an inode's content never changes,
and the store returns an item only after its CRC32C (and, once per run, its SHA-256)
matched. A push of an inode the kernel does not hold fails with ENOENT and is skipped.

Memory: the pages pushed and not yet read are bounded by ``budget`` bytes. A push
stops counting at the OPEN of its inode; where files are served without OPEN (mountd
sees none of a page-cache read), when its job asks for a manifest after the next one:
a sampler reads one manifest ahead, so it has then handed its loader every batch
planned before the manifest it asked for last. A push neither opened nor passed within
UNREAD_EXPIRY seconds (the job died, or read another way) stops counting too, as do
those of a job that unregisters, and an item its job has passed is not pushed at all.
Planned items beyond the budget wait in a queue of at most MAX_QUEUED, and the oldest
are dropped beyond that: their reads simply reach mountd. Pages in the page cache are
the kernel's to reclaim.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import time
from collections.abc import Callable

import pyfuse3
import trio

from mountd.datasets.dataset import MountedDataset
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from mountd.store.content_store import ContentStore
from mountd.store.errors import StoreError
from quiverfs.counters import ReadCounter

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
        self._queue: collections.deque[_Planned] = collections.deque(maxlen=MAX_QUEUED)
        self._pushed: dict[int, tuple[MountedDataset, int, float]] = {}  # inode -> ds, bytes, when
        self._jobs: dict[str, _JobPushes] = {}
        self.held = 0  # bytes pushed and not yet read
        self._changed = trio.Event()
        # notify_store waits for a page another request holds locked: never with a
        # worker the read path needs
        self._push_limiter = trio.CapacityLimiter(PUSH_THREADS)

    def enqueue(self, ds: MountedDataset, indices: list[int], job: str, at: Position) -> None:
        """Push these entries of ``ds`` (those in the store) ahead of their reads: the
        items ``job`` was handed in the manifest of batch ``at`` (epoch, batch)."""
        if self.budget <= 0 or not indices:
            return
        self._job(job)
        self._queue.extend(_Planned(ds, i, job, at) for i in indices)
        self._changed.set()

    def asked(self, job: str, at: Position) -> None:
        """``job`` asked for the manifest of batch ``at``: the pushes of what it was
        handed before the manifest it asked for last stop counting (taken as read)."""
        state = self._jobs.get(job)
        if state is None:
            return
        state.passed, state.asked = max(state.passed, state.asked), at
        state.when = time.monotonic()
        while state.pushed and state.pushed[0][0] < state.passed:
            self._read(state.pushed.popleft()[1], ReadCounter.PUSHED_PASSED)

    def left(self, job: str) -> None:
        """``job`` unregistered: its pushes stop counting, so that they neither hold the
        budget nor keep another job's plan from pushing the same items."""
        state = self._jobs.pop(job, None)
        if state is None:
            return
        for _, inode in state.pushed:
            pushed = self._pushed.pop(inode, None)
            if pushed is not None:
                self.held -= pushed[1]
        self._changed.set()

    def _job(self, job: str) -> _JobPushes:
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _JobPushes(time.monotonic())
        return state

    def opened(self, inode: int) -> bool:
        """An OPEN of ``inode``: whether its item was pushed. Its pages then serve the
        reads, which count as local hits here; the push no longer counts."""
        return self._read(inode, ReadCounter.PUSHED_OPENS)

    def _read(self, inode: int, why: ReadCounter) -> bool:
        """A push taken as read (``why``, a counter): whether ``inode`` was pushed. Its
        pages then serve the reads, which count as local hits here."""
        pushed = self._pushed.pop(inode, None)
        if pushed is None:
            return False
        ds, n, _ = pushed
        self.held -= n
        # the pages hold the hit a manifest promised: its chunk need not wait for a READ
        self.staging.take(ds.digest.hash(ds.tree.entry_index(inode - ds.inode_base)))
        self.stats.count(ds, why)
        self.stats.count(ds, ReadCounter.LOCAL_HITS)
        self.stats.count(ds, ReadCounter.LOCAL_BYTES, n)
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
            self.stats.count(ds, ReadCounter.PUSHED_UNOPENED)
        for job, state in list(self._jobs.items()):  # jobs gone (their pushes expired)
            if now - state.when >= UNREAD_EXPIRY and not any(
                    inode in self._pushed for _, inode in state.pushed):
                del self._jobs[job]

    async def _wait(self) -> None:
        self._changed = trio.Event()
        with trio.move_on_after(1.0):  # expiry frees budget without any event
            await self._changed.wait()

    def _passed(self, item: _Planned) -> bool:
        state = self._jobs.get(item.job)
        return state is None or item.at < state.passed

    def _take(self) -> list[_Planned]:
        """Up to PUSH_BATCH queued items that fit the budget and that their jobs have
        not passed."""
        batch: list[_Planned] = []
        room = self.budget - self.held
        while self._queue and len(batch) < PUSH_BATCH:
            item = self._queue.popleft()
            size = item.ds.digest.sizes[item.index]
            if item.inode in self._pushed or size > self.budget or self._passed(item):
                continue  # pushed already, never fits, or too late
            if size > room:
                self._queue.appendleft(item)
                break
            room -= size
            batch.append(item)
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

    async def _push(self, batch: list[_Planned]) -> None:
        """Read the batch's items from the store (those whose pages are in memory right
        here, the others in one worker call) and push them in one worker call: the
        worker hops, not the copies, are what a push costs on this loop."""
        found: list[tuple[_Planned, bytes]] = []
        slow: list[_Planned] = []
        for item in batch:
            digest = item.ds.digest.hash(item.index)
            if self.skip(item.ds, digest):
                continue
            data = self.store.get_nowait(digest, item.ds.digest.sizes[item.index])
            if data is None:
                slow.append(item)
            else:
                found.append((item, data))
        if slow:
            read = await trio.to_thread.run_sync(self._read_stored, slow, limiter=self.limiter)
            # an entry whose content is not its size is left to its read, which fails
            found += [(item, data) for item, data in zip(slow, read)
                      if data is not None and len(data) == item.ds.digest.sizes[item.index]]
        if not found:
            return
        pushed = await trio.to_thread.run_sync(_notify_store, found,
                                               limiter=self._push_limiter)
        now = time.monotonic()
        for (item, data), ok in zip(found, pushed):
            if ok:
                self._pushed[item.inode] = (item.ds, len(data), now)
                self.held += len(data)
                self.stats.count(item.ds, ReadCounter.PUSHED)
                self.stats.count(item.ds, ReadCounter.PUSHED_BYTES, len(data))
                if self._passed(item):  # the job moved on while it was pushed
                    self._read(item.inode, ReadCounter.PUSHED_PASSED)
                else:
                    self._job(item.job).pushed.append((item.at, item.inode))

    def _read_stored(self, items: list[_Planned]) -> list[bytes | None]:
        """The stored content of each item: None where it is not stored, or the store
        fails (the read meets, and counts, the same error)."""
        out: list[bytes | None] = []
        for item in items:
            try:
                out.append(self.store.get(item.ds.digest.hash(item.index)))
            except StoreError:
                out.append(None)
        return out


Position = tuple[int, int]  # (epoch, batch) of a job's manifest


@dataclasses.dataclass(frozen=True)
class _Planned:
    """An item planned for a job's batch, to push."""

    ds: MountedDataset
    index: int
    job: str
    at: Position  # the manifest that handed it out

    @property
    def inode(self) -> int:
        return self.ds.entry_inode(self.index)


@dataclasses.dataclass
class _JobPushes:
    """What one job asked for, and its pushes not yet taken as read, in order."""

    when: float  # of its last request
    asked: Position = (-1, -1)  # the manifest it asked for last
    passed: Position = (-1, -1)  # before this, it has been handed every batch
    pushed: collections.deque[tuple[Position, int]] = dataclasses.field(
        default_factory=collections.deque)  # (at, inode)


def _notify_store(items: list[tuple[_Planned, bytes]]) -> list[bool]:
    """Hand each item's bytes to the kernel under its inode (in a worker thread: the
    kernel may wait for a page another request holds); whether each one went."""
    out = []
    for item, data in items:
        try:
            pyfuse3.notify_store(item.inode, 0, data)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the kernel does not hold the inode
                log.warning("notify_store of %s failed: %s",
                            item.ds.digest.path(item.index), exc)
            out.append(False)
        else:
            out.append(True)
    return out
