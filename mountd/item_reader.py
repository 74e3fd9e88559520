"""The read path: local store, the owning peer, then the item's storage location.

Misses are single-flight: concurrent readers of a missing item cause one fetch.

Runs on the trio loop; every blocking call (diskcache, backend, hashing) goes to a
worker thread bounded by one CapacityLimiter.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from collections import Counter

import pyfuse3
import trio

from mountd.cluster import Cluster
from mountd.content_store import ContentStore, IntegrityError, StoreError
from mountd.dataset import MountedDataset
from mountd.metrics import read_latency
from quiverfs.background import BackgroundTasks
from quiverfs.errors import QuietError
from quiverfs.heartbeat import CacheMode
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)

# Bytes of staged items waiting for their read; past it the oldest are dropped (a read
# the kernel served from its page cache never takes its staged copy).
MAX_STAGED = 256 << 20
PUT_LINGER = 0.005  # seconds items bound for one owner wait to share a put request
# Seconds a hit planned into a manifest is kept from chunk eviction while its read is
# due (a job's workers read a few batches behind its sampler).
PLANNED_GRACE = 30.0


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

    def __init__(self, store: ContentStore, limiter: trio.CapacityLimiter,
                 cluster: Cluster) -> None:
        self.store = store
        self.limiter = limiter
        self.cluster = cluster
        self._inflight: dict[bytes, _Flight] = {}
        self.counters: Counter[str] = Counter()
        self.latency = read_latency()  # seconds per read served, by tier
        self._forced: set[bytes] = set()  # next read is a miss (a probed job's batch)
        # fetched for one coming read, not cached; oldest first
        self._staged: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._staged_bytes = 0
        self.tasks = BackgroundTasks()  # where puts to owners run
        self._puts: dict[str, list[tuple[bytes, bytes]]] = {}  # by owner, not yet sent
        self._planned: dict[bytes, float] = {}  # hits in manifests, not read yet: when
        # Dropping an inode's pages can wait in the kernel for a read of that inode,
        # whose handler needs a worker of ``limiter``: so it never holds one of those.
        self._invalidations = trio.CapacityLimiter(1)

    def owner(self, digest: bytes) -> str | None:
        """The node that should hold ``digest``; None when that is this node."""
        node = self.cluster.owner(digest)
        return None if node == self.cluster.me else node

    def count(self, ds: MountedDataset, key: str, n: int = 1) -> None:
        self.counters[key] += n
        ds.counters[key] += n

    async def force_misses(self, ds: MountedDataset, items: list[int]) -> None:
        """Serve the next read of each item from storage, as if it were not cached, and
        drop the kernel's pages of it (a probed job's batch)."""
        self._forced.update(ds.digest.hash(i) for i in items)
        inodes = [ds.inode_base + ds.tree.n_dirs + i for i in items]
        await trio.to_thread.run_sync(_invalidate, inodes, limiter=self._invalidations)

    def planned(self, hashes: list[bytes]) -> None:
        """These hits were promised in a manifest: keep them until read (or a while)."""
        now = time.monotonic()
        if len(self._planned) > 100_000:
            self._planned = {h: t for h, t in self._planned.items()
                             if now - t < PLANNED_GRACE}
        self._planned.update(dict.fromkeys(hashes, now))

    def awaiting_read(self, digest: bytes) -> bool:
        """Whether a manifest promised this hit and its read has not come yet."""
        t = self._planned.get(digest)
        return t is not None and time.monotonic() - t < PLANNED_GRACE

    async def read(self, ds: MountedDataset, index: int) -> bytes:
        """The verified content of entry ``index`` of ``ds``."""
        digest = ds.digest.hash(index)
        self._planned.pop(digest, None)
        staged = self._staged.pop(digest, None)
        if staged is not None:
            self._staged_bytes -= len(staged)
            self.count(ds, "staged_hits")
            return staged
        if digest in self._forced:
            self._forced.discard(digest)
            self.count(ds, "probe_misses")
            return await self.fetch(ds, index)
        started = time.perf_counter()
        try:
            data = await trio.to_thread.run_sync(self.store.get, digest, limiter=self.limiter)
        except StoreError as exc:
            self.count(ds, "store_errors")
            log.error("dataset %s: cannot read %s from the local store: %s", ds.name,
                      ds.digest.path(index), exc)
            raise ReadFailed(f"local store: {exc}") from None
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
        self._keep_staged(ds.digest.hash(index), await self.fetch(ds, index, keep=False))

    async def stage_from_peers(self, ds: MountedDataset, items: list[int]) -> None:
        """Stage items their owning peers hold, one batched get per peer, so that their
        reads do not each make a peer round trip (a substitutable job's planned hits)."""
        by_owner: dict[str, list[bytes]] = collections.defaultdict(list)
        for i in items:
            digest = ds.digest.hash(i)
            owner = self.owner(digest)
            if owner is not None and digest not in self._staged:
                by_owner[owner].append(digest)

        async def from_peer(owner: str, hashes: list[bytes]) -> None:
            try:
                got = await self.cluster.peers.get_many(owner, hashes)
            except Unavailable:
                return  # the reads ask again, then fall back to the bucket
            self.count(ds, "peer_batch_gets")
            for digest, data in zip(hashes, got):
                if data is not None:
                    self.count(ds, "peer_hits")
                    self.count(ds, "peer_bytes", len(data))
                    self._keep_staged(digest, data)

        async with trio.open_nursery() as nursery:
            for owner, hashes in by_owner.items():
                nursery.start_soon(from_peer, owner, hashes)

    def _keep_staged(self, digest: bytes, data: bytes) -> None:
        if digest in self._staged:
            return
        self._staged[digest] = data
        self._staged_bytes += len(data)
        while self._staged_bytes > MAX_STAGED and len(self._staged) > 1:
            _, old = self._staged.popitem(last=False)
            self._staged_bytes -= len(old)

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
                trio.from_thread.run_sync(self._put_to_owner, owner, digest, data)
        except IntegrityError:
            log.error("dataset %s: %s at %s (offset %d, %d bytes) does not match its digest "
                      "hash %s: not cached, not served", ds.name, ds.digest.path(index),
                      loc.uri, loc.offset, loc.length, ds.digest.hash(index).hex())
            raise IntegrityFailed("content does not match the digest") from None
        return data

    def _put_to_owner(self, owner: str, digest: bytes, data: bytes) -> None:
        """Queue an item for its owner; the first one queued starts the batch's sender."""
        if not self.tasks.running:
            return
        queued = self._puts.setdefault(owner, [])
        queued.append((digest, data))
        if len(queued) == 1:
            self.tasks.start_soon(self._send_puts, owner)

    async def _send_puts(self, owner: str) -> None:
        await trio.sleep(PUT_LINGER)  # a chunk load's concurrent fetches join the batch
        items = self._puts.pop(owner)
        try:
            stored = await self.cluster.peers.put_many(owner, items)
        except Unavailable:
            self.counters["peer_put_errors"] += len(items)
            return
        self.counters["peer_puts"] += sum(stored)
        self.counters["peer_put_requests"] += 1


def _invalidate(inodes: list[int]) -> None:
    for inode in inodes:
        try:
            pyfuse3.invalidate_inode(inode, attr_only=False)
        except OSError:
            pass  # the kernel holds nothing of it
