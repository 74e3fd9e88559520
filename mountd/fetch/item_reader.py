"""The read path: staged bytes, the local store, the owning peer, then the item's
storage location.

Misses are single-flight: concurrent readers of a missing item cause one fetch, and a
fetch's flight lasts until its bytes are stored, so a read meanwhile joins it. A miss
from a GCS bucket is fetched and checked in a loader process (``mountd.fetch.loader_pool``),
whose reply brings the bytes before the store has them; other misses, and those the
processes cannot take, are fetched in mountd's fetch threads. Each dataset has at most
its ``fetch_depth`` fetches in flight; loader slots, fetch threads and the reads waiting
for a fetch are shared fairly by uid (``mountd.fetch.fair_share``). What a read finds
staged (``mountd.fetch.staging``), what it counts (``mountd.fetch.read_stats``) and the
items it hands to their owners (``mountd.fetch.owner_puts``) are kept in their own
modules.

Runs on the trio loop; every blocking call goes to a worker thread: a storage read (and
its hashing and storing) to a fetch thread, the rest (diskcache, the store's files) to
mountd's workers, bounded by one CapacityLimiter that no fetch holds, so that a hit
never waits for a miss.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import NoReturn

import trio

from mountd.cluster.membership import Cluster
from mountd.datasets.dataset import MountedDataset
from mountd.fetch.demand import Demand
from mountd.fetch.fair_share import FetchThreads, TooManyWaiting, WaitingReads
from mountd.fetch.integrity_budget import IntegrityBudget
from mountd.fetch.loader_pool import (LoaderPool, LoaderUnavailable, LoadFailed, LoadMismatch,
                                      load_source)
from mountd.fetch.loader_process import LoadSource
from mountd.fetch.owner_puts import OwnerPuts
from mountd.fetch.probed import ProbedReads
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from mountd.store.content_store import ContentStore
from mountd.store.errors import IntegrityError, StoreError
from quiverfs.backends import Backend
from quiverfs.counters import FetchCause, ReadCounter
from quiverfs.errors import QuietError
from quiverfs.heartbeat import CacheMode
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)

LOCAL_FETCH_DEPTH = 8  # a local directory's fetches in flight, per dataset


class ReadFailed(Exception):
    """An item could not be served (storage error or integrity failure); maps to EIO."""


class IntegrityFailed(ReadFailed):
    """The fetched bytes do not hash to the digest's SHA-256."""


@dataclasses.dataclass
class _Flight:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    data: bytes | None = None
    stored: bool = False  # stored by a loader process, which kept the bytes
    error: Exception | None = None  # a ReadFailed; with none of the three, fetch again
    storing: bool = False  # ``data`` is in, a loader process is storing it: still held


