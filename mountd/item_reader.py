"""The read path: local store, the owning peer, then the item's storage location.

Misses are single-flight: concurrent readers of a missing item cause one fetch.

Runs on the trio loop; every blocking call (diskcache, backend, hashing) goes to a
worker thread bounded by one CapacityLimiter.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import Counter
from typing import Any

import pyfuse3
import trio

from mountd.content_store import ContentStore, IntegrityError
from mountd.dataset import MountedDataset
from mountd.metrics import read_latency
from quiverfs.errors import QuietError
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)

MAX_STAGED = 512 << 20  # bytes of staged items waiting for their read


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
    """Serves item bytes by (dataset, entry); counts hits, misses and bytes per tier."""

    def __init__(self, store: ContentStore, limiter: trio.CapacityLimiter) -> None:
        self.store = store
        self.limiter = limiter
        self._inflight: dict[bytes, _Flight] = {}
        self.counters: Counter[str] = Counter()
        self.latency = read_latency()  # seconds per read served, by tier
        self._forced: dict[bytes, Any] = {}  # next read is a miss, for this probed job
        self._staged: dict[bytes, bytes] = {}  # fetched for one coming read, not cached
        self._staged_bytes = 0
        self.cluster: Any = None  # mountd.cluster.Cluster, set once the daemon wires it
        self.background: trio.Nursery | None = None  # where puts to owners run

    def owner(self, digest: bytes) -> str | None:
        """The node that should hold ``digest``; None when that is this node."""
        if self.cluster is None:
            return None
        node = self.cluster.owner(digest)
        return None if node == self.cluster.me else node

    def count(self, ds: MountedDataset, key: str, n: int = 1) -> None:
        self.counters[key] += n
        ds.counters[key] += n

    async def force_misses(self, ds: MountedDataset, items: list[int], job: Any) -> None:
        """Serve the next read of each item from storage, as if it were not cached, and
        drop the kernel's pages of it (benefit probing of ``job``, a mountd.jobs.Job)."""
        for i in items:
            self._forced[ds.digest.hash(i)] = job
        job.forced_outstanding += len(items)
        inodes = [ds.inode_base + ds.tree.n_dirs + i for i in items]
        await trio.to_thread.run_sync(_invalidate, inodes, limiter=self.limiter)

    async def read(self, ds: MountedDataset, index: int) -> bytes:
        """The verified content of entry ``index`` of ``ds``."""
        digest = ds.digest.hash(index)
        staged = self._staged.pop(digest, None)
        if staged is not None:
            self._staged_bytes -= len(staged)
            self.count(ds, "staged_hits")
            return staged
        job = self._forced.pop(digest, None)
        if job is not None:
            job.forced_outstanding -= 1
            job.forced_reads += 1
            self.count(ds, "probe_misses")
            return await self.fetch(ds, index)
        started = time.perf_counter()
        data = await trio.to_thread.run_sync(self.store.get, digest, limiter=self.limiter)
        if data is not None:
            self.latency.labels("local").observe(time.perf_counter() - started)
            self.count(ds, "local_hits")
            self.count(ds, "local_bytes", len(data))
            return data
        owner = self.owner(digest)
        if owner is not None:
            started = time.perf_counter()
            try:
                data = await self.cluster.peers.get(owner, digest)
            except Unavailable:
                self.count(ds, "peer_errors")
            if data is not None:
                self.latency.labels("peer").observe(time.perf_counter() - started)
                self.count(ds, "peer_hits")
                self.count(ds, "peer_bytes", len(data))
                return data
            self.count(ds, "peer_misses")
        self.count(ds, "misses")
        return await self.fetch(ds, index)

    async def stage(self, ds: MountedDataset, index: int) -> None:
        """Fetch an item for one coming read without caching it: it is kept in memory
        until read once (a substitutable job's miss outside the resident chunks, which
        would otherwise push the chunks' items out of the store)."""
        if self._staged_bytes >= MAX_STAGED:
            await self.fetch(ds, index)  # too much waiting to be read: cache it instead
            return
        data = await self.fetch(ds, index, keep=False)
        digest = ds.digest.hash(index)
        if digest not in self._staged:
            self._staged[digest] = data
            self._staged_bytes += len(data)

    async def fetch(self, ds: MountedDataset, index: int, keep: bool = True) -> bytes:
        """Fetch entry ``index`` from storage (into the store unless not ``keep``);
        concurrent callers share one fetch."""
        digest = ds.digest.hash(index)
        flight = self._inflight.get(digest)
        if flight is not None:
            self.count(ds, "coalesced")
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
            self.count(ds, "integrity_failures" if isinstance(exc, IntegrityFailed)
                        else "bucket_errors")
            raise
        finally:
            del self._inflight[digest]
            flight.done.set()
        self.latency.labels("bucket").observe(time.perf_counter() - started)
        self.count(ds, "bucket_fetches")
        self.count(ds, "bucket_bytes", len(data))
        flight.data = data
        return data

    def _fetch_blocking(self, ds: MountedDataset, index: int, keep: bool) -> bytes:
        """Read from storage and check the hash; keep it here if this node owns it,
        else hand it to its owner (in the background)."""
        loc = ds.digest.location(index)
        try:
            data = ds.backend.read(ds.digest.key(index), loc.offset, loc.length)
        except QuietError as exc:
            log.error("dataset %s: cannot fetch %s from %s: %s", ds.name,
                      ds.digest.path(index), loc.uri, exc)
            raise ReadFailed(exc.message) from None
        digest = ds.digest.hash(index)
        owner = self.owner(digest)
        try:
            keep = keep and ds.cache_mode != "none"  # a dataset allotted no cache keeps none
            if keep and owner is None:
                self.store.put(digest, data)  # checks the hash
            elif hashlib.sha256(data).digest() != digest:
                raise IntegrityError(digest.hex())
            elif keep:
                trio.from_thread.run_sync(self._put_to_owner, owner, digest, data)
        except IntegrityError:
            log.error("dataset %s: %s at %s (offset %d, %d bytes) does not match its digest "
                      "hash %s: not cached, not served", ds.name, ds.digest.path(index),
                      loc.uri, loc.offset, loc.length, ds.digest.hash(index).hex())
            raise IntegrityFailed("content does not match the digest") from None
        return data

    def _put_to_owner(self, owner: str, digest: bytes, data: bytes) -> None:
        if self.background is not None:
            self.background.start_soon(self._put, owner, digest, data)

    async def _put(self, owner: str, digest: bytes, data: bytes) -> None:
        try:
            if await self.cluster.peers.put(owner, digest, data):
                self.counters["peer_puts"] += 1
        except Unavailable:
            self.counters["peer_put_errors"] += 1


def _invalidate(inodes: list[int]) -> None:
    for inode in inodes:
        try:
            pyfuse3.invalidate_inode(inode, attr_only=False)
        except OSError:
            pass  # the kernel holds nothing of it
