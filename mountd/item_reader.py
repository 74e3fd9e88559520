"""The read path: staged bytes, the local store, the owning peer, then the item's
storage location.

Misses are single-flight: concurrent readers of a missing item cause one fetch. What a
read finds staged (``mountd.staging``), what it counts (``mountd.read_stats``) and the
items it hands to their owners (``mountd.owner_puts``) are kept in their own modules.

Runs on the trio loop; every blocking call (diskcache, backend, hashing) goes to a
worker thread bounded by one CapacityLimiter.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

import pyfuse3
import trio

from mountd.cluster import Cluster
from mountd.content_store import ContentStore, IntegrityError, StoreError
from mountd.dataset import MountedDataset
from mountd.owner_puts import OwnerPuts
from mountd.read_stats import ReadStats
from mountd.staging import Staging
from quiverfs.errors import QuietError
from quiverfs.heartbeat import CacheMode
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)


class ReadFailed(Exception):
    """An item could not be served (storage error or integrity failure); maps to EIO."""


class IntegrityFailed(ReadFailed):
    """The fetched bytes do not hash to the digest's SHA-256."""


@dataclasses.dataclass
class _Flight:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    data: bytes | None = None
    error: Exception | None = None


class ItemReader:
    """Serves item bytes by (dataset, entry) through the tiers, one fetch per missing item."""

    def __init__(self, store: ContentStore, limiter: trio.CapacityLimiter,
                 cluster: Cluster) -> None:
        self.store = store
        self.limiter = limiter
        self.cluster = cluster
        self.stats = ReadStats()
        self.staging = Staging()
        self.puts = OwnerPuts(cluster, self.stats.counters)
        self._inflight: dict[bytes, _Flight] = {}
        self._forced: set[bytes] = set()  # next read is a miss (a probed job's batch)
        # Dropping an inode's pages can wait in the kernel for a read of that inode,
        # whose handler needs a worker of ``limiter``: so it never holds one of those.
        self._invalidations = trio.CapacityLimiter(1)

    def owner(self, digest: bytes) -> str | None:
        """The node that should hold ``digest``; None when that is this node."""
        node = self.cluster.owner(digest)
        return None if node == self.cluster.me else node

    async def force_misses(self, ds: MountedDataset, items: list[int]) -> None:
        """Serve the next read of each item from storage, as if it were not cached, and
        drop the kernel's pages of it (a probed job's batch)."""
        self._forced.update(ds.digest.hash(i) for i in items)
        inodes = [ds.inode_base + ds.tree.n_dirs + i for i in items]
        await trio.to_thread.run_sync(_invalidate, inodes, limiter=self._invalidations)

    async def read(self, ds: MountedDataset, index: int) -> bytes:
        """The verified content of entry ``index`` of ``ds``."""
        digest = ds.digest.hash(index)
        staged = self.staging.take(digest)
        if staged is not None:
            self.stats.count(ds, "staged_hits")
            return staged
        if digest in self._forced:
            self._forced.discard(digest)
            self.stats.count(ds, "probe_misses")
            return await self.fetch(ds, index)
        started = time.perf_counter()
        try:
            data = await trio.to_thread.run_sync(self.store.get, digest, limiter=self.limiter)
        except StoreError as exc:
            self.stats.count(ds, "store_errors")
            log.error("dataset %s: cannot read %s from the local store: %s", ds.name,
                      ds.digest.path(index), exc)
            raise ReadFailed(f"local store: {exc}") from None
        if data is not None:
            self.stats.observe("local", time.perf_counter() - started)
            self.stats.count(ds, "local_hits")
            self.stats.count(ds, "local_bytes", len(data))
            return data
        owner = self.owner(digest)
        if owner is not None:
            started = time.perf_counter()
            try:
                data = await self.cluster.peers.get(owner, digest)
            except Unavailable:
                self.stats.count(ds, "peer_errors")
            if data is not None:
                self.stats.observe("peer", time.perf_counter() - started)
                self.stats.count(ds, "peer_hits")
                self.stats.count(ds, "peer_bytes", len(data))
                return data
            self.stats.count(ds, "peer_misses")
        self.stats.count(ds, "misses")
        return await self.fetch(ds, index)

    async def fetch(self, ds: MountedDataset, index: int, keep: bool = True) -> bytes:
        """Fetch entry ``index`` from storage (into the store unless not ``keep``);
        concurrent callers share one fetch."""
        digest = ds.digest.hash(index)
        flight = self._inflight.get(digest)
        if flight is not None:
            self.stats.count(ds, "coalesced")
            await flight.done.wait()
            if flight.data is None:
                raise ReadFailed(str(flight.error))
            return flight.data
        flight = self._inflight[digest] = _Flight()
        started = time.perf_counter()
        try:
            data = await trio.to_thread.run_sync(self._fetch_blocking, ds, index, keep,
                                                 limiter=self.limiter)
        except ReadFailed as exc:
            flight.error = exc
            self.stats.count(ds, "integrity_failures" if isinstance(exc, IntegrityFailed)
                             else "bucket_errors")
            raise
        finally:
            del self._inflight[digest]
            flight.done.set()
        self.stats.observe("bucket", time.perf_counter() - started)
        self.stats.count(ds, "bucket_fetches")
        self.stats.count(ds, "bucket_bytes", len(data))
        flight.data = data
        return data

    def _fetch_blocking(self, ds: MountedDataset, index: int, keep: bool) -> bytes:
        """Read from storage and check the hash; keep it here if this node owns it,
        else hand it to its owner (in the background)."""
        loc = ds.digest.location(index)
        try:
            data = ds.backend.read(ds.digest.key(index), loc.offset, loc.length)
        except (QuietError, OSError) as exc:
            message = exc.message if isinstance(exc, QuietError) else exc.strerror or str(exc)
            log.error("dataset %s: cannot fetch %s from %s: %s", ds.name,
                      ds.digest.path(index), loc.uri, message)
            raise ReadFailed(message) from None
        digest = ds.digest.hash(index)
        owner = self.owner(digest)
        try:
            keep = keep and ds.cache_mode is not CacheMode.NONE  # allotted no cache: keep none
            if keep and owner is None:
                # checks the hash; a store that cannot write leaves the item uncached
                self.store.put(digest, data)
            elif hashlib.sha256(data).digest() != digest:
                raise IntegrityError(digest.hex())
            elif keep:
                trio.from_thread.run_sync(self.puts.put, owner, digest, data)
        except IntegrityError:
            log.error("dataset %s: %s at %s (offset %d, %d bytes) does not match its digest "
                      "hash %s: not cached, not served", ds.name, ds.digest.path(index),
                      loc.uri, loc.offset, loc.length, ds.digest.hash(index).hex())
            raise IntegrityFailed("content does not match the digest") from None
        return data


def _invalidate(inodes: list[int]) -> None:
    for inode in inodes:
        try:
            pyfuse3.invalidate_inode(inode, attr_only=False)
        except OSError:
            pass  # the kernel holds nothing of it
