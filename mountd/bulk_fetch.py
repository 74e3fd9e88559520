"""Items in bulk for the batch planner and the chunk loader: which of many hashes
their owners hold (this node's store, or a peer), and fetching many items at once."""
from __future__ import annotations

import collections

import numpy as np
import trio

from mountd.cluster import Cluster
from mountd.dataset import MountedDataset
from mountd.item_reader import ItemReader, ReadFailed
from quiverfs.rpc import Unavailable

FETCH_CONCURRENCY = 16  # misses fetched at once for one batch or one chunk load


class BulkFetch:
    """Look-ups and fetches of many items, through the item reader's tiers."""

    def __init__(self, reader: ItemReader, cluster: Cluster) -> None:
        self.reader = reader
        self.cluster = cluster

    async def held(self, hashes: list[bytes]) -> list[bool]:
        """Which hashes their owners hold (this node's store, or a peer's); a peer that
        cannot be asked counts as holding nothing."""
        by_owner: dict[str | None, list[int]] = collections.defaultdict(list)
        for pos, h in enumerate(hashes):
            by_owner[self.reader.owner(h)].append(pos)
        out = [False] * len(hashes)
        for node, positions in by_owner.items():
            wanted = [hashes[p] for p in positions]
            if node is None:
                store = self.reader.store
                found = await trio.to_thread.run_sync(
                    lambda: [h in store for h in wanted], limiter=self.reader.limiter)
            else:
                try:
                    found = await self.cluster.peers.lookup(node, wanted)
                except Unavailable:
                    continue
            for p, f in zip(positions, found):
                out[p] = bool(f)
        return out

    async def fetch_all(self, ds: MountedDataset, items: list[int],
                        counters: collections.Counter[str],
                        resident: tuple[np.ndarray, set[int]] | None = None) -> None:
        """Fetch items into the cache; with ``resident`` (coop mode: every item's chunk,
        and the resident chunks), items of other chunks are only staged for their one
        read, so they cannot evict the chunks."""
        if not items:
            return
        slots = trio.Semaphore(FETCH_CONCURRENCY)

        async def one(i: int) -> None:
            async with slots:
                try:
                    if resident is not None and int(resident[0][i]) not in resident[1]:
                        await self.stage(ds, i)
                    else:
                        await self.reader.fetch(ds, i)
                except ReadFailed:
                    counters["fetch_errors"] += 1  # the worker's own read will report it

        async with trio.open_nursery() as nursery:
            for i in items:
                nursery.start_soon(one, i)

    async def stage(self, ds: MountedDataset, index: int) -> None:
        """Fetch an item for one coming read without caching it: it is kept in memory
        until read once (a substitutable job's miss outside the resident chunks, which
        would otherwise push the chunks' items out of the store)."""
        data = await self.reader.fetch(ds, index, keep=False)
        self.reader.staging.keep(ds.digest.hash(index), data)

    async def stage_from_peers(self, ds: MountedDataset, items: list[int]) -> None:
        """Stage items their owning peers hold, one batched get per peer, so that their
        reads do not each make a peer round trip (a substitutable job's planned hits)."""
        staging, stats = self.reader.staging, self.reader.stats
        by_owner: dict[str, list[bytes]] = collections.defaultdict(list)
        for i in items:
            digest = ds.digest.hash(i)
            owner = self.reader.owner(digest)
            if owner is not None and digest not in staging:
                by_owner[owner].append(digest)

        async def from_peer(owner: str, hashes: list[bytes]) -> None:
            try:
                got = await self.cluster.peers.get_many(owner, hashes)
            except Unavailable:
                return  # the reads ask again, then fall back to the bucket
            stats.count(ds, "peer_batch_gets")
            for digest, data in zip(hashes, got):
                if data is not None:
                    stats.count(ds, "peer_hits")
                    stats.count(ds, "peer_bytes", len(data))
                    staging.keep(digest, data)

        async with trio.open_nursery() as nursery:
            for owner, hashes in by_owner.items():
                nursery.start_soon(from_peer, owner, hashes)
