"""mountd's side of the native data plane (mountd/native): the threads that answer the
datasets' connection's READ, LOOKUP and GETATTR in C, and what Python keeps for them.

Python keeps the policy. It registers each mounted dataset's tree with the plane (a
view's too, with its pools: its name is a link on this connection, served here, and its
files are ROOT/.quiver's, mountd.fs.native_views), tells it which items are stored and
verified (the store's ``VerifiedDigests`` reports each, with its value file), and
withdraws an item when the store drops it, the scrubber finds it changed, or a probe
needs its next read to miss. Every request the plane does not answer (misses, the root,
listings, extended attributes, INIT) reaches the Python handlers as before, through the
patched pyfuse3's session loop. ``drain`` brings the plane's hits to the store's recency
and the read counters, and its request counts to ``fuse_requests``.

Where the module is missing (not built, another Python) or cannot attach, mountd serves
through Python and says so once in its log; ``quiver status`` names the data path.
"""
from __future__ import annotations

import array
import enum
import hashlib
import logging
import math
import os
from collections import Counter

import numpy as np
import pyfuse3
import trio

from mountd.datasets.dataset import MountedDataset
from mountd.datasets.mount_table import MountTable
from mountd.fetch.integrity_budget import IntegrityBudget
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from mountd.store.content_store import ContentStore
from quiverfs.counters import ReadCounter

log = logging.getLogger(__name__)

# The plane's request counts, by the opcode names of pyfuse3's handlers
# (ReadStats.fuse_requests), which they are added to.
_REQUESTS = {"lookups": "lookup", "getattrs": "getattr", "reads": "read", "forgets": "forget",
             "opens": "open", "releases": "release"}


class DataPath(enum.StrEnum):
    """How cached dataset files are served (``--data-path``)."""

    NATIVE = "native"  # the plane's threads read the store's files, Python the rest
    PASSTHROUGH = "passthrough"  # the plane opens them, and the kernel reads them
    PYTHON = "python"  # every request through pyfuse3's handlers


