"""A view's cached opens served by the native plane, which answers ROOT/.quiver's
connection in C (mountd.fs.native_views): per job and pool, hits already handed out to
the job are queued there, and the open of a view file by one of the job's processes
takes the next, with no request reaching Python.

Python keeps the policy: which items a job gets, each once per pass (mountd.view.view_jobs
plans them as for its own opens), which processes are the job's, and the counters. What
the plane served comes back here (drained with the read counters) and counts as an open
here would; an item it could not serve (withdrawn since it was queued, or its file gone)
is the job's to be served again in its pass, chosen anew like any other it has not had
(a hit where it is cached again by then). Where the dataset is allotted full, a job's
next pass over a pool is begun once its current one has handed out every item, and its
hits are queued behind the current one's: the plane serves a queue in order, and a
later pass's hits only once every item of the pass before was served (one given back
there is served by Python first). An open that finds its queue empty waits in the
plane and asks here (a NEEDED event): the pass's next hits are queued for it, or its
miss, chosen then and fetched into the store first; else it is declined, and goes
through Python.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from mountd.view.view_job import Choice, PoolPass, ViewJob
from quiverfs.heartbeat import CacheMode

log = logging.getLogger(__name__)

# Hits queued in the plane per job and pool. A queued hit is kept in the store until
# every job has opened it: 48 held so much of a bucket-bound view's cache that its
# readahead found no room (the full substitution's view hits 0.85, against 0.98 at 8).
NATIVE_AHEAD = 8
REFILL_BELOW = 3  # a queue is topped up once fewer are left in it (the plane says when
# one is down to 2, mountd/native/view.c VIEW_LOW)
# Where the dataset is allotted full, every item stays cached and nothing is fetched
# ahead: deep queues cost nothing there, and a top-up (a plan, store look-ups) comes
# every 64 opens, not 6 (the full substitution's cached view job alone: 3,538-3,616
# items/s at 8, 5,025-5,095 at 48, 5,755 at 128).
FULL_AHEAD, FULL_REFILL_BELOW = 128, 64
DRAIN_PAUSE = 0.001  # seconds between drains while a Python open waits for the plane's
SETTLE_TIMEOUT = 1.0  # seconds after which the plane's opens not reported count as done
MAX_PIDS = 4096  # processes named to the plane per job (past it, they open through Python)

# (job's number, item, kind, seconds the open took in the plane, the number of the
# job's pass over the item's pool it was queued in); kind: OPENED, RETURNED (given
# back), or NEEDED (an open waits on the job's empty queue of the pool ``item``)
Event = tuple[int, int, int, float, int]
OPENED, RETURNED, NEEDED = 0, 1, 2


class ViewPlane(Protocol):
    """What the native plane is told of the views' jobs (mountd.fs.native_views)."""

    def job(self, job_id: int, base: int, uid: int) -> bool: ...

    def forget(self, job_id: int) -> None: ...

    def pid(self, job_id: int, pid: int, pgid: int) -> bool: ...

    def push(self, job_id: int, pool: int, items: list[int], number: int) -> bool:
        """Queue ``items``, handed out in the job's pass ``number`` over ``pool``."""

    def passed(self, job_id: int, pool: int, number: int) -> None:
        """The job's pass ``number`` over ``pool`` has begun: the plane may serve it."""

    def decline(self, job_id: int, pool: int) -> None:
        """An open waiting on the job's empty queue of ``pool`` is answered through
        Python (no item is queued for it)."""

    def waiting(self, job_id: int, pool: int) -> int:
        """How many of the job's opens wait on its empty queue of ``pool`` (not
        declined)."""

    def take(self, job_id: int, pool: int) -> tuple[int, int] | None:
        """The next item queued for the job and pool, taken back, with the number of the
        pass it was queued in (None if none is)."""

    async def woken(self) -> None:
        """Return once a queue runs low, or an item was given back."""

    def drain(self) -> None:
        """Hand what the plane did since the last call to ``NativeQueues.drained``."""


