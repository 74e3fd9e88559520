"""What the control socket can ask of mountd: mount, umount, status, prefetch."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import pyfuse3
import trio

from mountd.cluster.peers import PeerService
from mountd.control.mount_options import check_gcs_credentials, mount_request, try_credentials
from mountd.control.quotas import Quota
from mountd.control.server import Peer
from mountd.datasets.dataset import MountedDataset, PrefetchProgress
from mountd.datasets.memory_budget import DigestCost, Held, MemoryBudget, charged, digest_cost
from mountd.datasets.mount_table import MountTable
from mountd.datasets.pools import has_labels
from mountd.datasets.registry import Registration, Registry, new_registration
from mountd.datasets.shared_digests import SharedDigests
from mountd.fetch.item_reader import ReadFailed
from mountd.fetch.fetch_stop import stop_fetches
from mountd.fetch.loader_pool import LoaderPool
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.services import ReadServices
from mountd.jobs.registry import JobRegistry
from mountd.view.view_jobs import ViewJobs
from quiverfs import digest as digest_format
from quiverfs import ownership
from quiverfs.backends import StorageOptions, open_backend
from quiverfs.background import BackgroundTasks
from quiverfs.counters import FetchCause
from quiverfs.dataset_name import check_name
from quiverfs.digest import Digest
from quiverfs.digest_checks import decode_peak
from quiverfs.errors import ExitCode, QuietError
from quiverfs.failure_runs import FailureRuns
from quiverfs.fs_identity import IdentityUnavailable, UserIdentity, acting_as, open_regular
from quiverfs.gcs_endpoint import check_allowed, check_endpoint
from quiverfs.heartbeat import to_wire

log = logging.getLogger(__name__)

PREFETCH_BATCH = 256  # entries checked against the store per thread call
# Largest item mountd serves: a read holds its item in memory, once per reader thread.
MAX_ITEM_BYTES = 1 << 30


class Controller:
    """Owns the mount table's membership; every change is persisted in the registry."""

    def __init__(self, root: str, table: MountTable, registry: Registry,
                 services: ReadServices, jobs: JobRegistry, views: ViewJobs,
                 peer_service: PeerService | None, prefetch_concurrency: int,
                 memory: MemoryBudget, fuse_mode: str,
                 loader_pools: dict[str, LoaderPool], endpoints: tuple[str, ...] = (),
                 quota: Quota = Quota()) -> None:
        self.root = root
        self.endpoints = endpoints  # the GCS endpoints users other than root may name
        self.fuse_mode = fuse_mode  # how dataset files are served: "no-open" or "open"
        self.loader_pools = loader_pools  # by name, for status
        self.table = table
        self.registry = registry
        self.reader = services.reader
        self.store = services.store
        self.stats = services.stats
        self.integrity = services.integrity
        self.push = services.push
        self.jobs = jobs
        self.views = views
        self.limiter = services.limiter
        self.cluster = services.cluster
        self.peer_service = peer_service  # with --coordinator
        self.prefetch_concurrency = prefetch_concurrency
        self.memory = memory
        self.quota = quota
        self.shared = SharedDigests()  # one copy per digest, whoever registered it
        self._lock = trio.Lock()
        self.tasks = BackgroundTasks()  # where prefetches run
        self._prefetch_scopes: dict[str, trio.CancelScope] = {}

    def handlers(self) -> dict[str, Any]:
        return {"mount": self.mount, "umount": self.umount, "status": self.status,
                "prefetch": self.prefetch, "cluster": self.cluster_status}

    # -- building datasets ------------------------------------------------------------
    def _build(self, reg: Registration, digest: Digest, cost: DigestCost,
               options: StorageOptions) -> MountedDataset:
        """The dataset of ``reg``, on the shared copies of ``digest``'s tree and pools,
        its bucket reached as ``options`` say."""
        tree = self.shared.tree(digest)
        pools = self.shared.pools(digest) if reg.view == "substitutable" else None
        backend = open_backend(digest.source, dataclasses.replace(
            options, fetch_deadline=self.registry.fetch_deadline))
        return MountedDataset(reg=reg, digest=digest, tree=tree, backend=backend,
                              inode_base=self.table.allocate_base(tree.n_nodes), cost=cost,
                              pools=pools, fetch_depth=self.reader.fetch_depth(backend))

    def restore(self) -> None:
        """Re-register the datasets persisted by an earlier run (before mounting)."""
        kept, dropped = [], []
        for reg in self.registry.load_records():
            try:
                check_name(reg.name)  # records from before a rule was tightened
                if reg.emulator_host is not None:  # or before root's allow-list changed
                    check_allowed(check_endpoint(reg.emulator_host, "its endpoint"), reg.uid,
                                  self.endpoints)
                self._check_free(reg.name)
                digest = (self.shared.digest(reg.identity)
                          or self.registry.load_digest(reg.identity))
                self._check_item_sizes(digest)
                ds = self._build(reg, digest, digest_cost(digest),
                                 self.registry.storage_options(reg))
            except QuietError as exc:
                log.error("dropping dataset %r: %s", reg.name, exc.message)
                dropped.append(reg)
                continue
            self.table.add(ds)
            self.reader.expect_misses(ds.backend)
            kept.append(reg)
            log.info("restored dataset %s (%d items)", reg.name, len(ds.digest))
        try:
            self.registry.save_records(kept)
        except OSError as exc:  # the records on disk stay as they were
            log.error("cannot save %s: %s", self.registry.state_dir, exc)
        else:
            try:  # a dropped registration's key (and digest, if unused) is not kept
                for reg in dropped:
                    self.registry.forget(reg, {r.identity for r in kept})
            except OSError as exc:
                log.error("cannot remove a dropped dataset's files from %s: %s",
                          self.registry.state_dir, exc)
        self._warn_over_memory()

    def _warn_over_memory(self) -> None:
        """Restored registrations are kept even past the limits (a run that took them
        allowed them); they count, so new ones are refused until enough are unmounted."""
        held, limits = self._held(), self.memory.limits
        over = sorted({h.uid for h in held if h.uid != 0
                       and charged(held, h.uid) > limits.per_uid})
        if over or charged(held) > limits.total:
            log.warning("the restored registrations take %d bytes of memory (limit %d), "
                        "uids over their %d-byte limit: %s; new registrations past the "
                        "limits are refused", charged(held), limits.total, limits.per_uid,
                        over or "none")

    def _held(self) -> list[Held]:
        return [Held.of(ds.reg, ds.cost) for ds in self.table.by_name.values()]

    @staticmethod
    def _check_local_access(digest: Digest, user: UserIdentity) -> None:
        """Open every file a ``file://`` digest names, as the registering user: a digest
        can only name files its owner can read (reads later open them as the owner too)."""
        if not digest.source.startswith("file://") or user.uid == 0:
            return
        root = digest.source[len("file://"):]
        seen: set[str] = set()
        try:
            with acting_as(user):
                for i in range(len(digest)):
                    key = digest.key(i)
                    if key in seen:
                        continue
                    seen.add(key)
                    path = os.path.join(root, key)
                    try:
                        os.close(open_regular(path))
                    except OSError as exc:
                        raise QuietError(f"uid {user.uid} cannot read {path} "
                                         f"({exc.strerror}): a digest can only name files "
                                         "its owner can read", ExitCode.PERMISSION) from None
        except IdentityUnavailable as exc:
            raise QuietError(str(exc), ExitCode.PERMISSION) from None

    @staticmethod
    def _check_item_sizes(digest: Digest) -> None:
        largest = max(digest.sizes, default=0)
        if largest > MAX_ITEM_BYTES:
            raise QuietError(f"{digest.name}: an item of {largest} bytes is larger than "
                             f"mountd serves ({MAX_ITEM_BYTES} bytes): split it into smaller "
                             "items", ExitCode.BAD_INPUT)

    async def _decode(self, data: bytes) -> Digest:
        """The copy in use of the digest file ``data``, else ``data`` decoded if the
        decoding fits in mountd's memory limit."""
        # in a worker: telling a repeat from another digest compares up to the whole file
        in_use = await trio.to_thread.run_sync(self.shared.find, data, limiter=self.limiter)
        if in_use is not None:
            return in_use
        self.memory.check_decode(self._held(), decode_peak(data))
        return await trio.to_thread.run_sync(digest_format.decode, data,
                                             "registered digest", limiter=self.limiter)

    async def _check_memory(self, uid: int, digest: Digest, view: str) -> DigestCost:
        """The estimated cost of registering ``digest`` in ``view`` for ``uid``, if it
        keeps the uid and everyone within their memory limits (else QuietError)."""
        cost = await trio.to_thread.run_sync(digest_cost, digest, limiter=self.limiter)
        self.memory.check(self._held(), Held(uid, digest.identity, view == "substitutable",
                                             cost))
        return cost

    # -- requests ---------------------------------------------------------------------
    async def mount(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        request = mount_request(peer, req, self.endpoints)
        name, data, view, options = request.name, request.data, request.view, request.options
        user = peer.user
        if options.credentials_info is not None:
            # Before the lock: a token endpoint that answers slowly holds up only this
            # request. A key that is refused leaves nothing behind.
            await trio.to_thread.run_sync(try_credentials, options.credentials_info,
                                          limiter=self.limiter)
        async with self._lock:
            self._check_free(name)
            mine = [ds.reg for ds in self.table.by_name.values() if ds.reg.uid == user.uid]
            self.quota.check_count(user, mine, self.integrity)
            # Nothing is written before every check has passed: a refused registration
            # leaves nothing behind on root's disk (and nothing is built in memory).
            digest = await self._decode(data)
            self.quota.check_digest_bytes(user, mine, digest.identity, len(data))
            cost = await self._check_memory(user.uid, digest, view)
            check_gcs_credentials(digest, options, user.uid)
            self._check_item_sizes(digest)
            if view == "substitutable" and not has_labels(digest):
                raise QuietError(f"digest {digest.name!r} has no labels, so nothing may stand "
                                 "in for anything: mount it without --view substitutable, "
                                 "or make the digest from class folders "
                                 "('quiver digest create --label-level N')",
                                 ExitCode.BAD_INPUT)
            await trio.to_thread.run_sync(self._check_local_access, digest, user,
                                          limiter=self.limiter)
            reg = new_registration(name, digest.identity, user, options, len(data), view)
            # The backend takes the request's credentials: the saved copy is for restarts.
            ds = await trio.to_thread.run_sync(self._build, reg, digest, cost, options,
                                               limiter=self.limiter)
            await trio.to_thread.run_sync(self.registry.keep, reg, data,
                                          options.credentials_info, limiter=self.limiter)
            # Saved before it is shown: a registration the disk did not take is not one.
            try:
                await self._save([*self._registrations(), reg])
            except QuietError:
                await self._forget(ds)
                await trio.to_thread.run_sync(ds.backend.close, limiter=self.limiter)
                raise
            self.table.add(ds)
            self.reader.expect_misses(ds.backend)
        await self.table.settle(ds)
        log.info("uid %d mounted %s (%s view): %d items from %s", peer.uid, name, view,
                 len(digest), digest.source)
        if request.prefetch:
            self._start_prefetch(ds)
        return {"path": os.path.join(self.root, name), "items": len(digest),
                "bytes": digest.total_bytes, "view": view}

    def _check_free(self, name: str) -> None:
        if name in self.table.by_name:
            raise QuietError(f"a dataset named {name!r} is already mounted at "
                             f"{os.path.join(self.root, name)}: pick another --name or "
                             f"'quiver umount {name}' first", ExitCode.BAD_INPUT)

    def _owned(self, peer: Peer, name: str) -> MountedDataset:
        ds = self.table.by_name.get(name)
        if ds is None or (peer.uid != 0 and ds.reg.uid != peer.uid):
            raise QuietError(f"no dataset named {name!r} is mounted at {self.root} "
                             "('quiver status' lists them)", ExitCode.NOT_FOUND)
        return ds

    async def umount(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        name = check_name(req["name"])
        async with self._lock:
            ds = self._owned(peer, name)
            # Saved first: while the disk takes no change, the dataset stays mounted.
            await self._save([r for r in self._registrations() if r is not ds.reg])
            scope = self._prefetch_scopes.pop(name, None)
            if scope is not None:
                scope.cancel()
            self.table.remove(name)
            self.jobs.dataset_removed(name)
            self.views.dataset_removed(name)
            await self._forget(ds)
        pyfuse3.invalidate_entry_async(pyfuse3.ROOT_INODE, name.encode(), ignore_enoent=True)
        await stop_fetches(ds, self.table.by_name.values(), self.loader_pools.values(),
                           self.limiter)
        log.info("uid %d unmounted %s", peer.uid, name)
        return {"name": name}

    def _registrations(self) -> list[Registration]:
        return [ds.reg for ds in self.table.by_name.values()]

    async def _save(self, regs: list[Registration]) -> None:
        """Save ``regs`` as the registrations on disk; QuietError if the disk refuses."""
        try:
            await trio.to_thread.run_sync(self.registry.save_records, regs,
                                          limiter=self.limiter)
        except OSError as exc:
            log.error("cannot save %s: %s", self.registry.state_dir, exc)
            raise QuietError(f"mountd cannot save its registrations: {exc.strerror or exc}",
                             ExitCode.DAEMON) from None

    async def _forget(self, ds: MountedDataset) -> None:
        """Remove what the registry keeps for ``ds`` that no other dataset uses."""
        still_used = {d.reg.identity for d in self.table.by_name.values()}
        await trio.to_thread.run_sync(self.registry.forget, ds.reg, still_used,
                                      limiter=self.limiter)

    async def status(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        store = self.store
        self.stats.gather()
        volume, items = await trio.to_thread.run_sync(
            lambda: (store.volume(), len(store)), limiter=self.limiter)
        datasets = []
        for ds in self.table.visible_to(peer.uid):
            entry = {"name": ds.name, "path": os.path.join(self.root, ds.name),
                     "uid": ds.reg.uid, "source": ds.digest.source, "items": len(ds.digest),
                     "bytes": ds.digest.total_bytes, "identity": ds.reg.identity,
                     "view": ds.reg.view, "fetch_depth": ds.fetch_depth,
                     "memory": ds.cost.digest + (ds.cost.pools if ds.pools is not None else 0),
                     "counters": dict(ds.counters),
                     "bucket_fetch_causes": ReadStats.by_cause(ds.counters)}
            if ds.prefetch is not None:
                entry["prefetch"] = vars(ds.prefetch).copy()
            datasets.append(entry)
        return {"root": self.root, "pid": os.getpid(), "cache": store.report(volume, items),
                "counters": dict(self.stats.counters),
                "bucket_fetch_causes": ReadStats.by_cause(self.stats.counters),
                "fuse_mode": self.fuse_mode,
                "data_path": self.stats.data_path,
                "native": dict(self.stats.native),
                "loader_processes": {name: pool.status()
                                     for name, pool in self.loader_pools.items()},
                "fuse_requests": dict(self.stats.fuse_requests),
                "push": {"budget": self.push.budget, "held": self.push.held},
                "memory": self.memory.status(self._held(), peer.uid),
                "datasets": datasets,
                "jobs": self.jobs.status(peer.uid),
                "view_jobs": self.views.status(peer.uid),
                "cluster": self.cluster.status()}

    async def cluster_status(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        """Members, each one's share of this node's datasets' keys, and the cycles of
        the caller's datasets (root: all)."""
        cluster = self.cluster
        mine = {ds.reg.identity for ds in self.table.visible_to(peer.uid)}
        live = cluster.live()
        digests = [ds.digest for ds in self.table.by_name.values()]
        hashes = [d.hash(i) for d in digests for i in range(0, len(d), max(1, len(d) // 2000))]
        shares = await trio.to_thread.run_sync(ownership.shares, hashes, live,
                                               limiter=self.limiter)
        total = max(1, len(hashes))
        return {"node": cluster.me, **cluster.coordinator_status(),
                "version": cluster.version,
                "nodes": [{"id": n, "peer": cluster.members[n], "live": n in live,
                           "share": round(shares.get(n, 0) / total, 3)}
                          for n in sorted(cluster.members)],
                "cycles": to_wire({key: cycle for key, cycle in cluster.cycles.items()
                                   if peer.uid == 0 or key in mine}),
                "jobs": self.jobs.status(peer.uid),
                "rejected_puts": self.peer_service.rejected_puts if self.peer_service else 0}

    async def prefetch(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        ds = self._owned(peer, check_name(req["name"]))
        self._start_prefetch(ds)
        return {"name": ds.name, "items": len(ds.digest)}

    # -- prefetch ---------------------------------------------------------------------
    def _start_prefetch(self, ds: MountedDataset) -> None:
        if ds.name in self._prefetch_scopes or not self.tasks.running:
            return
        scope = trio.CancelScope()
        self._prefetch_scopes[ds.name] = scope
        ds.prefetch = PrefetchProgress(len(ds.digest), ds.digest.total_bytes)
        self.tasks.start_soon(self._prefetch, ds, ds.prefetch, scope,
                                 name=f"prefetch {ds.name}")

    async def _prefetch(self, ds: MountedDataset, progress: PrefetchProgress,
                        scope: trio.CancelScope) -> None:
        """Warm the store with every entry of ``ds``, a bounded number at a time. An item
        that fails on a bug below counts as failed; a look-up in the store that fails
        ends the prefetch, the items it did not look at counted as failed. Left to
        propagate, either would end mountd for every user."""
        slots = trio.Semaphore(self.prefetch_concurrency)
        bugs = FailureRuns(log)  # items that failed on a bug, one after another

        async def one(index: int) -> None:
            try:
                await self.reader.fetch(ds, index, FetchCause.PREFETCH)
            except ReadFailed:
                progress.failed += 1
            except Exception:
                progress.failed += 1
                bugs.failed("prefetch of %s: item %d failed; counted as failed, the others "
                            "go on", ds.name, index)
            else:
                bugs.succeeded()
                progress.done_items += 1
                progress.done_bytes += ds.digest.sizes[index]
            finally:
                slots.release()

        with scope:
            async with trio.open_nursery() as nursery:
                for start in range(0, len(ds.digest), PREFETCH_BATCH):
                    batch = range(start, min(start + PREFETCH_BATCH, len(ds.digest)))
                    try:
                        present = await trio.to_thread.run_sync(
                            lambda: [ds.digest.hash(i) in self.store for i in batch],
                            limiter=self.limiter)
                    except Exception:
                        left = len(ds.digest) - start
                        log.exception("prefetch of %s: looking in the store failed; the "
                                      "prefetch ends, its %d items left counted as failed",
                                      ds.name, left)
                        progress.failed += left
                        break
                    for index, cached in zip(batch, present):
                        if cached:
                            progress.done_items += 1
                            progress.done_bytes += ds.digest.sizes[index]
                            continue
                        await slots.acquire()
                        nursery.start_soon(one, index)
            progress.finished = True
            log.info("prefetch of %s finished: %d items, %d failed", ds.name,
                     progress.done_items, progress.failed)
        self._prefetch_scopes.pop(ds.name, None)
