"""Items in bulk for the batch planner and the chunk loader: which of many hashes
their owners hold (this node's store, or a peer), and fetching many items at once
(a chunk load's in the loader processes, where they can)."""
from __future__ import annotations

import collections
import logging

import numpy as np
import trio

from mountd.cluster.membership import Cluster
from mountd.datasets.dataset import MountedDataset
from mountd.fetch.item_reader import IntegrityFailed, ItemReader, ReadFailed
from mountd.fetch.loader_pool import (LoaderPool, LoaderUnavailable, LoadFailed, LoadMismatch,
                                      load_source)
from mountd.fetch.loader_process import LoadSource
from mountd.fetch.probed import ProbedReads
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from mountd.store.content_store import ContentStore
from quiverfs.counters import FetchCause, ReadCounter, SamplerJobCounter
from quiverfs.heartbeat import CacheMode
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)

FETCH_CONCURRENCY = 16  # misses fetched at once for one batch or one chunk load


class BulkFetch:
    """Look-ups and fetches of many items, through the item reader's tiers."""

    def __init__(self, reader: ItemReader, store: ContentStore, limiter: trio.CapacityLimiter,
                 cluster: Cluster, stats: ReadStats, staging: Staging, probed: ProbedReads,
                 pool: LoaderPool | None = None) -> None:
        self.reader = reader
        self.store = store
        self.limiter = limiter
        self.cluster = cluster
        self.stats = stats
        self.staging = staging
        self.probed = probed
        self.pool = pool  # None: every fetch runs in mountd

    def held_here(self, hashes: list[bytes]) -> list[bool] | None:
        """``held``, where this node owns every hash: its store answers (for a worker:
        it may block on the disk). None where a peer owns one (``held`` asks it)."""
        if any(self.cluster.other_owner(h) is not None for h in hashes):
            return None
        return [h in self.store for h in hashes]

    async def held(self, hashes: list[bytes]) -> list[bool]:
        """Which hashes their owners hold (this node's store, or a peer's); a peer that
        cannot be asked counts as holding nothing."""
        by_owner: dict[str | None, list[int]] = collections.defaultdict(list)
        for pos, h in enumerate(hashes):
            by_owner[self.cluster.other_owner(h)].append(pos)
        out = [False] * len(hashes)
        for node, positions in by_owner.items():
            wanted = [hashes[p] for p in positions]
            if node is None:
                store = self.store
                found = await trio.to_thread.run_sync(
                    lambda: [h in store for h in wanted], limiter=self.limiter)
            else:
                try:
                    found = await self.cluster.peers.lookup(node, wanted)
                except Unavailable:
                    continue
            for p, f in zip(positions, found):
                out[p] = bool(f)
        return out

    async def fetch_all(self, ds: MountedDataset, items: list[int],
                        counters: collections.Counter[SamplerJobCounter], cause: FetchCause,
                        resident: tuple[np.ndarray, set[int]] | None = None) -> None:
        """Fetch items into the cache, for ``cause``; with ``resident`` (coop mode: every
        item's chunk, and the resident chunks), items of other chunks are only staged for
        their one read, so they cannot evict the chunks. Failed fetches count in
        ``counters`` (fetch_errors)."""
        # What the caller looked up may be a while old: items a chunk load (or another
        # job) brought in since are not fetched again.
        await self._fetch_missing(ds, await self._not_held(ds, items), counters, cause,
                                  resident)

    async def _not_held(self, ds: MountedDataset, items: list[int]) -> list[int]:
        held = await self.held([ds.digest.hash(i) for i in items])
        return [i for i, h in zip(items, held) if not h]

    async def _fetch_missing(self, ds: MountedDataset, items: list[int],
                             counters: collections.Counter[SamplerJobCounter],
                             cause: FetchCause,
                             resident: tuple[np.ndarray, set[int]] | None = None) -> None:
        if not items:
            return
        slots = trio.Semaphore(FETCH_CONCURRENCY)

        async def one(i: int) -> None:
            async with slots:
                try:
                    if resident is not None and int(resident[0][i]) not in resident[1]:
                        await self.stage(ds, i)
                    else:
                        await self.reader.fetch(ds, i, cause, recheck=True)
                except ReadFailed:
                    # the worker's own read will report it
                    counters[SamplerJobCounter.FETCH_ERRORS] += 1

        async with trio.open_nursery() as nursery:
            for i in items:
                nursery.start_soon(one, i)

    async def load(self, ds: MountedDataset, items: list[int],
                   counters: collections.Counter[SamplerJobCounter], cause: FetchCause,
                   waiting: bool = False) -> None:
        """Fetch those of a chunk load's items their owners do not hold into their
        stores, for ``cause``: those this node owns from a GCS bucket in the loader
        processes (while the store can write), the others as ``fetch_all`` does. Items a
        probed job is about to read are left to its read, a real miss (and the only
        fetch of it): when the load begins, and again as a loader process's fetch of it
        starts (the planning of a probe batch may mark it in between). Where an open
        waits on them (``waiting``: the view's misses the native plane serves), the
        processes that fetch are those of the misses readers wait on, not the niced
        ones of the loads ahead of need (AHEAD_NICENESS)."""
        pool = self.reader.pool if waiting else self.pool
        pending = self.probed.pending
        items = [i for i in await self._not_held(ds, items)
                 if not pending(ds.digest.hash(i))]
        source = None if pool is None else load_source(ds.backend)
        if (pool is None or source is None or ds.cache_mode is CacheMode.NONE
                or not self.store.writable()):
            await self._fetch_missing(ds, items, counters, cause)
            return
        mine, theirs = [], []  # theirs: fetched in mountd, as are misses' bytes kept for it
        kept = self.staging.kept_for_load
        for i in items:
            digest = ds.digest.hash(i)
            (mine if self.cluster.other_owner(digest) is None and not kept(digest)
             else theirs).append(i)
        slots = trio.Semaphore(pool.capacity)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._fetch_missing, ds, theirs, counters, cause)
            for i in mine:
                await slots.acquire()
                nursery.start_soon(self._load_one, pool, source, ds, i, counters, cause,
                                   slots)

    async def _load_one(self, pool: LoaderPool, source: LoadSource, ds: MountedDataset,
                        index: int, counters: collections.Counter[SamplerJobCounter],
                        cause: FetchCause, slots: trio.Semaphore) -> None:
        loc = ds.digest.location(index)

        async def in_pool() -> int | bytes:
            try:
                got = await pool.load(ds.reg.uid, source, ds.digest.key(index), loc.offset,
                                      loc.length, ds.digest.hash(index))
            except LoadMismatch:
                log.error("dataset %s: %s at %s (offset %d, %d bytes) does not match its "
                          "digest hash %s: the loader process did not store it", ds.name,
                          ds.digest.path(index), loc.uri, loc.offset, loc.length,
                          ds.digest.hash(index).hex())
                raise IntegrityFailed("content does not match the digest") from None
            except LoadFailed as exc:
                log.error("dataset %s: cannot fetch %s from %s: %s", ds.name,
                          ds.digest.path(index), loc.uri, exc)
                raise ReadFailed(str(exc)) from None
            self.stats.count(ds, ReadCounter.LOADER_PROCESS_FETCHES)
            return got

        try:
            if self.probed.pending(ds.digest.hash(index)):
                return  # left to the probed job's read (checked as the fetch begins)
            try:
                await self.reader.fetch_stored(ds, index, cause, in_pool)
            except LoaderUnavailable as exc:
                log.debug("dataset %s: %s: fetching %s in mountd", ds.name, exc,
                          ds.digest.path(index))
                await self.reader.fetch(ds, index, cause, recheck=True)
        except ReadFailed:
            # a read of it fetches it again, and reports it
            counters[SamplerJobCounter.FETCH_ERRORS] += 1
        finally:
            slots.release()

    async def stage(self, ds: MountedDataset, index: int) -> None:
        """Fetch an item for one coming read without caching it: it is kept in memory
        until read once (a substitutable job's miss outside the resident chunks, which
        would otherwise push the chunks' items out of the store)."""
        data = await self.reader.fetch(ds, index, FetchCause.STAGED_MISS, keep=False)
        self.staging.keep(ds.digest.hash(index), data)

    async def stage_from_peers(self, ds: MountedDataset, items: list[int]) -> None:
        """Stage items their owning peers hold, one batched get per peer, so that their
        reads do not each make a peer round trip (a substitutable job's planned hits)."""
        staging, stats = self.staging, self.stats
        by_owner: dict[str, list[bytes]] = collections.defaultdict(list)
        for i in items:
            digest = ds.digest.hash(i)
            owner = self.cluster.other_owner(digest)
            if owner is not None and digest not in staging:
                by_owner[owner].append(digest)

        async def from_peer(owner: str, hashes: list[bytes]) -> None:
            try:
                got = await self.cluster.peers.get_many(owner, hashes)
            except Unavailable:
                return  # the reads ask again, then fall back to the bucket
            stats.count(ds, ReadCounter.PEER_BATCH_GETS)
            for digest, data in zip(hashes, got):
                if data is not None:
                    stats.count(ds, ReadCounter.PEER_HITS)
                    stats.count(ds, ReadCounter.PEER_BYTES, len(data))
                    staging.keep(digest, data)

        async with trio.open_nursery() as nursery:
            for owner, hashes in by_owner.items():
                nursery.start_soon(from_peer, owner, hashes)