class ItemReader:
    """Serves item bytes by (dataset, entry) through the tiers, one fetch per missing item."""

    def __init__(self, store: ContentStore, limiter: trio.CapacityLimiter, cluster: Cluster,
                 stats: ReadStats, staging: Staging, integrity: IntegrityBudget,
                 puts: OwnerPuts, probed: ProbedReads, pool: LoaderPool | None = None,
                 threads: FetchThreads | None = None, waiting: WaitingReads | None = None
                 ) -> None:
        self.store = store
        self.limiter = limiter  # short blocking work: store reads
        # storage reads in mountd (None: as many threads as ``limiter``'s, of their own)
        self.threads = threads or FetchThreads(int(limiter.total_tokens))
        self.waiting = waiting  # bounds each uid's reads waiting for a fetch; None: no bound
        self.cluster = cluster
        self.stats = stats
        self.staging = staging
        self.integrity = integrity
        self.puts = puts
        self.probed = probed
        self.pool = pool  # loader processes for misses from GCS; None: all in mountd
        self.demand = Demand()  # the datasets allotted full being filled now
        self._inflight: dict[bytes, _Flight] = {}

    def expect_misses(self, backend: Backend) -> None:
        """A dataset on ``backend`` is mounted: where its misses go to loader processes,
        start them now rather than at its first miss."""
        if self.pool is not None and load_source(backend) is not None:
            self.pool.want()

    def fetch_depth(self, backend: Backend) -> int:
        """Fetches of one dataset from ``backend`` in flight at once: a GCS bucket's
        (tens of milliseconds to a first byte each) as many as the loader processes
        serving misses hold; a local directory's few, in mountd's fetch threads."""
        if self.pool is not None and load_source(backend) is not None:
            return self.pool.capacity
        workers = self.threads.total
        return min(LOCAL_FETCH_DEPTH, workers) if backend.uri.startswith("file://") else workers

    def in_hand(self, digest: bytes) -> bool:
        """Whether a fetch of ``digest`` is under way (a read of it would join it), or
        an uncached miss's bytes are kept for its chunk's load (a probe that read it
        again would fetch what the load has already)."""
        return digest in self._inflight or self.staging.kept_for_load(digest)

    async def read(self, ds: MountedDataset, index: int, cause: FetchCause = FetchCause.EXACT,
                   keep: bool = True) -> bytes:
        """The verified content of entry ``index`` of ``ds``; a miss is fetched for
        ``cause``, and cached where ``keep``. Content that hashes right but is not the
        entry's size fails like content that does not: served to the entry's size, it
        would be bytes the hash does not cover."""
        self._check_not_suspended(ds)
        data = await self._read(ds, index, cause, keep)
        if len(data) != ds.digest.sizes[index]:
            self._integrity_failed(ds)
            log.error("dataset %s: %s is %d bytes in its digest, but the content of its "
                      "hash %s is %d: not served", ds.name, ds.digest.path(index),
                      ds.digest.sizes[index], ds.digest.hash(index).hex(), len(data))
            raise IntegrityFailed("content is not the digest's size")
        return data

    def _check_not_suspended(self, ds: MountedDataset) -> None:
        if self.integrity.suspended(ds):
            self.stats.count(ds, ReadCounter.SUSPENDED_READS)
            raise ReadFailed(f"dataset {ds.name} is suspended: too many failed hash checks")

    def _integrity_failed(self, ds: MountedDataset) -> None:
        self.stats.count(ds, ReadCounter.INTEGRITY_FAILURES)
        self.integrity.failed(ds)

    async def _read(self, ds: MountedDataset, index: int, cause: FetchCause,
                    keep: bool) -> bytes:
        digest = ds.digest.hash(index)
        probed = self.probed.take(digest)
        if probed is not None:
            cause, keep = probed
            if cause is FetchCause.PROBE:
                self.stats.count(ds, ReadCounter.PROBE_MISSES)
                return await self._waited_fetch(ds, index, cause, keep)
        data = await self._cached(ds, index, digest)
        if data is None:
            self.stats.count(ds, ReadCounter.MISSES)
            return await self._waited_fetch(ds, index, cause, keep)
        if probed is not None:  # a probe planned a miss that was none: it measures less
            self.stats.count(ds, ReadCounter.PROBE_HITS)
        return data

    async def _waited_fetch(self, ds: MountedDataset, index: int, cause: FetchCause,
                            keep: bool) -> bytes:
        """A read's miss, fetched while the dataset's uid has room for one more read
        waiting (ReadFailed at once where it has not)."""
        if self.waiting is None:
            return await self.fetch(ds, index, cause, keep=keep)
        try:
            with self.waiting.hold(ds.reg.uid):
                return await self.fetch(ds, index, cause, keep=keep)
        except TooManyWaiting as exc:
            raise ReadFailed(str(exc)) from None

    async def _cached(self, ds: MountedDataset, index: int, digest: bytes) -> bytes | None:
        """Entry ``index`` (``digest``) staged, from the local store or from its owning
        peer; None if none of them has it."""
        staged = self.staging.take(digest)
        if staged is not None:
            self.stats.count(ds, ReadCounter.STAGED_HITS)
            return staged
        started = time.perf_counter()
        data = self.store.get_nowait(digest, ds.digest.sizes[index])
        try:
            if data is None:
                data = await trio.to_thread.run_sync(self.store.get, digest,
                                                     limiter=self.limiter)
        except StoreError as exc:
            self.stats.count(ds, ReadCounter.STORE_ERRORS)
            log.error("dataset %s: cannot read %s from the local store: %s", ds.name,
                      ds.digest.path(index), exc)
            raise ReadFailed(f"local store: {exc}") from None
        if data is not None:
            self.stats.observe("local", time.perf_counter() - started)
            self.stats.count(ds, ReadCounter.LOCAL_HITS)
            self.stats.count(ds, ReadCounter.LOCAL_BYTES, len(data))
            return data
        owner = self.cluster.other_owner(digest)
        if owner is not None:
            started = time.perf_counter()
            try:
                data = await self.cluster.peers.get(owner, digest)
            except Unavailable:
                self.stats.count(ds, ReadCounter.PEER_ERRORS)
            if data is not None:
                self.stats.observe("peer", time.perf_counter() - started)
                self.stats.count(ds, ReadCounter.PEER_HITS)
                self.stats.count(ds, ReadCounter.PEER_BYTES, len(data))
                return data
            self.stats.count(ds, ReadCounter.PEER_MISSES)
        return None

    async def fetch(self, ds: MountedDataset, index: int, cause: FetchCause,
                    keep: bool = True, recheck: bool = False) -> bytes:
        """Fetch entry ``index`` from storage (into the store unless not ``keep``), for
        ``cause``; concurrent callers share one fetch (counted once, for the first).
        ``recheck`` where the caller's look-up may be a while old (a chunk load's items
        wait for a slot; jobs plan misses side by side): the fetch looks in the store
        once more, in its fetch thread, and an item another fetch stored since is not read
        again."""
        self._check_not_suspended(ds)
        digest = ds.digest.hash(index)
        while (flight := self._inflight.get(digest)) is not None:
            self.stats.count(ds, ReadCounter.COALESCED)
            data = await self._joined(flight, digest)
            if data is not None:
                return data
        flight = self._inflight[digest] = _Flight()
        # An uncached miss of bytes kept for the load serves them (a probe's miss must
        # be a real one: it reads the bucket); a miss that caches them takes them.
        kept = (self.staging.take_for_load(digest) if keep
                else None if cause is FetchCause.PROBE else self.staging.kept_bytes(digest))
        started = time.perf_counter()
        with (self._flying(ds, digest, flight),
              self.demand.fetching(ds.reg.uid, ds.reg.identity, ds.cache_mode, cause)):
            async with ds.fetch_slots:
                # bytes kept for a load are not the bucket's: not metered
                with self._metered() if kept is None else contextlib.nullcontext([]) as got:
                    data, fetched = await self._fetched(ds, index, keep, kept, recheck,
                                                        flight)
                    got.append(len(data) if fetched else 0)
        if fetched:
            self.stats.observe("bucket", time.perf_counter() - started)
            self.stats.fetched(ds, cause, len(data))
        else:
            self.stats.count(ds, ReadCounter.REFETCHES_SAVED)
        flight.data = data
        if not keep and ds.cache_mode is CacheMode.COOP:
            self.staging.keep_for_load(digest, data)  # its chunk's load stores these
        return data

    async def _fetched(self, ds: MountedDataset, index: int, keep: bool, kept: bytes | None,
                       recheck: bool, flight: _Flight) -> tuple[bytes, bool]:
        """A miss's bytes, checked, and whether they were read from storage: in a
        loader process where it can, else (and once more where its process exited
        mid-fetch) in a fetch thread."""
        source = None if kept is not None or self.pool is None else load_source(ds.backend)
        if source is not None:
            got = await self._fetched_in_pool(ds, index, keep, recheck, flight, source)
            if got is not None:
                return got
        return await self.threads.run(ds.reg.uid, self._fetch_blocking, ds, index, keep, kept,
                                      recheck)

    async def _fetched_in_pool(self, ds: MountedDataset, index: int, keep: bool,
                               recheck: bool, flight: _Flight,
                               source: LoadSource) -> tuple[bytes, bool] | None:
        """Fetch and check entry ``index`` in a loader process, which stores it where
        this node keeps it (``flight`` is held until the store's outcome is in). None
        where a fetch thread is to fetch it: a process exited mid-fetch, or, with
        ``recheck``, the store may hold it since (the thread reads it from there)."""
        assert self.pool is not None
        digest = ds.digest.hash(index)
        owner = self.cluster.other_owner(digest)
        if recheck and owner is None and self.store.held_known(digest):
            return None
        keep = keep and ds.cache_mode is not CacheMode.NONE  # allotted no cache: keep none
        store = keep and owner is None and self.store.writable()

        def stored() -> None:
            if self._inflight.get(digest) is flight:
                del self._inflight[digest]

        loc = ds.digest.location(index)
        try:
            data, flight.storing = await self.pool.fetch(
                ds.reg.uid, source, ds.digest.key(index), loc.offset, loc.length, digest,
                store, stored)
        except LoaderUnavailable as exc:
            log.warning("dataset %s: %s: fetching %s in mountd", ds.name, exc,
                        ds.digest.path(index))
            return None
        except LoadMismatch:
            self._mismatch(ds, index)
        except LoadFailed as exc:
            log.error("dataset %s: cannot fetch %s from %s: %s", ds.name,
                      ds.digest.path(index), loc.uri, exc)
            raise ReadFailed(str(exc)) from None
        self.stats.count(ds, ReadCounter.LOADER_PROCESS_MISSES)
        if keep and owner is not None:
            self.puts.put(owner, digest, data)
        return data, True

    async def fetch_stored(self, ds: MountedDataset, index: int, cause: FetchCause,
                           fetch: Callable[[], Awaitable[int | bytes]]) -> None:
        """Fetch entry ``index`` into the store for ``cause`` with ``fetch`` (a loader
        process's load), single-flight with every other fetch of it. ``fetch`` stores it
        and returns the number of bytes, or returns the bytes it could not store; it
        raises ReadFailed as ``fetch`` does, or anything else to leave it unfetched."""
        self._check_not_suspended(ds)
        digest = ds.digest.hash(index)
        flight = self._inflight.get(digest)
        if flight is not None:  # a read fetches it already
            self.stats.count(ds, ReadCounter.COALESCED)
            await flight.done.wait()
            if flight.error is not None:
                raise ReadFailed(str(flight.error))
            return
        if self.store.held_known(digest):  # stored since the caller looked
            self.stats.count(ds, ReadCounter.REFETCHES_SAVED)
            return
        flight = self._inflight[digest] = _Flight()
        started = time.perf_counter()
        with self._flying(ds, digest, flight), self._metered() as fetched:
            got = await fetch()
            fetched.append(len(got) if isinstance(got, bytes) else got)
        self.stats.observe("bucket", time.perf_counter() - started)
        if isinstance(got, bytes):
            self.stats.fetched(ds, cause, len(got))
            flight.data = got
        else:
            self.stats.fetched(ds, cause, got)
            flight.stored = True

    @contextlib.contextmanager
    def _metered(self) -> Iterator[list[int]]:
        """Time a fetch for the bucket's bandwidth; its bytes go into the list yielded
        (none: it failed, or read nothing from the bucket)."""
        got: list[int] = []
        self.stats.bucket.begin()
        try:
            yield got
        finally:
            self.stats.bucket.end(sum(got))

    @contextlib.contextmanager
    def _flying(self, ds: MountedDataset, digest: bytes, flight: _Flight) -> Iterator[None]:
        """Hold ``flight`` for ``digest`` while the fetch runs; count its failure."""
        try:
            yield
        except ReadFailed as exc:
            flight.error = exc
            if isinstance(exc, IntegrityFailed):
                self._integrity_failed(ds)
            else:
                self.stats.count(ds, ReadCounter.BUCKET_ERRORS)
            raise
        finally:
            if not flight.storing:
                del self._inflight[digest]
            flight.done.set()

    async def _joined(self, flight: _Flight, digest: bytes) -> bytes | None:
        """What another caller's flight fetched: its bytes, or None if it ended without
        them (and the store no longer has what a loader process stored)."""
        await flight.done.wait()
        if flight.error is not None:
            raise ReadFailed(str(flight.error))
        if not flight.stored:
            return flight.data
        try:
            return await trio.to_thread.run_sync(self.store.get, digest, limiter=self.limiter)
        except StoreError as exc:
            raise ReadFailed(f"local store: {exc}") from None

    def _fetch_blocking(self, ds: MountedDataset, index: int, keep: bool,
                        data: bytes | None, recheck: bool) -> tuple[bytes, bool]:
        """Read from storage (unless ``data``, a miss's bytes kept, is given) and check
        the hash; keep it here if this node owns it, else hand it to its owner (in the
        background). With ``recheck``, an item this node's store took since the caller
        looked is read from there instead. Returns the bytes, and whether they were
        read from storage."""
        digest = ds.digest.hash(index)
        owner = self.cluster.other_owner(digest)
        if recheck and owner is None and (stored := self.store.get(digest)) is not None:
            return stored, False
        fetched = data is None
        loc = ds.digest.location(index)
        if data is None:
            try:
                data = ds.backend.read(ds.digest.key(index), loc.offset, loc.length)
            except (QuietError, OSError) as exc:
                message = (exc.message if isinstance(exc, QuietError)
                           else exc.strerror or str(exc))
                log.error("dataset %s: cannot fetch %s from %s: %s", ds.name,
                          ds.digest.path(index), loc.uri, message)
                raise ReadFailed(message) from None
        try:
            keep = keep and ds.cache_mode is not CacheMode.NONE  # allotted no cache: keep none
            if keep and owner is None:
                # checks the hash, and stores it without the read waiting for the store
                self.store.put_soon(digest, data)
            elif hashlib.sha256(data).digest() != digest:
                raise IntegrityError(digest.hex())
            elif keep:
                trio.from_thread.run_sync(self.puts.put, owner, digest, data)
        except IntegrityError:
            self._mismatch(ds, index)
        return data, fetched

    def _mismatch(self, ds: MountedDataset, index: int) -> NoReturn:
        loc = ds.digest.location(index)
        log.error("dataset %s: %s at %s (offset %d, %d bytes) does not match its digest "
                  "hash %s: not cached, not served", ds.name, ds.digest.path(index),
                  loc.uri, loc.offset, loc.length, ds.digest.hash(index).hex())
        raise IntegrityFailed("content does not match the digest") from None

