"""Fair shares of what fetches hold, per uid: loader slots, fetch threads, and the FUSE
reads that wait for a fetch.

A fetch may take minutes (a slow bucket, or an endpoint that sends a byte every few
seconds), and nothing can take its slot back meanwhile. So that one user's slow source
never holds what another user's fetches need, a uid holds at most ``share(total)`` of
a pool's slots (``FairSlots``); a freed slot goes to the waiting uid that holds the
fewest. The uid charged is the one that registered the dataset (``reg.uid``): pyfuse3
gives a READ no caller, and a dataset's reads all read the storage of its owner.

Hits use none of this: they read the store in mountd's own workers, which no fetch
holds (``FetchThreads`` has threads of its own), so a hit never waits for a miss.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")

# A uid's reads waiting for fetches, at most (WaitingReads): what a source that stalls
# holds of each FUSE connection's request tasks and background requests
# (mountd.fs.fuse_limits sizes them from it).
WAITING_READS_PER_UID = 256


def share(total: int) -> int:
    """The slots of ``total`` one uid may hold at once: three quarters, so that a uid
    whose fetches stall leaves at least a quarter to the others, and one user alone
    still has most of the pool."""
    return max(1, total - total // 4)


@dataclasses.dataclass(eq=False)
class _Waiter:
    uid: int
    order: int
    granted: trio.Event = dataclasses.field(default_factory=trio.Event)


class FairSlots:
    """``total`` slots shared by uids, each holding at most ``per_uid``; a freed slot
    goes to the waiter whose uid holds the fewest (the longest waiting among equals)."""

    def __init__(self, total: int, per_uid: int | None = None) -> None:
        self.total = total
        self.per_uid = share(total) if per_uid is None else per_uid
        self.held: collections.Counter[int] = collections.Counter()
        self._in_use = 0
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()

    async def acquire(self, uid: int) -> None:
        """Take a slot for ``uid``, waiting for one that its share allows."""
        if not self._waiting and self._may_take(uid):
            self._take(uid)
            await trio.lowlevel.checkpoint()
            return
        waiter = _Waiter(uid, next(self._order))
        self._waiting.append(waiter)
        self._grant()  # the slots free may be ones only this uid's share allows
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():  # granted as it was cancelled: hand it on
                self.release(uid)
            else:
                self._waiting.remove(waiter)
            raise

    def release(self, uid: int) -> None:
        """Give back a slot ``uid`` took; it goes to a waiter its share allows."""
        self._in_use -= 1
        self.held[uid] -= 1
        if not self.held[uid]:
            del self.held[uid]
        self._grant()

    @contextlib.asynccontextmanager
    async def hold(self, uid: int) -> AsyncIterator[None]:
        await self.acquire(uid)
        try:
            yield
        finally:
            self.release(uid)

    def status(self) -> dict[str, int]:
        """Slots in all and per uid, those held, and the requests waiting for one."""
        return {"slots": self.total, "per_uid": self.per_uid, "held": self._in_use,
                "waiting": len(self._waiting)}

    def _may_take(self, uid: int) -> bool:
        return self._in_use < self.total and self.held[uid] < self.per_uid

    def _take(self, uid: int) -> None:
        self._in_use += 1
        self.held[uid] += 1

    def _grant(self) -> None:
        while self._in_use < self.total:
            allowed = [w for w in self._waiting if self.held[w.uid] < self.per_uid]
            if not allowed:
                return
            waiter = min(allowed, key=lambda w: (self.held[w.uid], w.order))
            self._waiting.remove(waiter)
            self._take(waiter.uid)
            waiter.granted.set()


class FetchThreads:
    """Worker threads for fetches in mountd (``file://`` datasets, and GCS misses with
    no loader process), apart from the workers of short blocking work (store reads,
    status): a fetch may hold its thread for minutes. Shared fairly by uid."""

    def __init__(self, threads: int) -> None:
        self.slots = FairSlots(threads)
        self._limiter = trio.CapacityLimiter(threads)

    @property
    def total(self) -> int:
        return self.slots.total

    async def run(self, uid: int, work: Callable[..., T], *args: object) -> T:
        """``work(*args)`` in a fetch thread, charged to ``uid``."""
        async with self.slots.hold(uid):
            return await trio.to_thread.run_sync(work, *args, limiter=self._limiter)


class TooManyWaiting(Exception):
    """The uid has its share of reads waiting for fetches already."""


class WaitingReads:
    """FUSE reads waiting for a fetch, per uid, at most ``per_uid`` each, on both FUSE
    connections (the datasets' and ``ROOT/.quiver``'s): each holds one of pyfuse3's
    request tasks and, for a readahead, one of the kernel's background requests
    (mountd.fs.fuse_limits). One more is refused at once rather than held, so that no
    uid fills what every user's reads pass through."""

    def __init__(self, per_uid: int) -> None:
        self.per_uid = per_uid
        self.held: collections.Counter[int] = collections.Counter()
        self._full: set[int] = set()  # uids refused since they last had room: logged once

    @contextlib.contextmanager
    def hold(self, uid: int) -> Iterator[None]:
        if self.held[uid] >= self.per_uid:
            if uid not in self._full:
                self._full.add(uid)
                log.warning("uid %d has %d reads waiting for fetches: refusing more until "
                            "some are done", uid, self.held[uid])
            raise TooManyWaiting(f"uid {uid} has {self.held[uid]} reads waiting for fetches")
        self.held[uid] += 1
        try:
            yield
        finally:
            self.held[uid] -= 1
            if not self.held[uid]:
                del self.held[uid]
                self._full.discard(uid)
