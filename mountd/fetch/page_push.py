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
stops counting at the OPEN of its inode, or at a READ of it that reaches mountd; where
files are served without OPEN (mountd sees none of a page-cache read), when its job
asks for a manifest after the next one:
a sampler reads one manifest ahead, so it has then handed its loader every batch
planned before the manifest it asked for last. A push neither opened nor passed within
UNREAD_EXPIRY seconds (the job died, or read another way) stops counting too, as do
those of a job that unregisters, and an item its job has passed is not pushed at all.
Planned items beyond the budget wait in a queue of at most MAX_QUEUED, and the oldest
are dropped beyond that: their reads simply reach mountd. Pages in the page cache are
the kernel's to reclaim.

Counting: a push is its read's local hit only where its pages served the read, so that
no read counts twice: at the RELEASE of an open that no READ of reached mountd, or
(without OPEN) when the push is taken as read. A READ that reaches mountd finds the
pages gone (reclaimed, or dropped by another reader's POSIX_FADV_DONTNEED): the push
counts as dropped, and the read as whatever the item reader finds.
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
        self._pushed: dict[int, _Push] = {}  # inode -> its push not yet taken off, oldest first
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
        self.stats.gather()  # a READ the native data plane served is counted first
        state.passed, state.asked = max(state.passed, state.asked), at
        state.when = time.monotonic()
        while state.pushed and state.pushed[0].planned.at < state.passed:
            push = state.pushed.popleft()
            if self._counts(push):
                self._read(push, ReadCounter.PUSHED_PASSED)

    def left(self, job: str) -> None:
        """``job`` unregistered: its pushes stop counting, so that they neither hold the
        budget nor keep another job's plan from pushing the same items."""
        state = self._jobs.pop(job, None)
        if state is None:
            return
        for push in state.pushed:
            if self._counts(push):
                self._take_off(push.planned.inode)
        self._changed.set()

    def _job(self, job: str) -> _JobPushes:
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _JobPushes(time.monotonic())
        return state

    def opened(self, inode: int) -> bool:
        """An OPEN of ``inode``: whether its item was pushed. The push no longer counts;
        ``released`` counts what served the open's reads."""
        push = self._take_off(inode)
        if push is None:
            return False
        self._take_staged(push)
        return True

    def released(self, ds: MountedDataset, index: int, reached: bool) -> None:
        """The RELEASE of an open of entry ``index`` that ``opened`` found pushed: its
        pages served the reads (a local hit), unless a READ ``reached`` mountd (the
        pages were gone, and the item reader counted the read)."""
        if reached:
            self.stats.count(ds, ReadCounter.PUSHED_DROPPED)
        else:
            self._hit(ds, ds.digest.sizes[index], ReadCounter.PUSHED_OPENS)

    def read_reached(self, inode: int) -> None:
        """A READ of ``inode`` without OPEN reaches the item reader, which counts it: a
        push of it not yet taken as read lost its pages, and no longer counts."""
        push = self._take_off(inode)
        if push is not None:
            self.stats.count(push.planned.ds, ReadCounter.PUSHED_DROPPED)

    def _read(self, push: _Push, why: ReadCounter) -> None:
        """``push`` taken as read (``why``, a counter): its pages served the read."""
        self._take_off(push.planned.inode)
        self._take_staged(push)
        self._hit(push.planned.ds, push.size, why)

    def _counts(self, push: _Push) -> bool:
        """Whether ``push`` still counts: its job keeps it until it asks past it, though
        it may have been taken off since (opened, its pages dropped, expired) and its
        inode pushed again."""
        return self._pushed.get(push.planned.inode) is push

    def _take_off(self, inode: int) -> _Push | None:
        """The push of ``inode``, which no longer counts; None if there is none."""
        push = self._pushed.pop(inode, None)
        if push is not None:
            self.held -= push.size
            self._changed.set()
        return push

    def _take_staged(self, push: _Push) -> None:
        # the pages hold the hit a manifest promised: its chunk need not wait for a READ
        self.staging.take(push.planned.ds.digest.hash(push.planned.index))

    def _hit(self, ds: MountedDataset, size: int, why: ReadCounter) -> None:
        self.stats.count(ds, why)
        self.stats.count(ds, ReadCounter.LOCAL_HITS)
        self.stats.count(ds, ReadCounter.LOCAL_BYTES, size)

    def forget(self, inodes: list[int]) -> None:
        """These inodes' pages are being dropped: their pushes no longer count."""
        for inode in inodes:
            self._take_off(inode)

    def _expire(self, now: float) -> None:
        for inode, push in list(self._pushed.items()):
            if now - push.when < UNREAD_EXPIRY:
                break  # pushed in order: the rest are younger
            self._take_off(inode)
            self.stats.count(push.planned.ds, ReadCounter.PUSHED_UNOPENED)
        for job, state in list(self._jobs.items()):  # jobs gone (their pushes expired)
            if now - state.when >= UNREAD_EXPIRY and not any(
                    self._counts(push) for push in state.pushed):
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
                push = self._pushed[item.inode] = _Push(item, len(data), now)
                self.held += len(data)
                self.stats.count(item.ds, ReadCounter.PUSHED)
                self.stats.count(item.ds, ReadCounter.PUSHED_BYTES, len(data))
                state = self._jobs.get(item.job)
                if state is None:  # the job left while it was pushed: no read of it
                    self._take_off(item.inode)
                elif item.at < state.passed:  # the job moved on while it was pushed
                    self._read(push, ReadCounter.PUSHED_PASSED)
                else:
                    state.pushed.append(push)

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


@dataclasses.dataclass(frozen=True, eq=False)
class _Push:
    """A planned item pushed: it counts against the budget (and as a hit, if taken as
    read) while ``PagePush._pushed`` holds it."""

    planned: _Planned
    size: int  # bytes
    when: float


@dataclasses.dataclass
class _JobPushes:
    """What one job asked for, and its pushes in order: those taken off since (opened,
    their pages dropped) are skipped when reached."""

    when: float  # of its last request
    asked: Position = (-1, -1)  # the manifest it asked for last
    passed: Position = (-1, -1)  # before this, it has been handed every batch
    pushed: collections.deque[_Push] = dataclasses.field(default_factory=collections.deque)


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
