"""What the control socket can ask of mountd: mount, umount, status, prefetch."""
from __future__ import annotations

import logging
import os
from typing import Any

import pyfuse3
import trio

from mountd.access_check import AccessChecker
from mountd.control_server import Peer
from mountd.dataset import MountedDataset, PrefetchProgress
from mountd.dataset_tree import DatasetTree
from mountd.item_reader import ItemReader, ReadFailed
from mountd.jobs import JobManager
from mountd.mount_table import MountTable
from mountd.registry import Registration, Registry, check_name, new_registration
from quiverfs import ownership
from quiverfs.backends import StorageOptions
from quiverfs.digest import Digest
from quiverfs.errors import ExitCode, QuietError

log = logging.getLogger(__name__)

PREFETCH_BATCH = 256  # entries checked against the store per thread call


class Controller:
    """Owns the mount table's membership; every change is persisted in the registry."""

    def __init__(self, root: str, table: MountTable, registry: Registry, reader: ItemReader,
                 jobs: JobManager, prefetch_concurrency: int) -> None:
        self.root = root
        self.table = table
        self.registry = registry
        self.reader = reader
        self.jobs = jobs
        self.cluster: Any = None  # mountd.cluster.Cluster, wired by the daemon
        self.peer_service: Any = None  # mountd.peers.PeerService when clustered
        self.prefetch_concurrency = prefetch_concurrency
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._prefetch_scopes: dict[str, trio.CancelScope] = {}

    def handlers(self) -> dict[str, Any]:
        return {"mount": self.mount, "umount": self.umount, "status": self.status,
                "prefetch": self.prefetch, "cluster": self.cluster_status}

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery that background prefetches run in."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- building datasets ------------------------------------------------------------
    def _build(self, reg: Registration, digest: Digest) -> MountedDataset:
        tree = DatasetTree(digest)
        backend = self.registry.open_backend(reg, digest)
        return MountedDataset(reg=reg, digest=digest, tree=tree, backend=backend,
                              inode_base=self.table.allocate_base(tree.n_nodes))

    def restore(self) -> None:
        """Re-register the datasets persisted by an earlier run (before mounting)."""
        kept = []
        for reg in self.registry.load_records():
            try:
                ds = self._build(reg, self.registry.load_digest(reg.identity))
            except QuietError as exc:
                log.error("dropping dataset %s: %s", reg.name, exc.message)
                continue
            self.table.add(ds)
            kept.append(reg)
            log.info("restored dataset %s (%d items)", reg.name, len(ds.digest))
        self.registry.save_records(kept)

    @staticmethod
    def _check_local_access(digest: Digest, peer: Peer) -> None:
        if not digest.source.startswith("file://") or peer.uid == 0:
            return
        root = digest.source[len("file://"):]
        checker = AccessChecker(peer.uid, peer.groups)
        for i in range(len(digest)):
            path = os.path.join(root, digest.key(i))
            if not checker.can_read(path):
                raise QuietError(f"uid {peer.uid} cannot read {path}: a digest can only name "
                                 "files its owner can read", ExitCode.PERMISSION)

    @staticmethod
    def _check_gcs_credentials(digest: Digest, options: StorageOptions, peer: Peer) -> None:
        """A user's gs:// registration must bring its own access: mountd's credentials
        (root's, or the VM's service account) are never lent to another user."""
        if (digest.source.startswith("gs://") and peer.uid != 0
                and options.credentials_info is None and not options.anonymous
                and not options.emulator_host):
            raise QuietError(f"{digest.source}: pass --credentials FILE (a service-account "
                             "key you may use) or --anonymous for a public bucket; mountd "
                             "does not lend its own credentials", ExitCode.PERMISSION)

    # -- requests ---------------------------------------------------------------------
    async def mount(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        name = check_name(str(req["name"]))
        data = req["digest"]
        if not isinstance(data, bytes):
            raise QuietError("the digest must be sent as bytes", ExitCode.USAGE)
        options = StorageOptions(credentials_info=req.get("credentials"),
                                 emulator_host=req.get("emulator_host"),
                                 anonymous=bool(req.get("anonymous", False)))
        async with self._lock:
            self._check_free(name)
            digest = await trio.to_thread.run_sync(self.registry.store_digest, data)
            await trio.to_thread.run_sync(self._check_local_access, digest, peer)
            self._check_gcs_credentials(digest, options, peer)
            reg = new_registration(name, digest.identity, peer.uid, peer.gid, options)
            self.registry.store_credentials(name, options.credentials_info)
            ds = await trio.to_thread.run_sync(self._build, reg, digest)
            self.table.add(ds)
            self._save()
        log.info("uid %d mounted %s: %d items from %s", peer.uid, name, len(digest),
                 digest.source)
        if req.get("prefetch"):
            self._start_prefetch(ds)
        return {"path": os.path.join(self.root, name), "items": len(digest),
                "bytes": digest.total_bytes}

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
        name = str(req["name"])
        async with self._lock:
            self._owned(peer, name)
            scope = self._prefetch_scopes.pop(name, None)
            if scope is not None:
                scope.cancel()
            ds = self.table.remove(name)
            self.jobs.dataset_removed(name)
            self._save()
            self.registry.forget(ds.reg, {d.reg.identity for d in self.table.by_name.values()})
        pyfuse3.invalidate_entry_async(pyfuse3.ROOT_INODE, name.encode(), ignore_enoent=True)
        await trio.to_thread.run_sync(ds.backend.close)
        log.info("uid %d unmounted %s", peer.uid, name)
        return {"name": name}

    def _save(self) -> None:
        self.registry.save_records([ds.reg for ds in self.table.by_name.values()])

    async def status(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        store = self.reader.store
        volume, items = await trio.to_thread.run_sync(
            lambda: (store.volume(), len(store)), limiter=self.reader.limiter)
        datasets = []
        for ds in self.table.visible_to(peer.uid):
            entry = {"name": ds.name, "path": os.path.join(self.root, ds.name),
                     "uid": ds.reg.uid, "source": ds.digest.source, "items": len(ds.digest),
                     "bytes": ds.digest.total_bytes, "identity": ds.reg.identity,
                     "counters": dict(ds.counters)}
            if ds.prefetch is not None:
                entry["prefetch"] = vars(ds.prefetch).copy()
            datasets.append(entry)
        return {"root": self.root, "pid": os.getpid(),
                "cache": {"size_limit": store.size_limit, "used_bytes": volume, "items": items,
                          "corrupt_dropped": store.corrupt_dropped},
                "counters": dict(self.reader.counters), "datasets": datasets,
                "jobs": self.jobs.status(peer.uid),
                "cluster": self.cluster.status() if self.cluster is not None else None}

    async def cluster_status(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        """Members, each one's share of this node's datasets' keys, and the cycles."""
        cluster = self.cluster
        live = cluster.live()
        digests = [ds.digest for ds in self.table.by_name.values()]
        hashes = [d.hash(i) for d in digests for i in range(0, len(d), max(1, len(d) // 2000))]
        shares = await trio.to_thread.run_sync(ownership.shares, hashes, live)
        total = max(1, len(hashes))
        return {"node": cluster.me, "coordinator_ok": cluster.coordinator_ok,
                "version": cluster.version,
                "nodes": [{"id": n, "peer": cluster.members[n], "live": n in live,
                           "share": round(shares.get(n, 0) / total, 3)}
                          for n in sorted(cluster.members)],
                "cycles": cluster.cycles,
                "jobs": self.jobs.status(peer.uid),
                "rejected_puts": self.peer_service.rejected_puts if self.peer_service else 0}

    async def prefetch(self, peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        ds = self._owned(peer, str(req["name"]))
        self._start_prefetch(ds)
        return {"name": ds.name, "items": len(ds.digest)}

    # -- prefetch ---------------------------------------------------------------------
    def _start_prefetch(self, ds: MountedDataset) -> None:
        if ds.name in self._prefetch_scopes or self._nursery is None:
            return
        scope = trio.CancelScope()
        self._prefetch_scopes[ds.name] = scope
        ds.prefetch = PrefetchProgress(len(ds.digest), ds.digest.total_bytes)
        self._nursery.start_soon(self._prefetch, ds, ds.prefetch, scope,
                                 name=f"prefetch {ds.name}")

    async def _prefetch(self, ds: MountedDataset, progress: PrefetchProgress,
                        scope: trio.CancelScope) -> None:
        """Warm the store with every entry of ``ds``, a bounded number at a time."""
        slots = trio.Semaphore(self.prefetch_concurrency)

        async def one(index: int) -> None:
            try:
                await self.reader.fetch(ds, index)
            except ReadFailed:
                progress.failed += 1
            else:
                progress.done_items += 1
                progress.done_bytes += ds.digest.sizes[index]
            finally:
                slots.release()

        with scope:
            async with trio.open_nursery() as nursery:
                for start in range(0, len(ds.digest), PREFETCH_BATCH):
                    batch = range(start, min(start + PREFETCH_BATCH, len(ds.digest)))
                    present = await trio.to_thread.run_sync(
                        lambda: [ds.digest.hash(i) in self.reader.store for i in batch],
                        limiter=self.reader.limiter)
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
