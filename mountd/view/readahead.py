"""The substitutable view's readahead: fetches, ahead of the view's jobs, the next items
of their common order (DatasetJobs.in_order) into the store, so that the first job to
want an item finds it cached too.

Each round looks, per pool, for the job with the fewest cached items it is yet to open
there (the pool's margin; hits handed out to it and queued count), and fetches the next
items in the common order that this job needs and that are not cached, for the pools of
the smallest margins first: the jobs read their pools at random rates, and the pools
they are about to run out of get the room. Rounds overlap, up to a bound on the items
in flight, so that the readahead keeps up with a fast job; they go on while the
dataset's cached bytes are under a share of its allotment (the rest is left to the jobs'
own misses), and up to a depth per pool. While the store evicts items the jobs still
need, they fill no more than a share of what was cached then: the jobs' own spread
(what the first job has had and the last has not) fills the cache, and fetching ahead
of it would only evict more of it, each eviction a second fetch.

A look or a round that fails on a bug below is logged (once in a run of failures per
dataset) and given up; the jobs' own reads fetch what it would have. Left to
propagate, it would end mountd.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import trio

from mountd.fetch.bulk_fetch import BulkFetch
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.store.recency import Recency
from quiverfs.counters import FetchCause, SamplerJobCounter
from quiverfs.failure_runs import FailureRuns
from quiverfs.heartbeat import CacheMode

log = logging.getLogger(__name__)

ROUND_ITEMS = 16  # items a look starts fetching at most
IN_FLIGHT = 64  # items being fetched per dataset at most, over rounds that overlap
ALLOTMENT_SHARE = 0.8  # of the dataset's allotment the readahead fills at most
MAX_AHEAD = 16  # cached items a pool's neediest job may have left before none are fetched
ITEMS_PER_POOL = 2  # items a round takes for one pool at most, so that many pools share it
EVICTION_PAUSE = 2.0  # seconds after a look found a needed item evicted, in which
EVICTED_SHARE = 0.9  # the readahead fills at most this share of the cached bytes then
LOOK_GAP = 0.01  # seconds between looks at least
IDLE_LOOK = 1.0  # seconds between looks when nothing wakes the readahead


# per item, whether a view job is yet to open it; and its pass number over a pool
JobNeeds = tuple[np.ndarray, Callable[[int], int]]


def next_items(group: DatasetJobs, needs: list[JobNeeds], limit: int) -> list[int]:
    """Up to ``limit`` items to fetch next for the view jobs with ``needs`` (per item,
    whether each is yet to open it), within the room the allotment leaves."""
    ceiling = ALLOTMENT_SHARE * group.allotment()
    if time.monotonic() - group.cached.evicted_at < EVICTION_PAUSE:
        # the store evicts items the jobs still need: no room for more than then
        ceiling = min(ceiling, EVICTED_SHARE * group.cached.evicted_bytes)
    room = int(ceiling) - group.cached.bytes
    if room <= 0 or not needs:
        return []
    pool_of, members = group.ds.pools.pool_of, group.ds.pools.members
    n_pools = len(members)
    margin = np.full(n_pools, np.iinfo(np.int64).max)
    whose = np.zeros(n_pools, dtype=np.int64)
    for k, (need, _) in enumerate(needs):
        wants = np.bincount(pool_of[need], minlength=n_pools) > 0
        ahead = np.bincount(pool_of[need & group.cached.cached], minlength=n_pools)
        fewer = wants & (ahead < margin)
        margin[fewer], whose[fewer] = ahead[fewer], k
    out: list[int] = []
    for pool in np.argsort(margin, kind="stable"):
        if margin[pool] >= MAX_AHEAD or len(out) >= limit:
            break
        pool_members = members[pool]
        need, pass_number = needs[whose[pool]]
        wanted = pool_members[need[pool_members] & ~group.cached.cached[pool_members]]
        # the common order's first: what the jobs' next misses would fetch
        wanted = group.in_order(wanted, pass_number(int(pool)))
        for i in wanted[:min(ITEMS_PER_POOL, limit - len(out), MAX_AHEAD - margin[pool])]:
            size = int(group.sizes[i])
            if size > room:
                return out
            out.append(int(i))
            room -= size
    return out


class ViewReadahead:
    """Runs the readahead rounds of every dataset with view jobs on this node."""

    def __init__(self, bulk: BulkFetch, recency: Recency,
                 groups: Callable[[], Iterable[tuple[DatasetJobs, list[JobNeeds]]]]) -> None:
        self.bulk = bulk
        self.recency = recency
        self.groups = groups  # each dataset with view jobs, and those jobs' needs
        self._wake = trio.Event()
        self._in_flight: collections.Counter[str] = collections.Counter()  # items, by dataset
        # its failed fetches, counted as BulkFetch counts a sampler job's
        self._counters: collections.Counter[SamplerJobCounter] = collections.Counter()
        self._failures = FailureRuns(log)  # by (dataset, "look" or "round")

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Look for items to fetch whenever woken (at most every LOOK_GAP), or every
        IDLE_LOOK; up to IN_FLIGHT items in flight per dataset, in rounds."""
        async with trio.open_nursery() as nursery:
            while True:
                with trio.move_on_after(IDLE_LOOK):
                    await self._wake.wait()
                self._wake = trio.Event()
                started = time.perf_counter()
                for group, needs in self.groups():
                    ds = group.ds
                    room = IN_FLIGHT - self._in_flight[ds.name]
                    if room <= 0 or group.mode is CacheMode.NONE:
                        continue
                    try:
                        items = next_items(group, needs, min(ROUND_ITEMS, room))
                        if items:
                            group.cached.hold(items)
                    except Exception:
                        self._failed(ds.name, "look")
                        continue
                    self._failures.succeeded((ds.name, "look"))
                    if items:
                        self._in_flight[ds.name] += len(items)
                        nursery.start_soon(self._round, group, items)
                # a look costs O(items x jobs): at most a twentieth of the loop's time
                await trio.sleep(max(LOOK_GAP, 20 * (time.perf_counter() - started)))

    async def _round(self, group: DatasetJobs, items: list[int]) -> None:
        try:
            self.recency.wanted(group.ds.digest.hash(i) for i in items)
            await self.bulk.load(group.ds, items, self._counters, FetchCause.VIEW_AHEAD)
        except Exception:
            self._failed(group.ds.name, "round")
        else:
            self._failures.succeeded((group.ds.name, "round"))
        finally:
            self._in_flight[group.ds.name] -= len(items)
            if not self._in_flight[group.ds.name]:
                del self._in_flight[group.ds.name]
            self.wake()

    def _failed(self, name: str, what: str) -> None:
        """A readahead ``what`` of dataset ``name`` raised (called in its ``except``)."""
        self._failures.failed("dataset %s: a readahead %s failed; its jobs' reads fetch "
                              "what it would have", name, what, key=(name, what))