class NativeQueues:
    """The view jobs' queues in the native plane: topped up, and what they served."""

    def __init__(self, plane: ViewPlane, plan: Callable[[ViewJob, int, PoolPass, int, bool],
                                                        Awaitable[None]],
                 opened: Callable[[ViewJob, int, list[tuple[Choice, float]]], None],
                 gone: Callable[[ViewJob, int], None],
                 load: Callable[[ViewJob, Choice], Awaitable[bool]]) -> None:
        self.plane = plane
        # chooses up to so many of a pass's next items (ViewJobs._plan), under its lock
        self._plan = plan
        self._opened = opened  # counts opens of queued hits (ViewJobs.opened_natively)
        self._gone = gone  # an item given back: not taken as held (ViewJobs.given_back)
        self._load = load  # a miss fetched into the store: whether it is served there
        self._jobs: dict[int, ViewJob] = {}  # by number: the jobs the plane knows
        self._wanted: dict[tuple[int, int], None] = {}  # (job, pool) to top up, in order
        self._wake = trio.Event()
        self._needed: list[tuple[int, int]] = []  # (job, pool) an open waits on, in order
        self._need = trio.Event()

    def created(self, job: ViewJob) -> None:
        if self.plane.job(job.native_id, job.ds.inode_base, job.uid):
            self._jobs[job.native_id] = job
            job.pass_begun = functools.partial(self._pass_begun, job)

    def _pass_begun(self, job: ViewJob, pool: int, number: int) -> None:
        """Where the plane held back ``job``'s next pass's hits (an item of the pass
        before was given back), it serves them again: every item of that pass is served."""
        if job.native_id in self._jobs:
            self.plane.passed(job.native_id, pool, number)

    def dropped(self, job: ViewJob) -> None:
        if self._jobs.pop(job.native_id, None) is not None:
            self.plane.forget(job.native_id)

    def opener(self, job: ViewJob, pid: int, pgid: int) -> None:
        """``pid``, in process group ``pgid``, reads for ``job``: the plane may serve its
        opens (while it stays in that group, and under the job's uid)."""
        if (job.native_id in self._jobs and job.native_pids.get(pid) != pgid
                and len(job.native_pids) < MAX_PIDS
                and self.plane.pid(job.native_id, pid, pgid)):
            job.native_pids[pid] = pgid

    def top_up(self, job: ViewJob, pool: int) -> None:
        """Queue more of ``job``'s hits of ``pool`` in the plane, soon (``run``)."""
        if job.native_id in self._jobs:
            self._wanted[(job.native_id, pool)] = None
            self._wake.set()

    async def take_back(self, job: ViewJob, pool: int, current: PoolPass) -> Choice | None:
        """For an open through Python of ``job``'s, whose pass has nothing left to hand
        out but what is queued in the plane: the next of those, taken back; else None,
        once the plane's opens of them are drained (the pass has ended)."""
        deadline = trio.current_time() + SETTLE_TIMEOUT
        while current.native:
            taken = self.plane.take(job.native_id, pool)
            if taken is not None and taken[1] == current.number and taken[0] in current.native:
                return current.native.pop(taken[0])
            if taken is not None:  # the next pass's, queued behind: chosen anew in it
                self._taken_ahead(job, pool, *taken)
            # all opened there: counted once drained (an open under way in the plane
            # reports it as soon as its file is open)
            self.plane.drain()
            if current.native and trio.current_time() > deadline:
                # reports lost (the plane's ring was full): those count as opened;
                # what is still queued there is taken back, to be chosen again
                log.warning("view job %s: %d opens in the native plane were not reported",
                            job.id, len(current.native))
                while (taken := self.plane.take(job.native_id, pool)) is not None:
                    self._taken_ahead(job, pool, *taken)
                current.native.clear()
            elif current.native:
                await trio.sleep(DRAIN_PAUSE)
        return None

    @staticmethod
    def _taken_ahead(job: ViewJob, pool: int, item: int, number: int) -> None:
        """``item``, queued in the plane for the job's pass ``number`` over ``pool``, its
        next, and taken back from it: that pass is to choose it again."""
        taken = job.native_taken(pool, item, number)
        if taken is not None:
            job.give_back(taken[0], item)

    async def run(self) -> None:
        """Top up the queues asked for, one at a time, in the order asked; supply the
        queues opens wait on, each at once; drain the plane when it says a queue runs
        low or an open waits (else the read counters do, every 0.1 s)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drains)
            nursery.start_soon(self._supplies, nursery)
            await self._fills()

    async def _drains(self) -> None:
        while True:
            await self.plane.woken()
            self.plane.drain()

    async def _fills(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._wanted:
                key = next(iter(self._wanted))
                del self._wanted[key]
                job = self._jobs.get(key[0])
                if job is not None:
                    await self._fill(job, key[1])

    async def _supplies(self, nursery: trio.Nursery) -> None:
        while True:
            await self._need.wait()
            self._need = trio.Event()
            needed, self._needed = self._needed, []
            for job_id, pool in needed:
                job = self._jobs.get(job_id)
                if job is not None:  # else forgotten: the plane let its opens go
                    nursery.start_soon(self._supply, job, pool)

    async def _supply(self, job: ViewJob, pool: int) -> None:
        """An open of ``job``'s waits in the plane on its empty queue of ``pool``: queue
        the pass's next items there, or decline (the open comes to Python). A failure
        here declines too: that open, not mountd, meets it."""
        try:
            supplied = await self._supplied(job, pool)
        except Exception:
            log.exception("view job %s: an open waiting in the native plane is answered "
                          "through mountd", job.id)
            supplied = False
        if not supplied and job.native_id in self._jobs:
            self.plane.decline(job.native_id, pool)

    async def _supplied(self, job: ViewJob, pool: int) -> bool:
        """Whether the waiting open's queue was given the items it now serves: the
        pass's next hits, or where none is cached its next miss, once fetched into the
        store (chosen as the open comes, as Python's open chooses one; not where the
        dataset has no room in the store). Nothing where the plane still has items of
        the pass queued or being opened, as far as mountd knows: Python's open sorts
        those out. True where no open waits any more (a top-up served it): a pass is
        begun, or a miss fetched, only for an open that wants it."""
        if not self.plane.waiting(job.native_id, pool):
            return True
        current = job.pass_of(pool)
        ahead = _depth(job)[0]
        async with current.lock:
            if current.native:
                return False
            if not current.queue and current.pending.any():
                await self._plan(job, pool, current, ahead, True)
            if self._push_hits(job, pool, current, ahead):
                return True
            if not current.queue or job.group.mode is CacheMode.NONE:
                return False
            miss = current.queue[0]
        if not await self._load(job, miss):
            return False  # Python's open takes it, and fetches it (or fails) itself
        async with current.lock:
            if not current.queue or current.queue[0] is not miss:
                return False  # an open through Python took it meanwhile
            current.queue.popleft()
            if self._push(job, pool, current, [miss]):
                return True
            current.queue.appendleft(miss)
            return False

    def _push(self, job: ViewJob, pool: int, current: PoolPass, choices: list[Choice]
              ) -> bool:
        """Queue ``choices`` of the pass ``current`` in the plane; whether it took them."""
        if (job.native_id not in self._jobs
                or not self.plane.push(job.native_id, pool, [c.index for c in choices],
                                       current.number)):
            return False
        current.native.update((c.index, c) for c in choices)
        return True

    def _push_hits(self, job: ViewJob, pool: int, current: PoolPass, ahead: int) -> bool:
        """Queue the hits at the head of the pass's queue in the plane, up to ``ahead``
        there; whether any went (else they stay for Python's opens)."""
        hits: list[Choice] = []
        while (current.queue and current.queue[0].hit
               and len(current.native) + len(hits) < ahead):
            hits.append(current.queue.popleft())
        if hits and not self._push(job, pool, current, hits):
            current.queue.extendleft(reversed(hits))
            return False
        return bool(hits)

    async def _fill(self, job: ViewJob, pool: int) -> None:
        """Up to ``_depth`` of the job's hits of ``pool`` queued in the plane: its current
        pass's, and where the dataset is allotted full, once that pass has handed out
        every item, its next pass's behind them (else the first opens of each pass, an
        epoch's first in a plain loader, went through Python: 3% of the opens of a
        cached view epoch alone)."""
        current = job.pools.get(pool)
        if current is None:
            return
        full = job.group.mode is CacheMode.FULL
        if current.used_up and (full or pool in job.upcoming):
            current = job.pass_of(pool)  # the next pass (begun ahead, if it was)
        ahead, _ = _depth(job)
        upcoming = job.upcoming.get(pool)
        if upcoming is None or not upcoming.native:  # never behind a later pass's
            await self._fill_pass(job, pool, current, ahead)
        if full and current.native and not current.queue and not current.pending.any():
            await self._fill_pass(job, pool, job.next_pass(pool), ahead - len(current.native))

    async def _fill_pass(self, job: ViewJob, pool: int, current: PoolPass, ahead: int
                         ) -> None:
        """Up to ``ahead`` hits of the pass ``current`` queued in the plane: planned ones
        first, then as many as planning finds cached. It plans no miss: where none is
        cached, the job's next open goes through Python, which plans then (a miss
        planned here would stay one though its item were loaded before that open: the
        bucket-bound view's hits halved so)."""
        async with current.lock:
            while len(current.native) < ahead:
                if not current.queue:
                    if not current.pending.any():
                        return
                    # hits only (misses=False)
                    await self._plan(job, pool, current, ahead - len(current.native),
                                     False)
                if not self._push_hits(job, pool, current, ahead):
                    return

    def drained(self, events: list[Event]) -> None:
        """What the plane did with the queued items: those opened count as opens of
        their jobs, together per job and pool; each given back is the job's to be chosen
        again in its pass (handed out at once as a miss, the bucket-bound view fetched
        what a chunk would load for all its jobs a little later)."""
        opened: dict[tuple[int, int], list[tuple[Choice, float]]] = {}
        for job_id, item, kind, seconds, number in events:
            job = self._jobs.get(job_id)
            if job is None:
                continue  # forgotten since
            if kind == NEEDED:  # after what came before it: supplied once that is counted
                self._needed.append((job_id, item))
                self._need.set()
                continue
            pool = int(job.ds.pools.pool_of[item])
            taken = job.native_taken(pool, item, number)
            if taken is None:
                continue
            current, choice = taken
            if kind == RETURNED:  # chosen anew: a hit, where cached again by then
                job.give_back(current, item)
                self._gone(job, item)
            else:
                job.opened_in(current)
                opened.setdefault((job_id, pool), []).append((choice, seconds))
        now = time.monotonic()
        for (job_id, pool), choices in opened.items():
            job = self._jobs[job_id]
            job.last_used = now
            self._opened(job, pool, choices)
            if job.queued_natively(pool) < _depth(job)[1]:
                self.top_up(job, pool)


def _depth(job: ViewJob) -> tuple[int, int]:
    """How many of ``job``'s hits a queue holds, and the count under which it is topped
    up: deeper where its dataset is allotted full."""
    if job.group.mode is CacheMode.FULL:
        return FULL_AHEAD, FULL_REFILL_BELOW
    return NATIVE_AHEAD, REFILL_BELOW