class NativePlane:
    """The plane of one mountd, and the store's and mount table's news for it."""

    def __init__(self, plane: object, threads: int, table: MountTable, store: ContentStore,
                 stats: ReadStats, integrity: IntegrityBudget, staging: Staging,
                 limiter: trio.CapacityLimiter) -> None:
        self.plane = plane
        self.staging = staging  # hits promised in manifests: a READ here fulfils one
        self.threads = threads
        self.limiter = limiter  # mountd's workers: trees built and handed over
        self.table = table
        self.store = store
        self.stats = stats
        self.integrity = integrity
        self._registered: dict[int, MountedDataset] = {}  # inode base -> dataset
        self._suspended: set[int] = set()
        self._counted: Counter[str] = Counter()  # the plane's counters, as last drained
        self.passthrough = False  # OPENs answered with backing files (use_passthrough)
        # the mount table's changes (added?, dataset), carried out in order by ``run``
        self._changes_in, self._changes_out = trio.open_memory_channel[
            tuple[bool, MountedDataset]](math.inf)
        self._settled: dict[int, trio.Event] = {}  # inode base -> set once added (or not)

    @classmethod
    def create(cls, threads: int, root_timeout: float, timeout: float, table: MountTable,
               store: ContentStore, stats: ReadStats, integrity: IntegrityBudget,
               staging: Staging, limiter: trio.CapacityLimiter) -> NativePlane | None:
        """The plane, or None (logged) where the native module cannot be loaded."""
        try:
            from mountd.native import _dataplane  # noqa: PLC0415 (built by make; optional)
        except ImportError as exc:
            log.warning("the native data plane is not available (%s; 'make native' builds "
                        "it): dataset files are served through Python", exc)
            return None
        plane = _dataplane.Plane(store.directory, threads, root_timeout, timeout)
        return cls(plane, threads, table, store, stats, integrity, staging, limiter)

    def use_passthrough(self, on: bool) -> None:
        """Answer OPENs of served items with their value files as FUSE passthrough
        backing files (set before the kernel's INIT is answered)."""
        self.passthrough = on
        self.plane.set_passthrough(on)

    def passthrough_offered(self) -> bool:
        """Whether the kernel's INIT offered passthrough (once INIT was read)."""
        return self.plane.passthrough_offered()

    def attach(self) -> bool:
        """Start the plane's threads on the mounted session (after ``pyfuse3.init``,
        before ``pyfuse3.main``). False (logged) where it cannot."""
        try:
            self.plane.attach(pyfuse3.session_address())
        except (OSError, RuntimeError, AttributeError) as exc:
            log.warning("the native data plane cannot attach to the FUSE session (%s): "
                        "dataset files are served through Python", exc)
            return False
        self.table.watchers.append(self)
        self.stats.sources.append(self.drain)
        self.store.verified.watcher = self
        for ds in self.table.by_name.values():  # restored before the mount
            self.mounted(ds)
        log.info("native data plane: %d threads serve cached dataset files", self.threads)
        return True

    def stop(self) -> None:
        """Join the threads and close the session's /dev/fuse descriptor (before the
        unmount). Blocking, briefly."""
        self.plane.stop()

    # -- the mount table's news (MountTable.watchers) ---------------------------------
    def mounted(self, ds: MountedDataset) -> None:
        """Give the plane ``ds``'s tree, in the background (a worker builds it: the
        loop must not wait for a large digest); ``settle`` waits for it."""
        self._settled[ds.inode_base] = trio.Event()
        self._changes_in.send_nowait((True, ds))

    def unmounted(self, ds: MountedDataset) -> None:
        self._changes_in.send_nowait((False, ds))

    async def settle(self, ds: MountedDataset) -> None:
        """Return once the plane serves ``ds`` (or has given up: Python serves it)."""
        event = self._settled.get(ds.inode_base)
        if event is not None:
            await event.wait()

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Carry out the mount table's changes, in their order."""
        task_status.started()
        async for added, ds in self._changes_out:
            if not added:
                if self._registered.pop(ds.inode_base, None) is not None:
                    self._suspended.discard(ds.inode_base)
                    await trio.to_thread.run_sync(self.plane.remove_dataset, ds.inode_base,
                                                  limiter=self.limiter)
                continue
            try:
                await self._add(ds)
            finally:
                self._settled.pop(ds.inode_base).set()

    async def _add(self, ds: MountedDataset) -> None:
        # one tree per digest, however many datasets are registered from it
        identity = hashlib.sha256(ds.reg.identity.encode()).digest()
        tree = (None if self.plane.has_tree(identity)
                else await trio.to_thread.run_sync(_tree_arrays, ds, limiter=self.limiter))
        pools = (None if ds.pools is None
                 else np.ascontiguousarray(ds.pools.pool_of, dtype=np.uint32))
        try:
            await trio.to_thread.run_sync(
                self.plane.add_dataset, ds.inode_base, identity, ds.reg.uid, ds.reg.gid,
                int(ds.reg.registered_at * 1e9), tree, pools, limiter=self.limiter)
        except (OSError, ValueError) as exc:  # out of memory: Python serves it all
            log.warning("dataset %s is served through Python: the native data plane "
                        "cannot take its tree (%s)", ds.name, exc)
            return
        self._registered[ds.inode_base] = ds
        await trio.to_thread.run_sync(self._serve_verified, ds, limiter=self.limiter)

    def _serve_verified(self, ds: MountedDataset) -> None:
        """What this run has verified of ``ds`` is served at once (a worker's call)."""
        verified = self.store.verified
        for i in range(len(ds.digest)):
            h = ds.digest.hash(i)
            if h in verified:
                self.verified(h)

    # -- the store's news (VerifiedDigests.watcher) ----------------------------------
    def verified(self, digest: bytes) -> None:
        """``digest`` is stored and verified: served natively where its value file is
        known (an item kept in the index itself stays Python's)."""
        name = self.store.files.name(digest)
        if name is not None:
            self.plane.serve(digest, name)

    def withdrawn(self, digest: bytes) -> None:
        """``digest`` is no longer verified (dropped): its next READ goes to Python.
        Does not wait for READs in flight (its file's name is its own)."""
        self.plane.withdraw(digest, False)

    def withdraw_now(self, digest: bytes) -> None:
        """Withdraw ``digest`` and wait for its READs and OPENs in flight (blocking: a
        worker thread's call): no reply with its bytes is sent after."""
        self.plane.withdraw(digest, True)

    # -- what the plane did -----------------------------------------------------------
    def drain(self) -> None:
        """The plane's hits since the last call to the store's recency and each
        dataset's counters, its request counts to ``fuse_requests``, and suspensions
        to the plane (a suspended dataset's READs go to Python, which refuses them)."""
        for inode, seconds in self.plane.drain_hits():
            found = self.table.resolve(inode)
            if found is None:
                continue  # unmounted since
            ds, node = found
            self.stats.observe("local", seconds)
            index = ds.tree.entry_index(node)
            h = ds.digest.hash(index)
            self.staging.take(h)  # read: a chunk's eviction need not keep it for the read
            self.store.recency.hit(h)
            self.store.files.seen(h)
            self.stats.count(ds, ReadCounter.LOCAL_HITS)
            self.stats.count(ds, ReadCounter.LOCAL_BYTES, ds.digest.sizes[index])
        counters = self.plane.counters()
        for key, opcode in _REQUESTS.items():
            if counters[key] != self._counted[key]:
                self.stats.fuse_requests[opcode] += counters[key] - self._counted[key]
        self._counted = Counter(counters)
        self.stats.native = counters
        for base, ds in self._registered.items():
            suspended = self.integrity.suspended(ds)
            if suspended != (base in self._suspended):
                self.plane.suspend(base, suspended)
                (self._suspended.add if suspended else self._suspended.discard)(base)


def _tree_arrays(ds: MountedDataset) -> tuple:
    """``ds``'s tree as ``Plane.add_dataset`` takes it (a worker's call: a loop over
    every entry)."""
    tree, digest = ds.tree, ds.digest
    n_files = len(digest)
    parents = array.array("I", tree.parents)
    parents.extend(tree.file_parent)
    names = bytearray()
    ends = array.array("I", [0])
    dir_names = [b""] * tree.n_dirs
    for children in tree.children:
        for name, child in children.items():
            if child < tree.n_dirs:
                dir_names[child] = os.fsencode(name)
    for name in dir_names[1:]:
        names += name
        ends.append(len(names))
    for i in range(n_files):
        names += os.fsencode(digest.path(i).rpartition("/")[2])
        ends.append(len(names))
    sizes = array.array("Q", (digest.sizes[i] for i in range(n_files)))
    hashes = b"".join(digest.hash(i) for i in range(n_files))
    return (tree.n_dirs, n_files, parents, names, ends, sizes, hashes)
