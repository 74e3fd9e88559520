"""A job reading a substitutable view (mountd.view.view_jobs): its pass over each pool,
what it has been handed out and is yet to be served, and its counters."""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from mountd.datasets.dataset import MountedDataset
from mountd.jobs.dataset_jobs import DatasetJobs
from quiverfs.counters import FetchCause, ViewJobCounter
from quiverfs.heartbeat import JobReport


@dataclasses.dataclass(frozen=True)
class Choice:
    """What an open of a view file serves, and how a miss of it is fetched."""

    index: int
    hit: bool  # cached when chosen
    cause: FetchCause
    keep: bool


class PoolPass:
    """A job's current pass over one pool: which of its items the job has not been
    served yet, and items chosen not yet served."""

    def __init__(self, number: int, members: np.ndarray, ahead: bool = False) -> None:
        self.number = number
        # begun while the job's current pass over the pool still has items to open
        # (ViewJob.next_pass): what it hands out is not counted in the job's needs
        self.ahead = ahead
        self.started = False  # an item of it opened: counted in the job's passes
        self.members = members  # the pool's items, ascending
        self.pending = np.ones(len(members), dtype=bool)
        self.queue: collections.deque[Choice] = collections.deque()
        # hits queued in the native plane (mountd.view.native_queue), by item: placed,
        # not opened yet
        self.native: dict[int, Choice] = {}
        self.lock = trio.Lock()  # one planning at a time

    def pending_items(self) -> np.ndarray:
        """The items not yet served in this pass."""
        return self.members[self.pending]

    def place(self, items: list[int]) -> None:
        """Hand out ``items``: each at most once per pass."""
        positions = np.searchsorted(self.members, items)
        if not self.pending[positions].all() or len(set(items)) < len(items):
            raise AssertionError("an item was chosen twice in one pass")
        self.pending[positions] = False

    def give_back(self, item: int) -> None:
        """``item``, handed out and not served, is to be chosen again in this pass."""
        self.pending[np.searchsorted(self.members, item)] = True

    @property
    def used_up(self) -> bool:
        """Every item handed out and taken. (Not "nor is its lock held": a planning places
        its items and queues them with no await between, and trio hands a released lock
        straight to the next waiter, so opens waiting on it would never see it free.)"""
        return not self.queue and not self.native and not self.pending.any()


class ViewJob:
    """One job reading a view: its pass over each pool, and its counters."""

    def __init__(self, job_id: str, ds: MountedDataset, uid: int, identity: str,
                 group: DatasetJobs, native_id: int = 0) -> None:
        self.id = job_id
        self.native_id = native_id  # its number in the native plane (mountd.view.native_queue)
        self.native_pids: dict[int, int] = {}  # pid -> its pgid, as the plane was told
        self.ds = ds
        self.uid = uid
        self.identity = identity
        self.group = group
        self.pools: dict[int, PoolPass] = {}
        self.upcoming: dict[int, PoolPass] = {}  # per pool: its next pass, begun ahead
        # told of each pass begun, with its pool and number (NativeQueues.created)
        self.pass_begun: Callable[[int, int], None] = lambda pool, number: None
        # per item: whether the job is yet to be served it (in the current pass over its
        # pool, or a first one); False for items that are always served exactly
        self.need = ds.pools.shared.copy()
        self.pgids: set[int] = set()  # process groups seen opening for it
        self.counters: collections.Counter[ViewJobCounter] = collections.Counter()
        self.last_used = time.monotonic()

    def report(self) -> JobReport:
        """What the coordinator needs: no chunk (the view does not drive the cycle), and
        never probed (its reads are not timed per batch)."""
        return JobReport(id=self.id, gen=0, gpus=1,
                         remaining=(0,) * self.group.plan.n_chunks,
                         probe_seq=0, probeable=False, batch_bytes=self.ds.mean_item_bytes)

    def stats(self) -> dict[str, Any]:
        return {"job": self.id, "dataset": self.ds.name, "uid": self.uid,
                "identity": self.identity, "counters": dict(self.counters),
                "pools_in_pass": len(self.pools), "remaining": int(self.need.sum()),
                "queued_natively": sum(len(p.native) for passes in (self.pools, self.upcoming)
                                       for p in passes.values())}

    def pass_of(self, pool: int) -> PoolPass:
        """The job's current pass over ``pool``; where the last is used up, the next (the
        one begun ahead, if any)."""
        current = self.pools.get(pool)
        if current is not None and not current.used_up:
            return current
        made = self.upcoming.pop(pool, None)
        if made is None:
            made = PoolPass(0 if current is None else current.number + 1,
                            self.ds.pools.members[pool])
        made.ahead = False
        self.need[made.members] = made.pending
        self.pools[pool] = made
        self.pass_begun(pool, made.number)
        return made

    def opened_in(self, current: PoolPass) -> None:
        """An item handed out in the pass ``current`` was opened: the pass is counted as
        started, once. (Not as it begins here: with its hits queued in the native plane
        behind the pass before, it begins as that one's last item is reported, often
        before the epoch that opens it.)"""
        if not current.started:
            current.started = True
            self.counters[ViewJobCounter.PASSES] += 1

    def next_pass(self, pool: int) -> PoolPass:
        """The job's next pass over ``pool``, begun while the current one (which has
        handed out every item) still has items to open: the native plane's queue
        serves its hits after theirs."""
        made = self.upcoming.get(pool)
        if made is None:
            current = self.pools[pool]
            made = self.upcoming[pool] = PoolPass(current.number + 1, current.members, True)
        return made

    def native_taken(self, pool: int, item: int, number: int
                     ) -> tuple[PoolPass, Choice] | None:
        """``item``'s hit queued in the native plane in the job's pass ``number`` over
        ``pool`` (its current or its next), taken off it; None where it has none."""
        for current in (self.pools.get(pool), self.upcoming.get(pool)):
            if current is not None and current.number == number:
                choice = current.native.pop(item, None)
                return None if choice is None else (current, choice)
        return None

    def queued_natively(self, pool: int) -> int:
        """How many of the job's hits of ``pool`` are queued in the native plane."""
        return sum(len(current.native) for current in (self.pools.get(pool),
                                                       self.upcoming.get(pool))
                   if current is not None)

    def pass_number(self, pool: int) -> int:
        """The number of the job's current (or first) pass over ``pool``."""
        current = self.pools.get(pool)
        return 0 if current is None else current.number

    def place(self, current: PoolPass, items: list[int]) -> None:
        """Hand out ``items`` in the pass ``current``: each at most once per pass."""
        current.place(items)
        if not current.ahead:
            self.need[items] = False

    def give_back(self, current: PoolPass, item: int) -> None:
        """``item``, handed out in the pass ``current`` and not served (its file left the
        store first), is the job's to be served again in that pass."""
        current.give_back(item)
        if not current.ahead:
            self.need[item] = True

    def unopened(self) -> np.ndarray:
        """Per item: whether the job is yet to open it in its current pass over its pool
        (not handed out yet, or a hit handed out and queued, here or in the native plane)."""
        out = self.need.copy()
        for current in self.pools.values():
            out[list(current.native)] = True
            out[[c.index for c in current.queue if c.hit]] = True
        return out

    def queued(self, pool: int, item: int) -> bool:
        """Whether the job has chosen ``item`` of ``pool`` and not opened it yet."""
        return any(item in current.native or any(c.index == item for c in current.queue)
                   for current in (self.pools.get(pool), self.upcoming.get(pool))
                   if current is not None)

    def kept_for(self, items: np.ndarray) -> np.ndarray:
        """Which of an evicted chunk's ``items`` the job is yet to be served."""
        return self.need[items]
